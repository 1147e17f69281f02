"""``fit``: an explicit training loop over ember's pieces.

One epoch reads the loader once. Every batch is a micro-batch; every ``accumulate`` micro-batches
make one optimizer step: (fp16) unscale, clip, optional secure noise, step, one scaler update.
In the SWA phase (from ``swa_start``) the weights are folded into SWA and SWAG at the end of each
epoch or every ``swa_every_steps`` steps (or at fast-SWA's points of a cyclic rate); before it the
user's scheduler is stepped per epoch or per step. Checkpoints are taken only between
optimizer steps, so a resumed run repeats exactly what the interrupted one would have done.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ember.swa import EMA, SWA, SWAG, SWALR, CyclicSWALR, update_bn
from ember.swa.bn import has_running_stats
from ember.swa.fastswa import FastSWASchedule
from ember.swa.schedules import is_cycle_end
from ember.train.checkpoint import (
    CHECKPOINT_NAME,
    find_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    weights_digest,
)
from ember.train.distributed import (
    World,
    all_gather_objects,
    broadcast_buffers_,
    init_from_env,
    shutdown,
    wrap_model,
)
from ember.train.errors import ConfigError
from ember.train.metrics_log import MetricsLog
from ember.train.noise import GaussianGradientNoise
from ember.train.precision import PRECISIONS, Precision
from ember.train.privacy import PrivacyConfig

__all__ = ["TrainConfig", "TrainResult", "evaluate", "fit", "predict"]


SWA_SCHEDULES = ("anneal", "constant", "cyclic")


@dataclass
class TrainConfig:
    """Options of :func:`fit` (checked by :meth:`check`; every mistake is a :class:`ConfigError`).

    - ``epochs``: passes over the training loader.
    - ``precision``: ``"fp32"``, ``"bf16"`` (autocast, no loss scaling) or ``"fp16"`` (autocast
      with ``torch.amp.GradScaler``; overflowing steps are skipped and counted).
    - ``accumulate``: micro-batches per optimizer step (the loss is divided by it). Micro-batches
      left over at the end of an epoch are discarded and counted.
    - ``max_grad_norm``: clip the total gradient norm (after unscaling) to this.
    - ``swa_start``: first epoch (0-based) of the SWA phase, or None for no SWA. In the phase the
      learning rate follows ``swa_schedule`` and, after each epoch (or every ``swa_every_steps``
      optimizer steps), the weights are added to SWA and (if ``swag_rank`` is set: opt-in, the
      paper uses 20, and it keeps ``swag_rank + 2`` copies of the weights) to a SWAG posterior of
      that rank. ``swa_schedule``: ``"anneal"`` (SWALR to ``swa_lr`` over ``swa_anneal_epochs``
      epochs, ``swa_anneal_strategy`` ``"cos"`` or ``"linear"``), ``"constant"`` (``swa_lr`` from
      the first step of the phase) or ``"cyclic"`` (per step from ``swa_lr_max`` down to
      ``swa_lr`` in cycles of ``swa_cycle`` steps, ``swa_cycle_shape`` ``"linear"`` or
      ``"cosine"`` (fast-SWA's reference); collection at each cycle end, or, with
      ``swa_every_steps``, fast-SWA: every that many steps back from each cycle end within the
      window from ``swa_collect_start`` (a fraction of the cycle; 0, the default, is the whole
      cycle as in the reference, 0.5 the late half), see :class:`ember.swa.FastSWASchedule`).
    - SWAG: ``swag_device`` (where its statistics live, CPU by default), ``swag_diagonal``
      (no deviation ring), ``swag_params`` (parameter names to build the posterior over).
    - ``scheduler_interval``: step the user's ``scheduler`` after every ``"epoch"`` or every
      optimizer ``"step"`` (outside the SWA phase).
    - ``bn_batches``: at most that many batches of ``bn_loader`` for each BatchNorm
      recomputation of the SWA model (None: all).
    - ``ema_decay``: keep an :class:`ember.swa.EMA` of the weights, updated after every optimizer
      step, with the warm-up of :func:`ember.swa.ema_decay` unless ``ema_warmup=False``; it is
      checkpointed and returned as ``TrainResult.ema``.
    - ``noise_multiplier``: add secure Gaussian noise of std ``noise_multiplier * max_grad_norm``
      to the clipped gradients (DP-SGD style; not a privacy accountant, see docs/train.md).
    - ``seed``: key of the ember.csprng generator the noise comes from (each rank uses
      ``fold_in(rank)``); None keys it from the OS (secure, not reproducible across fresh runs,
      but still restored exactly from a checkpoint).
    - ``checkpoint_dir``: write ``last.pt`` there at the end of every epoch and, with
      ``checkpoint_every``, every that many steps (with ``privacy`` it holds the noise key and is
      written owner-only: never publish it). ``resume``: a checkpoint file or directory, or
      ``"auto"`` (the last checkpoint in ``checkpoint_dir`` if any).
    - ``metrics_path``: JSON-lines log of steps (every ``log_every``) and epochs.
    - ``progress``: tqdm bars (rank 0 only). ``device``: where the model trains.
    """

    epochs: int = 10
    precision: str = "fp32"
    accumulate: int = 1
    max_grad_norm: float | None = None
    swa_start: int | None = None
    swa_lr: float | None = None
    swa_anneal_epochs: int = 1
    swag_rank: int | None = None
    swa_every_steps: int | None = None
    swa_schedule: str = "anneal"
    swa_anneal_strategy: str = "cos"
    swa_lr_max: float | None = None
    swa_cycle: int | None = None
    swa_cycle_shape: str = "linear"
    swa_collect_start: float = 0.0
    swag_diagonal: bool = False
    swag_device: str = "cpu"
    swag_params: tuple[str, ...] | None = None
    scheduler_interval: str = "epoch"
    bn_batches: int | None = None
    ema_decay: float | None = None
    ema_warmup: bool = True
    noise_multiplier: float | None = None
    seed: int | None = 0
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int | None = None
    resume: str | os.PathLike | None = None
    metrics_path: str | os.PathLike | None = None
    log_every: int = 1
    progress: bool = True
    device: str = "cpu"

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid option."""
        def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")

        positive_int("epochs", self.epochs)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; expected one of "
                              f"{', '.join(PRECISIONS)}")
        positive_int("accumulate", self.accumulate)
        positive_int("swa_anneal_epochs", self.swa_anneal_epochs)
        positive_int("swag_rank", self.swag_rank, allow_none=True)
        if self.ema_decay is not None and (isinstance(self.ema_decay, bool)
                                           or not 0.0 <= self.ema_decay <= 1.0):
            raise ConfigError(f"ema_decay must be in [0, 1] or None, got {self.ema_decay!r}")
        positive_int("checkpoint_every", self.checkpoint_every, allow_none=True)
        positive_int("log_every", self.log_every)
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be > 0, got {self.max_grad_norm!r}")
        if self.swa_start is not None:
            if isinstance(self.swa_start, bool) or not isinstance(self.swa_start, int) \
                    or not 0 <= self.swa_start < self.epochs:
                raise ConfigError(f"swa_start must be an epoch in [0, epochs={self.epochs}), "
                                  f"got {self.swa_start!r}")
            if self.swa_lr is None or not self.swa_lr > 0:
                raise ConfigError(f"swa_start needs swa_lr > 0, got swa_lr={self.swa_lr!r}")
        elif self.swa_lr is not None:
            raise ConfigError("swa_lr is set but swa_start is None (no SWA phase)")
        positive_int("swa_every_steps", self.swa_every_steps, allow_none=True)
        positive_int("swa_cycle", self.swa_cycle, allow_none=True)
        positive_int("bn_batches", self.bn_batches, allow_none=True)
        if self.swa_every_steps is not None and self.swa_start is None:
            raise ConfigError("swa_every_steps is set but swa_start is None (no SWA phase)")
        if self.swa_schedule not in SWA_SCHEDULES:
            raise ConfigError(f"unknown swa_schedule {self.swa_schedule!r}; expected one of "
                              f"{', '.join(SWA_SCHEDULES)}")
        if self.swa_anneal_strategy not in ("cos", "linear"):
            raise ConfigError(f"swa_anneal_strategy must be 'cos' or 'linear', got "
                              f"{self.swa_anneal_strategy!r}")
        if self.swa_schedule == "cyclic":
            if self.swa_start is None:
                raise ConfigError("swa_schedule='cyclic' needs swa_start (the SWA phase)")
            if self.swa_cycle is None:
                raise ConfigError("swa_schedule='cyclic' needs swa_cycle (steps per cycle)")
            if self.swa_lr_max is None or not self.swa_lr_max >= self.swa_lr:
                raise ConfigError(f"swa_schedule='cyclic' needs swa_lr_max >= swa_lr, got "
                                  f"swa_lr_max={self.swa_lr_max!r}, swa_lr={self.swa_lr!r}")
            if self.swa_every_steps is not None and self.swa_every_steps > self.swa_cycle:
                raise ConfigError(f"swa_every_steps={self.swa_every_steps} is longer than "
                                  f"swa_cycle={self.swa_cycle}")
        else:
            if self.swa_cycle is not None or self.swa_lr_max is not None:
                raise ConfigError("swa_cycle and swa_lr_max are for swa_schedule='cyclic', got "
                                  f"swa_schedule={self.swa_schedule!r}")
        if self.swa_cycle_shape not in ("linear", "cosine"):
            raise ConfigError(f"swa_cycle_shape must be 'linear' or 'cosine', got "
                              f"{self.swa_cycle_shape!r}")
        if isinstance(self.swa_collect_start, bool) \
                or not isinstance(self.swa_collect_start, (int, float)) \
                or not 0.0 <= self.swa_collect_start <= 1.0:
            raise ConfigError(f"swa_collect_start must be a fraction of the cycle in [0, 1], got "
                              f"{self.swa_collect_start!r}")
        if self.scheduler_interval not in ("epoch", "step"):
            raise ConfigError(f"scheduler_interval must be 'epoch' or 'step', got "
                              f"{self.scheduler_interval!r}")
        if not isinstance(self.swag_diagonal, bool):
            raise ConfigError(f"swag_diagonal must be a bool, got {self.swag_diagonal!r}")
        if self.swag_rank is None and (self.swag_diagonal or self.swag_params is not None):
            raise ConfigError("swag_diagonal/swag_params are set but swag_rank is None (no SWAG)")
        if self.swag_params is not None and (isinstance(self.swag_params, str)
                                             or not all(isinstance(n, str)
                                                        for n in self.swag_params)):
            raise ConfigError(f"swag_params must be a sequence of parameter names, got "
                              f"{self.swag_params!r}")
        if self.noise_multiplier is not None:
            raise ConfigError("TrainConfig.noise_multiplier was removed: it clipped the batch "
                              "gradient and kept no privacy budget, so it was not differential "
                              "privacy. Use fit(..., privacy=PrivacyConfig(epsilon=..., "
                              "delta=..., max_grad_norm=...)) for DP-SGD (docs/train.md)")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ConfigError("checkpoint_every needs checkpoint_dir")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise ConfigError(f"seed must be a non-negative integer or None, got {self.seed!r}")


@dataclass
class _Progress:
    """Where the run is; saved in checkpoints."""

    epoch: int = 0  # epochs completed
    swa_steps: int = 0  # optimizer steps taken in the SWA phase
    epoch_lr: float | None = None  # the rate at the start of the current epoch
    step: int = 0  # optimizer steps taken (skipped ones included)
    skipped_steps: int = 0  # fp16 steps skipped for non-finite gradients
    dropped_microbatches: int = 0  # left over at epoch ends when accumulating
    micro: int = 0  # micro-batches seen in the current epoch
    epoch_loss_sum: float = 0.0
    loss_batches: int = 0  # micro-batches of the current epoch with examples (Poisson: not all)
    history: list[dict] = field(default_factory=list)


@dataclass
class TrainResult:
    """What :func:`fit` returns."""

    model: nn.Module
    swa: SWA | None
    swag: SWAG | None
    history: list[dict]  # one record per epoch: train_loss, lr, eval metrics, ...
    steps: int
    skipped_steps: int
    dropped_microbatches: int
    world_size: int
    rank: int
    generator: torch.Generator  # this rank's ember.csprng substream
    rank_digests: list[str]  # weights_digest of the model on every rank (all equal under DDP)
    checkpoint: Path | None
    epsilon: float | None = None  # with privacy: the budget spent (at PrivacyConfig.delta)
    noise_multiplier: float | None = None  # with privacy: the DP-SGD noise multiplier used
    ema: EMA | None = None  # with TrainConfig.ema_decay: the moving average of the weights
    privacy: dict | None = None  # with privacy: q, sigma, delta, steps, accountant, epsilon, ...


def _split_batch(batch: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"expected batches of (inputs, targets), got {type(batch).__name__}"
                        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@torch.no_grad()
def predict(model: nn.Module, loader: Iterable, precision: str | Precision = "fp32",
            device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities (float32) and targets over ``loader``'s ``(inputs, targets)`` batches."""
    policy = precision if isinstance(precision, Precision) else Precision(precision)
    was_training = model.training
    model.eval()
    probs, targets = [], []
    try:
        for batch in loader:
            x, y = _split_batch(batch, torch.device(device))
            with policy.autocast():
                logits = model(x)
            probs.append(torch.softmax(logits.float(), dim=-1).cpu())
            targets.append(y.cpu())
    finally:
        model.train(was_training)
    if not probs:
        raise ValueError("predict: the loader yielded no batches")
    return torch.cat(probs), torch.cat(targets)


def evaluate(model: nn.Module, loader: Iterable, precision: str | Precision = "fp32",
             device: str | torch.device = "cpu") -> dict[str, float]:
    """Accuracy and mean negative log-likelihood of ``model`` on ``loader``."""
    from ember.swa import accuracy, nll

    probs, targets = predict(model, loader, precision, device)
    return {"accuracy": accuracy(probs, targets), "nll": nll(probs, targets)}


def _evaluate_kept(model: nn.Module, ema: EMA | None, swa: SWA | None, eval_loader: Iterable,
                   bn_loader: Iterable | None, precision: Precision, device: torch.device,
                   bn_batches: int | None) -> dict[str, Any]:
    """Metrics of every model fit keeps: ``eval_*`` (raw), ``eval_ema_*``, ``eval_swa_*``.

    The SWA model is evaluated on a copy whose BatchNorm statistics are recomputed on at most
    ``bn_batches`` batches of ``bn_loader``; with BatchNorm and no ``bn_loader`` it is not
    evaluated (``eval_swa_skipped`` says why). Torch's random state is left as it was.
    """
    out = {f"eval_{k}": v for k, v in evaluate(model, eval_loader, precision, device).items()}
    if ema is not None:
        out.update({f"eval_ema_{k}": v for k, v in
                    evaluate(ema.module, eval_loader, precision, device).items()})
    if swa is not None and swa.n_updates > 0:
        if has_running_stats(swa.module) and bn_loader is None:
            out["eval_swa_skipped"] = "BatchNorm statistics need bn_loader"
        else:
            averaged = copy.deepcopy(swa.module)
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                if has_running_stats(averaged):
                    update_bn(bn_loader, averaged, device=device, max_batches=bn_batches)
                out.update({f"eval_swa_{k}": v for k, v in
                            evaluate(averaged, eval_loader, precision, device).items()})
    return out


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler | None, max_grad_norm: float | None,
                    noise: GaussianGradientNoise | None) -> tuple[bool, float | None]:
    """One real step on the accumulated gradients; returns (skipped, gradient norm before
    clipping)."""
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip and add noise to true gradients, not scaled ones
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    if noise is not None:
        noise.add_(model.parameters())
    skipped = False
    if scaler is not None:
        before = scaler.get_scale()
        scaler.step(optimizer)  # skipped internally when unscale_ found inf/nan
        scaler.update()
        skipped = scaler.get_scale() < before  # the scale backs off exactly when a step is skipped
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped, grad_norm


def _lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def _make_swalr(optimizer: torch.optim.Optimizer, config: TrainConfig) -> LRScheduler:
    """The SWA phase's rate schedule (SWALR per epoch, or CyclicSWALR per step)."""
    if config.swa_schedule == "cyclic":
        return CyclicSWALR(optimizer, lr_max=config.swa_lr_max, lr_min=config.swa_lr,
                           cycle=config.swa_cycle, shape=config.swa_cycle_shape)
    if config.swa_schedule == "constant":  # a cycle of one step is the constant rate lr_min
        return CyclicSWALR(optimizer, lr_max=config.swa_lr, lr_min=config.swa_lr, cycle=1)
    return SWALR(optimizer, swa_lr=config.swa_lr, anneal_epochs=config.swa_anneal_epochs,
                 anneal_strategy=config.swa_anneal_strategy)


def _settings(config: TrainConfig) -> dict[str, Any]:
    """Options a resumed run must share with its checkpoint."""
    return {"precision": config.precision, "accumulate": config.accumulate,
            "swa_start": config.swa_start, "swag_rank": config.swag_rank,
            "swa_every_steps": config.swa_every_steps, "swa_schedule": config.swa_schedule,
            "swa_cycle": config.swa_cycle, "swag_diagonal": config.swag_diagonal,
            "swag_params": None if config.swag_params is None else list(config.swag_params),
            "scheduler_interval": config.scheduler_interval,
            "swa_cycle_shape": config.swa_cycle_shape,
            "swa_collect_start": config.swa_collect_start}


# what checkpoints written before an option existed were trained with
_LEGACY_SETTINGS = {"swa_every_steps": None, "swa_schedule": "anneal", "swa_cycle": None,
                    "swag_diagonal": False, "swag_params": None, "scheduler_interval": "epoch",
                    "swa_cycle_shape": "linear", "swa_collect_start": 0.5}


def _swalr_state(swalr: LRScheduler) -> dict[str, Any]:
    # torch 2.8 and earlier put SWALR's anneal function in its state_dict: a function, which
    # torch.load(weights_only=True) refuses; the constructor sets it again from the config
    return {k: v for k, v in swalr.state_dict().items() if k != "anneal_func"}


def _checkpoint_state(world: World, model: nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: LRScheduler | None, swalr: SWALR | None,
                      scaler: torch.amp.GradScaler | None, swa: SWA | None, swag: SWAG | None,
                      generator: torch.Generator, loader: Any, progress: _Progress,
                      config: TrainConfig) -> dict[str, Any] | None:
    """The checkpoint dict on rank 0 (None elsewhere); every rank must call it (it gathers)."""
    data_state = loader.state_dict() if hasattr(loader, "state_dict") else None
    mine = {"rng": rng_state(), "ember": generator.get_state(), "data": data_state}
    ranks = all_gather_objects(mine, world)
    if not world.is_main:
        return None
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "swalr": _swalr_state(swalr) if swalr is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "swa": swa.state_dict() if swa is not None else None,
        "swag": swag.state_dict() if swag is not None else None,
        "progress": asdict(progress),
        "ranks": ranks,
        "world_size": world.size,
        "settings": _settings(config),
    }


def _check_same_model(saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """A ConfigError naming the first difference between a checkpoint's model and this run's."""
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        raise ConfigError("the checkpoint's model is not this run's model: "
                          + (f"it lacks {missing[0]}" if missing else f"it has {extra[0]} in addition"))
    for name, t in mine.items():
        if tuple(saved[name].shape) != tuple(t.shape):
            raise ConfigError(f"the checkpoint's model is not this run's model: {name} has shape "
                              f"{tuple(saved[name].shape)} in the checkpoint and {tuple(t.shape)} "
                              "here")


def _restore(state: dict[str, Any], world: World, model: nn.Module,
             optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None,
             scaler: torch.amp.GradScaler | None, swa: SWA | None, swag: SWAG | None,
             generator: torch.Generator, loader: Any, config: TrainConfig) -> tuple[_Progress,
                                                                                   SWALR | None]:
    """Load a checkpoint into the run's objects; returns the progress and the SWALR if the SWA
    phase had begun."""
    if state["world_size"] != world.size:
        raise ConfigError(f"checkpoint was written by {state['world_size']} processes, this run has "
                          f"{world.size}; resume with the same number")
    for key, value in _settings(config).items():
        saved = state["settings"].get(key, _LEGACY_SETTINGS.get(key))
        if saved != value:
            raise ConfigError(f"checkpoint was written with {key}={saved!r}, this "
                              f"run has {key}={value!r}")
    if (state["scheduler"] is None) != (scheduler is None):
        raise ConfigError("checkpoint and this run disagree on whether an LR scheduler is used")
    _check_same_model(state["model"], model.state_dict())
    model.load_state_dict(state["model"])
    # SWALR sets the learning rate when built, so build it before restoring the optimizer
    swalr = _make_swalr(optimizer, config) if state["swalr"] is not None else None
    optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    if swalr is not None:
        swalr.load_state_dict(state["swalr"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    if swa is not None and state["swa"] is not None:
        swa.load_state_dict(state["swa"])
    if swag is not None and state["swag"] is not None:
        swag.load_state_dict(state["swag"])
    mine = state["ranks"][world.rank]
    set_rng_state(mine["rng"])
    generator.set_state(mine["ember"])
    progress = _Progress(**state["progress"])
    if mine["data"] is not None:
        if not hasattr(loader, "load_state_dict"):
            raise ConfigError("the checkpoint holds a data position but the training loader has no "
                              "load_state_dict(); use an ember.shards.ShardLoader")
        loader.load_state_dict(mine["data"])
    elif progress.micro:
        raise ConfigError("the checkpoint was taken mid-epoch with a loader that cannot resume "
                          "mid-epoch; use an ember.shards.ShardLoader or checkpoint only at epoch "
                          "ends")
    return progress, swalr


def _batches(loader: Iterable) -> Iterator:
    """``loader``'s batches, hiding its draws from torch's global generator from the model.

    A DataLoader draws a seed from the global generator when an epoch's iterator starts; a resumed
    run starts it at a different point, so without this dropout masks would differ after resuming.
    """
    it = iter(loader)
    while True:
        state = torch.get_rng_state()
        try:
            batch = next(it)
        except StopIteration:
            return
        finally:
            torch.set_rng_state(state)
        yield batch


def _progress_bar(enabled: bool, total: int | None = None, desc: str | None = None) -> Any:
    from tqdm.auto import tqdm

    # total and description from the start: a bar drawn before its first reset showed
    # "0batch" with no total
    return tqdm(unit="batch", disable=not enabled, dynamic_ncols=True, mininterval=0.5,
                total=total, desc=desc)


def _length(loader: Iterable) -> int | None:
    """Batches per epoch where the loader knows (a progress bar's total), else None."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that holds none of ``model``'s parameters: it would train nothing."""
    own = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if held and not any(id(p) in own for p in held):
        raise ConfigError("the optimizer holds none of the model's parameters (was it built for "
                          "another model?); build it with optimizer(model.parameters(), ...)")


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, train_loader: Iterable,
        config: TrainConfig | None = None, *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        scheduler: LRScheduler | None = None, eval_loader: Iterable | None = None,
        bn_loader: Iterable | None = None,
        on_step: Callable[[int, dict], None] | None = None,
        privacy: PrivacyConfig | None = None,
        on_epoch: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Train ``model`` on ``(inputs, targets)`` batches from ``train_loader``.

    ``loss_fn(logits, targets)`` defaults to cross-entropy (logits are cast to float32 first).
    ``scheduler`` is stepped once per epoch (or per optimizer step, ``scheduler_interval="step"``)
    before the SWA phase. ``eval_loader`` (read on rank 0 only, so do not split it across ranks)
    adds test accuracy and NLL of every model kept (raw ``eval_*``, ``eval_ema_*``, and
    ``eval_swa_*`` with BatchNorm recomputed on ``bn_loader``) to each epoch's record.
    ``bn_loader`` recomputes the SWA model's BatchNorm statistics at the end. ``on_step(step,
    record)`` is called after every optimizer step (and after that step's checkpoint, if any);
    it may raise :class:`StopTraining` to end training there. ``on_epoch(epoch, record)`` is
    called after every epoch's record is written.

    Run under ``torchrun`` to train with DistributedDataParallel (gloo on CPU): each rank must
    read its own part of the data with the same number of batches (``ShardDataset(...,
    equalize="drop")``). A :class:`~ember.shards.ShardLoader` makes mid-epoch checkpoints exact.

    ``privacy`` trains with DP-SGD on Opacus's pieces (see :mod:`ember.train.privacy`), also
    under torchrun: each epoch's record carries the ``epsilon`` spent and the ``dp_*`` parameters,
    ``result.privacy`` the full report (``not_covered_by_dp`` names the fields epsilon does not
    cover); the returned model, EMA and SWA copies carry no Opacus hooks or attributes. A
    training step that changes a floating-point buffer of the model is refused (the buffers are
    put back).
    """
    config = config or TrainConfig()
    config.check()
    device = torch.device(config.device)
    precision = Precision(config.precision, device.type)
    loss_fn = loss_fn or nn.functional.cross_entropy
    world = init_from_env()
    try:
        with contextlib.ExitStack() as cleanup:
            return _fit(model, optimizer, train_loader, config, device, precision, loss_fn,
                        scheduler, eval_loader, bn_loader, on_step, world, privacy, on_epoch,
                        cleanup)
    finally:
        shutdown(world)


class StopTraining(Exception):  # noqa: N818 (a signal, not an error)
    """Raise from ``fit``'s ``on_step`` to end training after that step: the epoch's bookkeeping
    (history, evaluation, checkpoint) runs, then ``fit`` finishes and returns normally. Under
    DDP every rank must raise at the same step."""


def _fit(model, optimizer, train_loader, config, device, precision, loss_fn, scheduler,
         eval_loader, bn_loader, on_step, world: World, privacy, on_epoch,
         cleanup: contextlib.ExitStack) -> TrainResult:
    from ember.csprng import create_generator, create_random_device_generator

    _check_optimizer(model, optimizer)
    model.to(device)
    if privacy is not None:
        from ember.train.privacy import check_combination, check_loader, check_model

        privacy.check()
        check_combination(config, world)
        check_loader(train_loader, world)  # before check_model may replace BatchNorm layers
        check_model(model, replace_batchnorm=privacy.replace_batchnorm)
        if world.distributed:  # as DDP does: every rank (and its EMA/SWA copies) starts at rank 0's
            for t in [*model.parameters(), *model.buffers()]:
                torch.distributed.broadcast(t.data, src=0)
    net = wrap_model(model, world) if privacy is None else model
    scaler = precision.make_scaler()
    base = create_generator(config.seed) if config.seed is not None \
        else create_random_device_generator()
    generator = base.fold_in(world.rank)  # this rank's own substream
    noise = None
    if config.noise_multiplier is not None:
        noise = GaussianGradientNoise(config.noise_multiplier, config.max_grad_norm, generator, world)
    swa = SWA(model) if config.swa_start is not None else None
    swag = None
    if swa is not None and config.swag_rank:
        try:
            swag = SWAG(model, max_rank=config.swag_rank, diagonal=config.swag_diagonal,
                        params=config.swag_params, device=config.swag_device)
        except ValueError as err:
            raise ConfigError(f"TrainConfig.swag_params/swag_device: {err}") from err
    fast = FastSWASchedule(config.swa_cycle, config.swa_every_steps,
                           start=config.swa_collect_start) \
        if config.swa_schedule == "cyclic" and config.swa_every_steps is not None else None

    def collect_swa() -> None:
        swa.update(model)
        if swag is not None:
            swag.collect(model)
    ema = EMA(model, config.ema_decay, warmup=config.ema_warmup) \
        if config.ema_decay is not None else None
    private = None
    if privacy is not None:  # after the SWA/EMA copies, so that they carry no Opacus hooks
        from ember.train.privacy import make_private

        private = make_private(model, optimizer, train_loader, privacy, config.epochs, world)
        cleanup.callback(private.close)
        net, optimizer, train_loader = private.module, private.optimizer, private.loader
    swalr: SWALR | None = None
    progress = _Progress()
    ckpt_path = Path(config.checkpoint_dir) / CHECKPOINT_NAME if config.checkpoint_dir else None

    resume_from = find_checkpoint(config.resume, config.checkpoint_dir)
    if resume_from is not None:
        state = load_checkpoint(resume_from)
        progress, swalr = _restore(state, world, model, optimizer, scheduler,
                                   scaler, swa, swag, generator, train_loader, config)
        if private is not None:
            if state.get("privacy") is None:
                raise ConfigError("the checkpoint was written without privacy; resume it without")
            private.load_state_dict(state["privacy"])
        elif state.get("privacy") is not None:
            raise ConfigError("the checkpoint was written with privacy; resume it with privacy=")
        if (state.get("ema") is None) != (ema is None):
            raise ConfigError("checkpoint and this run disagree on whether an EMA is kept "
                              "(TrainConfig.ema_decay)")
        if ema is not None:
            ema.load_state_dict(state["ema"])
    log = MetricsLog(config.metrics_path if world.is_main else None)
    if resume_from is not None:
        log.write("resume", checkpoint=str(resume_from), step=progress.step, epoch=progress.epoch)
    else:
        log.write("start", precision=config.precision, world_size=world.size, epochs=config.epochs,
                  accumulate=config.accumulate)

    def checkpoint() -> None:
        dp_states = all_gather_objects(private.generator.get_state(), world) \
            if private is not None else None
        state = _checkpoint_state(world, model, optimizer, scheduler, swalr, scaler, swa, swag,
                                  generator, train_loader, progress, config)
        if state is not None:
            if private is not None:
                state["privacy"] = private.state_dict(dp_states)
            if ema is not None:
                state["ema"] = ema.state_dict()
            # a private run's checkpoint holds the noise key: owner-only file
            save_checkpoint(ckpt_path, state, owner_only=private is not None)

    if private is not None:
        private.watch_buffers()  # after resuming: a training step must not change any buffer
    bar = _progress_bar(config.progress and world.is_main and progress.epoch < config.epochs,
                        _length(train_loader), f"epoch {progress.epoch + 1}/{config.epochs}")
    stop = False  # on_step raised StopTraining
    try:
        for epoch in range(progress.epoch, config.epochs):
            if private is not None and private.stopped:
                break  # the budget stop (max_epsilon)
            in_swa_phase = config.swa_start is not None and epoch >= config.swa_start
            if in_swa_phase and swalr is None:
                swalr = _make_swalr(optimizer, config)
            net.train()
            # the rate this epoch trains with: schedulers step at its end (log it, not the next one)
            # (kept in the checkpoint: a per-step schedule has moved on when a run resumes mid-epoch)
            if progress.micro == 0 or progress.epoch_lr is None:
                progress.epoch_lr = _lr(optimizer)
            epoch_lr = progress.epoch_lr
            bar.reset(total=_length(train_loader))
            bar.update(progress.micro)  # batches of this epoch done before a resume
            bar.set_description_str(f"epoch {epoch + 1}/{config.epochs}")
            for batch in _batches(train_loader):
                x, y = _split_batch(batch, device)
                closes_step = private.closes_step() if private is not None \
                    else (progress.micro + 1) % config.accumulate == 0
                # DDP all-reduces gradients only on the micro-batch that closes a step
                sync = net.no_sync() if world.distributed and private is None and not closes_step \
                    else contextlib.nullcontext()
                quiet = private.quiet_hooks() if private is not None else contextlib.nullcontext()
                with sync, quiet:
                    with precision.autocast():
                        logits = net(x)
                    loss = loss_fn(logits.float(), y)
                    scaled = loss / config.accumulate
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                if private is not None:
                    private.check_buffers()
                progress.micro += 1
                if y.dim() == 0 or y.shape[0] > 0:  # an empty Poisson batch has no loss
                    progress.epoch_loss_sum += float(loss.detach())
                    progress.loss_batches += 1
                bar.update(1)
                if not closes_step:
                    if private is not None:
                        private.accumulate()  # clip and add up; the step comes at the end
                    continue

                skipped, grad_norm = _optimizer_step(model, optimizer, scaler, config.max_grad_norm,
                                                     noise)
                step_lr = _lr(optimizer)  # the rate this step used
                progress.step += 1
                progress.skipped_steps += skipped
                if ema is not None:
                    ema.update(model)
                if in_swa_phase:
                    s = progress.swa_steps  # this step's index in the phase, from 0
                    progress.swa_steps += 1
                    if config.swa_schedule == "cyclic":
                        due = fast.collect_at(s) if fast is not None \
                            else is_cycle_end(s, config.swa_cycle)
                        swalr.step()
                    else:
                        due = config.swa_every_steps is not None \
                            and progress.swa_steps % config.swa_every_steps == 0
                    if due:
                        collect_swa()
                elif scheduler is not None and config.scheduler_interval == "step":
                    scheduler.step()
                record = {"step": progress.step, "epoch": epoch, "loss": float(loss.detach()),
                          "lr": step_lr, "skipped": skipped}
                if grad_norm is not None:
                    record["grad_norm"] = grad_norm
                if scaler is not None:
                    record["scale"] = scaler.get_scale()
                if progress.step % config.log_every == 0 or skipped:
                    log.write("step", **record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", skipped=progress.skipped_steps, refresh=False)
                if config.checkpoint_every and progress.step % config.checkpoint_every == 0:
                    checkpoint()
                if on_step is not None:
                    try:
                        on_step(progress.step, record)
                    except StopTraining:
                        stop = True
                        break

            leftover = progress.micro % config.accumulate
            if leftover:
                optimizer.zero_grad(set_to_none=True)
                progress.dropped_microbatches += leftover
            batches = progress.micro
            if batches == 0:
                raise ConfigError(f"train_loader yielded no batches in epoch {epoch} (is the data "
                                  "empty, or was every sample skipped?)")
            if in_swa_phase:
                if config.swa_every_steps is None and config.swa_schedule != "cyclic":
                    collect_swa()
                if config.swa_schedule == "anneal":
                    swalr.step()
            elif scheduler is not None and config.scheduler_interval == "epoch":
                scheduler.step()
            train_loss = progress.epoch_loss_sum / progress.loss_batches \
                if progress.loss_batches else None
            record = {"epoch": epoch, "train_loss": train_loss,
                      "batches": batches, "steps": progress.step, "lr": epoch_lr,
                      "skipped_steps": progress.skipped_steps, "swa": in_swa_phase}
            errors = getattr(train_loader, "error_count", None)
            if errors is not None:  # shards/samples the loader's error handling skipped
                record["data_errors"] = int(errors)
            if private is not None:
                private.epoch_done()
                record["nonempty_batches"] = progress.loss_batches
            if eval_loader is not None and world.is_main:
                record.update(_evaluate_kept(model, ema, swa, eval_loader, bn_loader, precision,
                                             device, config.bn_batches))
                eval_errors = getattr(eval_loader, "error_count", None)
                if eval_errors is not None:  # skipped in the (last) evaluation pass
                    record["eval_data_errors"] = int(eval_errors)
            if private is not None:
                record.update(private.epoch_record())
            progress.history.append(record)
            log.write("epoch", **record)
            progress.epoch, progress.micro, progress.epoch_loss_sum = epoch + 1, 0, 0.0
            progress.loss_batches = 0
            if ckpt_path is not None:
                checkpoint()
            if on_epoch is not None:
                on_epoch(epoch, record)
            if stop:
                break

        # each rank's last forward updated its own BatchNorm statistics: agree on rank 0's
        for kept in (model, swa.module if swa is not None else None,
                     ema.module if ema is not None else None):
            if kept is not None:
                broadcast_buffers_(kept, world)
        if swa is not None and bn_loader is not None:
            update_bn(bn_loader, swa.module, device=device, max_batches=config.bn_batches)
            broadcast_buffers_(swa.module, world)
        elif swa is not None and has_running_stats(swa.module):
            warnings.warn(
                "fit returns an SWA model whose BatchNorm running statistics are those of the last "
                "training weights, not of the averaged ones (stale); pass bn_loader= to fit, or "
                "call ember.swa.update_bn(loader, result.swa.module) before using it",
                UserWarning, stacklevel=3)
        digests = all_gather_objects(weights_digest(model), world)
        log.write("end", steps=progress.step, skipped_steps=progress.skipped_steps,
                  dropped_microbatches=progress.dropped_microbatches,
                  ranks_in_sync=len(set(digests)) == 1,
                  **({"privacy": private.report()} if private is not None else {}))
    finally:
        bar.close()
        log.close()
    return TrainResult(model=model, swa=swa, swag=swag, history=progress.history,
                       steps=progress.step, skipped_steps=progress.skipped_steps,
                       dropped_microbatches=progress.dropped_microbatches, world_size=world.size,
                       rank=world.rank, generator=generator, rank_digests=digests,
                       checkpoint=ckpt_path,
                       epsilon=private.epsilon() if private is not None else None,
                       noise_multiplier=private.noise_multiplier if private is not None else None,
                       ema=ema, privacy=private.report() if private is not None else None)
