"""Weight averaging during training: EMA with warm-up and SWA, on top of ``torch.optim.swa_utils``.

``AveragedModel``, ``SWALR`` and the averaging-function helpers are torch's own, re-exported.
``EMA`` and ``SWA`` add what they lack: averaging into a copy you provide (FSDP, compiled models)
instead of a deep copy, matching by name with the ``_orig_mod.`` prefix of ``torch.compile`` and
the ``module.`` prefix of DDP/``DataParallel`` ignored (nested, on either side), tensors looked up
on every update (so the copy may be moved with ``.to()``/``.half()``/``.cuda()``), integer
buffers copied rather than averaged, foreach updates, and an EMA decay warm-up.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import (
    SWALR,
    AveragedModel,
    get_ema_avg_fn,
    get_ema_multi_avg_fn,
    get_swa_avg_fn,
    get_swa_multi_avg_fn,
)

from ember.swa._batches import strip_compile_prefix, unwrap_compiled

__all__ = [
    "EMA",
    "SWA",
    "SWALR",
    "AveragedModel",
    "ema_decay",
    "get_ema_avg_fn",
    "get_ema_multi_avg_fn",
    "get_swa_avg_fn",
    "get_swa_multi_avg_fn",
]


def ema_decay(step: int, decay: float = 0.9999, warmup: bool = True) -> float:
    """EMA decay for update number ``step`` (0 for the first update).

    With warm-up this is ``min(decay, (1 + step) / (10 + step))``, the schedule of TensorFlow's
    ``ExponentialMovingAverage(num_updates=...)``: early updates follow the model closely, so the
    average is not dominated by the initial weights.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not warmup:
        return decay
    return min(decay, (1.0 + step) / (10.0 + step))


def _named_state(model: nn.Module) -> dict[str, tuple[Tensor, bool]]:
    """Normalised name -> (tensor, is_parameter) for every parameter and buffer of ``model``."""
    out: dict[str, tuple[Tensor, bool]] = {}
    items = [(n, p, True) for n, p in model.named_parameters()]
    items += [(n, b, False) for n, b in model.named_buffers()]
    for name, t, is_param in items:
        key = strip_compile_prefix(name)
        if key in out:
            raise ValueError(
                f"two tensors of the model have the name {key!r} once wrapper prefixes "
                "(module., _orig_mod.) are removed; cannot match them by name"
            )
        out[key] = (t, is_param)
    return out


class _Averager:
    """Shared machinery: a target module whose tensors follow a source model by name."""

    def __init__(
        self,
        model: nn.Module,
        *,
        target: nn.Module | None,
        device: torch.device | str | int | None,
        use_buffers: bool,
        foreach: bool | None,
    ) -> None:
        if target is None:
            target = copy.deepcopy(unwrap_compiled(model))
        if device is not None:
            target.to(device)
        for p in target.parameters():
            p.requires_grad_(False)
        self.module = target
        self.use_buffers = use_buffers
        self.foreach = foreach
        self.n_updates = 0
        self._pairs(model)  # fail at construction on a mismatched target
        with torch.no_grad():
            for dst, src, _ in self._pairs(model):
                dst.copy_(src)

    def _pairs(self, model: nn.Module) -> list[tuple[Tensor, Tensor, bool]]:
        """(target tensor, source tensor, average it?) for every name, checked for a match."""
        # looked up on every call: the copy may have been moved (.to(), .half(), .cuda()) since
        target = _named_state(self.module)
        source = _named_state(model)
        missing = [n for n in target if n not in source]
        extra = [n for n in source if n not in target]
        if missing or extra:
            raise ValueError(
                "model does not match the averaged copy: "
                f"missing from model {missing[:5]}, not in the averaged copy {extra[:5]}"
            )
        pairs = []
        for name, (dst, is_param) in target.items():
            src = source[name][0]
            if src.shape != dst.shape:
                raise ValueError(
                    f"model does not match the averaged copy: {name!r} has shape "
                    f"{tuple(src.shape)} in the model and {tuple(dst.shape)} in the copy"
                )
            average = dst.is_floating_point() or dst.is_complex()
            average = average and (is_param or self.use_buffers)
            pairs.append((dst, src, average))
        return pairs

    def _weight(self, step: int | None = None) -> float:
        raise NotImplementedError

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Context manager: ``model`` holds the averaged weights inside, its own ones after.

        Parameters and buffers of ``model`` are saved, overwritten with the average (cast to their
        dtype) and restored bit for bit on exit, also after an exception. Use it to evaluate the
        average with the live model (``with ema.swapped_into(model): evaluate(model)``).
        """
        with torch.no_grad():
            saved = []
            for dst, src, _ in self._pairs(model):
                saved.append((src, src.detach().clone()))
                src.copy_(dst)
        try:
            yield model
        finally:
            with torch.no_grad():
                for src, value in saved:
                    src.copy_(value)

    @torch.no_grad()
    def update(self, model: nn.Module, step: int | None = None) -> None:
        """Fold the current weights of ``model`` into the average.

        ``step`` (EMA only) is the training step the decay schedule is evaluated at; without it
        the number of updates so far is used.
        """
        weight = self._weight(step)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for dst, src, average in self._pairs(model):
            src = src.detach()
            if not average:
                dst.copy_(src)  # integer buffers (num_batches_tracked, ...) and unaveraged buffers
                continue
            # non_blocking only towards an accelerator: a non-blocking copy into host memory may
            # still be in flight when the CPU lerp reads it
            src = src.to(device=dst.device, dtype=dst.dtype, non_blocking=dst.device.type != "cpu")
            dsts, srcs = groups.setdefault((dst.device, dst.dtype), ([], []))
            dsts.append(dst)
            srcs.append(src)
        for (device, _), (dsts, srcs) in groups.items():
            foreach = self.foreach
            if foreach is None:
                foreach = device.type in ("cpu", "cuda", "xpu", "mps")
            if foreach:
                torch._foreach_lerp_(dsts, srcs, weight)
            else:
                for d, s in zip(dsts, srcs, strict=True):
                    d.lerp_(s, weight)
        self.n_updates += 1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The averaged weights and the update count."""
        return {"n_updates": self.n_updates, "module": self.module.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        for key in ("n_updates", "module"):
            if key not in state:
                raise KeyError(f"state dict lacks {key!r}; expected the output of state_dict()")
        self.module.load_state_dict(state["module"])
        self.n_updates = int(state["n_updates"])


class EMA(_Averager):
    """Exponential moving average of a model's weights: ``avg = decay * avg + (1 - decay) * w``.

    ``decay`` is a float (used with the warm-up of :func:`ema_decay` unless ``warmup=False``) or a
    callable ``decay(step) -> float`` with ``step`` counting updates from 0. The average lives in
    ``target`` when given (it is overwritten with the model's weights now; use this for FSDP or
    compiled models, or to control where the copy lives), otherwise in a deep copy of the model.
    Floating-point buffers are averaged when ``use_buffers`` is true, otherwise copied; integer
    buffers are always copied. ``foreach=None`` picks foreach kernels where torch has them.

    As timm's ``ModelEmaV3``: ``update(model, step=...)`` evaluates the decay at a training step,
    ``update_after_step`` copies the model until that step, ``min_decay`` bounds the warm-up
    from below, and :meth:`swapped_into` evaluates the average inside the live model.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float | Callable[[int], float] = 0.9999,
        *,
        warmup: bool = True,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        target: nn.Module | None = None,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        foreach: bool | None = None,
    ) -> None:
        if not callable(decay) and not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        if not 0.0 <= min_decay <= 1.0:
            raise ValueError(f"min_decay must be in [0, 1], got {min_decay}")
        if isinstance(update_after_step, bool) or not isinstance(update_after_step, int) \
                or update_after_step < 0:
            raise ValueError(f"update_after_step must be an integer >= 0, got {update_after_step!r}")
        self.decay = decay
        self.warmup = warmup
        self.min_decay = min_decay
        self.update_after_step = update_after_step
        super().__init__(
            model, target=target, device=device, use_buffers=use_buffers, foreach=foreach
        )

    def current_decay(self, step: int | None = None) -> float:
        """The decay an :meth:`update` at ``step`` (default: the update count) uses.

        Before ``update_after_step`` the decay is 0 (the average copies the model); after it the
        schedule restarts from 0 and is never below ``min_decay``.
        """
        step = self.n_updates if step is None else step
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        step -= self.update_after_step
        if step < 0:
            return 0.0
        if callable(self.decay):
            d = float(self.decay(step))
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"decay({step}) returned {d}; expected [0, 1]")
        else:
            d = ema_decay(step, self.decay, self.warmup)
        return max(self.min_decay, d)

    def _weight(self, step: int | None = None) -> float:
        return 1.0 - self.current_decay(step)


class SWA(_Averager):
    """Equal-weight running average of the weights passed to :meth:`update` (SWA).

    The first update copies the weights; update ``n`` (from 1) gives them weight ``1/n``.
    Buffers are copied from the model by default (recompute BatchNorm statistics afterwards with
    :func:`ember.swa.update_bn`); ``target``, ``device`` and ``foreach`` are as for :class:`EMA`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        target: nn.Module | None = None,
        device: torch.device | str | int | None = None,
        use_buffers: bool = False,
        foreach: bool | None = None,
    ) -> None:
        super().__init__(
            model, target=target, device=device, use_buffers=use_buffers, foreach=foreach
        )

    def _weight(self, step: int | None = None) -> float:
        return 1.0 / (self.n_updates + 1)
