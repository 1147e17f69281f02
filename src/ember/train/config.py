"""``TrainConfig``: the options of :func:`ember.train.fit`, one group per component.

Each group is a dataclass with its own ``check()``; ``TrainConfig.check()`` checks them all and
what spans groups. The flat keywords of earlier versions (``TrainConfig(swa_start=3,
swa_lr=0.05)``) still work, with a DeprecationWarning, and so does reading them
(``config.swa_start``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any, cast

from ember.train.errors import ConfigError
from ember.train.options import Option, Rule, check_fields, option, options_of, violation

__all__ = ["CheckpointConfig", "EMAConfig", "LogConfig", "SWAConfig", "SWAGConfig",
           "ScheduleConfig", "StepConfig", "TrainConfig", "train_options"]

PRECISIONS = ("fp32", "bf16", "fp16")  # as ember.train.precision.PRECISIONS, without torch
SWA_SCHEDULES = ("anneal", "constant", "cyclic")


@dataclass
class StepConfig:
    """How an optimizer step is made: precision, gradient accumulation, clipping."""

    precision: str = option("fp32", Rule.CHOICE, "fp32; bf16 autocast; fp16 autocast with "
                            "GradScaler (overflowing steps skipped and counted)",
                            choices=PRECISIONS)
    accumulate: int = option(1, Rule.INT_POSITIVE, "micro-batches per optimizer step (the loss "
                             "is divided by it)", maximum=2**20)
    max_grad_norm: float | None = option(None, Rule.POSITIVE, "clip the total gradient norm to "
                                         "this (after fp16 unscaling)", flag="--clip-grad-norm")
    max_grad_value: float | None = option(None, Rule.POSITIVE, "clamp every gradient element to "
                                          "[-this, this] (after fp16 unscaling, before norm "
                                          "clipping)", flag="--clip-grad-value")

    def check(self) -> None:
        check_fields(self)


@dataclass
class ScheduleConfig:
    """When the user's learning-rate scheduler is stepped (outside the SWA phase)."""

    interval: str = option("epoch", Rule.CHOICE, "step the scheduler after every epoch or "
                           "optimizer step", choices=("epoch", "step"), cli=False)

    def check(self) -> None:
        check_fields(self, prefix="scheduler_")


@dataclass
class SWAConfig:
    """The SWA phase: from epoch ``start`` the rate follows ``schedule`` and the weights are
    averaged after each epoch, every ``every_steps`` steps, or at cycle ends."""

    start: int | None = option(None, Rule.INT_NONNEGATIVE, "first epoch (0-based) of the SWA "
                               "phase", maximum=10**6)
    lr: float | None = option(None, Rule.POSITIVE, "the SWA learning rate")
    anneal_epochs: int = option(1, Rule.INT_POSITIVE, "epochs of annealing to the SWA rate",
                                maximum=10**6)
    anneal_strategy: str = option("cos", Rule.CHOICE, "shape of the annealing",
                                  choices=("cos", "linear"))
    schedule: str = option("anneal", Rule.CHOICE, "anneal: SWALR to the SWA rate; constant: "
                           "the SWA rate at once; cyclic: per-step cycles from the maximum rate "
                           "down to the SWA rate",
                           choices=SWA_SCHEDULES)
    every_steps: int | None = option(None, Rule.INT_POSITIVE, "collect every this many optimizer "
                                     "steps instead of at epoch ends (with the cyclic schedule: "
                                     "fast-SWA)")
    lr_max: float | None = option(None, Rule.POSITIVE, "cyclic: the rate at each cycle's start")
    cycle: int | None = option(None, Rule.INT_POSITIVE, "cyclic: steps per cycle")
    cycle_shape: str = option("linear", Rule.CHOICE, "cyclic: the shape of a cycle",
                              choices=("linear", "cosine"))
    collect_start: float = option(0.0, Rule.FRACTION, "fast-SWA: where in a cycle collection "
                                  "starts (a fraction of the cycle)")
    bn_batches: int | None = option(None, Rule.INT_POSITIVE, "at most this many batches for "
                                    "each BatchNorm recomputation of the SWA model",
                                    name="bn_batches", cli=False)

    def check(self, epochs: int) -> None:
        check_fields(self, prefix="swa_")
        if self.start is None:
            named = [o.name for o in options_of(SWAConfig, prefix="swa_")
                     if getattr(self, o.field) != o.default]
            raise ConfigError(f"{named[0] if named else 'swa'} is set but swa_start is None (no "
                              "SWA phase)")
        if not self.start < epochs:
            raise ConfigError(f"swa_start must be an epoch in [0, epochs={epochs}), got "
                              f"{self.start!r}")
        if self.lr is None:
            raise ConfigError(f"swa_start needs swa_lr > 0, got swa_lr={self.lr!r}")
        if self.schedule == "cyclic":
            self._check_cycle()
        elif self.cycle is not None or self.lr_max is not None:
            raise ConfigError("swa_cycle and swa_lr_max are for swa_schedule='cyclic', got "
                              f"swa_schedule={self.schedule!r}")

    def _check_cycle(self) -> None:
        if self.cycle is None:
            raise ConfigError("swa_schedule='cyclic' needs swa_cycle (steps per cycle)")
        if self.lr_max is None or not self.lr_max >= self.lr:  # type: ignore[operator]
            raise ConfigError(f"swa_schedule='cyclic' needs swa_lr_max >= swa_lr, got "
                              f"swa_lr_max={self.lr_max!r}, swa_lr={self.lr!r}")
        if self.every_steps is not None and self.every_steps > self.cycle:
            raise ConfigError(f"swa_every_steps={self.every_steps} is longer than "
                              f"swa_cycle={self.cycle}")


@dataclass
class SWAGConfig:
    """A SWAG posterior collected with SWA (the paper uses rank 20; it keeps rank + 2 copies of
    the weights)."""

    rank: int = option(20, Rule.INT_POSITIVE, "deviation rank of the SWAG posterior collected "
                       "with SWA", maximum=1024)
    diagonal: bool = option(False, Rule.BOOL, "no deviation ring (diagonal covariance only)",
                            cli=False)
    device: str = option("cpu", Rule.ANY, "where the posterior's statistics live", cli=False)
    params: tuple[str, ...] | None = option(None, Rule.NAMES, "parameter names to build the "
                                            "posterior over (default: all)", cli=False)

    def check(self) -> None:
        if self.rank is None:
            raise ConfigError(_set_without("swag_rank", self, "swag_", "no SWAG"))
        check_fields(self, prefix="swag_")


@dataclass
class EMAConfig:
    """An exponential moving average of the weights, updated after every optimizer step."""

    decay: float = option(0.999, Rule.FRACTION, "keep an EMA of the weights with this decay")
    warmup: str = option("tf", Rule.CHOICE, "EMA warm-up: tf (min(decay, (1 + k) / (10 + k))), "
                         "power (timm's), off", choices=("tf", "power", "off"))

    def __post_init__(self) -> None:
        if self.warmup is True or self.warmup is False:  # the bools of earlier versions
            self.warmup = "tf" if self.warmup else "off"

    def check(self) -> None:
        self.__post_init__()  # a bool set after construction
        if self.decay is None:
            raise ConfigError(_set_without("ema_decay", self, "ema_", "no EMA"))
        check_fields(self, prefix="ema_")


@dataclass
class CheckpointConfig:
    """Where checkpoints go and where a run resumes from."""

    dir: str | os.PathLike | None = option(None, Rule.ANY, "write last.pt here after every "
                                           "epoch", cli=False)
    every: int | None = option(None, Rule.INT_POSITIVE, "also checkpoint every this many "
                               "optimizer steps", maximum=10**12)
    resume: str | os.PathLike | None = option(None, Rule.ANY, "a checkpoint file or folder, or "
                                              "'auto'", name="resume", cli=False)

    def check(self) -> None:
        check_fields(self, prefix="checkpoint_")
        if self.every is not None and self.dir is None:
            raise ConfigError("checkpoint_every needs checkpoint_dir")


@dataclass
class LogConfig:
    """The metrics log and the progress bars."""

    metrics_path: str | os.PathLike | None = option(None, Rule.ANY, "JSON-lines log of steps "
                                                    "and epochs", cli=False)
    log_every: int = option(1, Rule.INT_POSITIVE, "log every this many optimizer steps",
                            cli=False)
    progress: bool = option(True, Rule.BOOL, "progress bars (rank 0)", cli=False)

    def check(self) -> None:
        check_fields(self)


# group attribute -> (its class, the prefix of its options' names, whether it may be None)
_GROUPS: dict[str, tuple[type, str, bool]] = {
    "step": (StepConfig, "", False),
    "schedule": (ScheduleConfig, "scheduler_", False),
    "swa": (SWAConfig, "swa_", True),
    "swag": (SWAGConfig, "swag_", True),
    "ema": (EMAConfig, "ema_", True),
    "checkpoint": (CheckpointConfig, "checkpoint_", False),
    "log": (LogConfig, "", False),
}


@dataclass(init=False)
class TrainConfig:
    """Options of :func:`ember.train.fit`, one group per concern (checked by :meth:`check`;
    every mistake is a :class:`ConfigError` naming the option).

    ``TrainConfig(epochs=20, swa=SWAConfig(start=15, lr=0.05), ema=EMAConfig(0.999))``. A group
    that is None is off (``swa``, ``swag``, ``ema``); the others always apply.
    """

    epochs: int = option(10, Rule.INT_POSITIVE, "passes over the training data", maximum=10**6)
    seed: int | None = option(0, Rule.INT_NONNEGATIVE, "key of the ember.csprng generator of "
                              "this run (None: keyed from the OS)", cli=False,
                              optional=True)
    device: str = option("cpu", Rule.ANY, "where the model trains", cli=False)
    step: StepConfig = dataclasses.field(default_factory=StepConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    swa: SWAConfig | None = None
    swag: SWAGConfig | None = None
    ema: EMAConfig | None = None
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)

    def __init__(self, epochs: int = 10, seed: int | None = 0, device: str = "cpu", *,
                 step: StepConfig | None = None, schedule: ScheduleConfig | None = None,
                 swa: SWAConfig | None = None, swag: SWAGConfig | None = None,
                 ema: EMAConfig | None = None, checkpoint: CheckpointConfig | None = None,
                 log: LogConfig | None = None, **flat: Any) -> None:
        self.epochs, self.seed, self.device = epochs, seed, device
        self.step = step if step is not None else StepConfig()
        self.schedule = schedule if schedule is not None else ScheduleConfig()
        self.swa, self.swag, self.ema = swa, swag, ema
        self.checkpoint = checkpoint if checkpoint is not None else CheckpointConfig()
        self.log = log if log is not None else LogConfig()
        if flat:
            self._set_flat(flat)

    def _set_flat(self, flat: dict[str, Any]) -> None:
        """The keywords of earlier versions, put into their groups."""
        legacy = _legacy_names()
        unknown = sorted(set(flat) - set(legacy))
        if unknown:
            raise TypeError(f"TrainConfig got an unexpected keyword argument {unknown[0]!r}")
        warnings.warn(f"TrainConfig({', '.join(f'{k}=' for k in flat)}...): flat keywords are "
                      f"deprecated; use the groups ("
                      f"{', '.join(sorted({_flat_spelling(legacy[k]) for k in flat}))})",
                      DeprecationWarning, stacklevel=3)
        for name, value in flat.items():
            self._set_option(legacy[name], value)

    def _set_option(self, opt: Option, value: Any) -> None:
        if opt.name == "ema_warmup" and isinstance(value, bool):  # the bool of earlier versions
            value = "tf" if value else "off"
        if not opt.group:
            object.__setattr__(self, opt.field, value)
            return
        if _is_switch(opt) and value is None:  # the old way to turn a group off
            object.__setattr__(self, opt.group, None)
            return
        group = self.__dict__.get(opt.group)
        if group is None:
            if not _turns_on(opt, value):  # a group left off: its value kept and checked
                off = self.__dict__.setdefault("_off_group_values", {})
                off[opt.name] = (opt, value)
                return
            group = _GROUPS[opt.group][0]()
            if not _is_switch(opt) and opt.group == "swag":
                group.rank = None  # not given: check() says so
        else:  # copied first: another config (dataclasses.replace) or the caller may share it
            group = dataclasses.replace(group)
        object.__setattr__(self, opt.group, group)
        setattr(group, opt.field, value)

    def __getattr__(self, name: str) -> Any:
        # only called for names that are not attributes: the flat names of earlier versions
        opt = _legacy_names().get(name)
        if opt is None or name.startswith("__"):
            raise AttributeError(f"'TrainConfig' object has no attribute {name!r}")
        group = self.__dict__.get(opt.group) if opt.group else self
        if group is None:
            off = self.__dict__.get("_off_group_values", {})
            if name in off:
                return off[name][1]
            return None if _is_switch(opt) or opt.default is None else opt.default
        return getattr(group, opt.field)

    def __setattr__(self, name: str, value: Any) -> None:
        opt = _legacy_names().get(name) if name not in _OWN_FIELDS else None
        if opt is None:
            object.__setattr__(self, name, value)
            return
        warnings.warn(f"TrainConfig.{name} = ...: flat options are deprecated; set "
                      f"{opt.group}.{opt.field}", DeprecationWarning, stacklevel=2)
        self._set_option(opt, value)

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid option."""
        check_fields(self)
        for opt, value in self.__dict__.get("_off_group_values", {}).values():
            wrong = violation(opt, value)
            if wrong is not None:
                raise ConfigError(f"{opt.name} {wrong}")
        for attr, (cls, _, optional) in _GROUPS.items():
            group = getattr(self, attr)
            if group is None and optional:
                continue
            if not isinstance(group, cls):
                raise ConfigError(f"TrainConfig.{attr} must be a {cls.__name__}"
                                  + (" or None" if optional else "") + f", got {group!r}")
            if isinstance(group, SWAConfig):
                group.check(self.epochs)
            else:
                cast(Any, group).check()
        if self.swag is not None and self.swa is None:
            raise ConfigError("swag_rank is set but swa_start is None (SWAG is collected in the "
                              "SWA phase)")


def _set_without(switch: str, group: Any, prefix: str, meaning: str) -> str:
    """The message for options of a group whose switch was not given."""
    named = [o.name for o in options_of(type(group), prefix=prefix)
             if o.name != switch and getattr(group, o.field) != o.default]
    return f"{'/'.join(named) or 'the group'} {'is' if len(named) == 1 else 'are'} set but " \
           f"{switch} is None ({meaning})"


# the flat options that turn their group on when set (to other than their default), as the checks
# of the versions before the groups required their switch for them; the others only tune a group
_TURN_ON = {"swa_start", "swa_lr", "swa_every_steps", "swa_schedule", "swa_cycle", "swa_lr_max",
            "swag_rank", "swag_diagonal", "swag_params", "ema_decay"}


def _turns_on(opt: Option, value: Any) -> bool:
    """Whether setting a flat option of an optional group that is off turns the group on."""
    if value is None or opt.name not in _TURN_ON:
        return False
    return _is_switch(opt) or value != opt.default


def _is_switch(opt: Option) -> bool:
    return opt.group in ("swag", "ema") and opt.field in ("rank", "decay")


def _flat_spelling(opt: Option) -> str:
    cls = _GROUPS[opt.group][0].__name__ if opt.group else "TrainConfig"
    return f"{opt.group}={cls}(...)" if opt.group else "TrainConfig(...)"


_LEGACY: dict[str, Option] = {}
_OWN_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def _legacy_names() -> dict[str, Option]:
    """Flat option name -> option, for every option of every group."""
    if not _LEGACY:
        _LEGACY.update({o.name: o for o in train_options()})
    return _LEGACY


def train_options() -> list[Option]:
    """Every option of :class:`TrainConfig`, its own and its groups', in declaration order."""
    out = list(options_of(TrainConfig))
    for attr, (cls, prefix, _) in _GROUPS.items():
        out.extend(options_of(cls, group=attr, prefix=prefix))
    return out
