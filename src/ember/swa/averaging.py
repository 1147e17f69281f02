"""Weight averaging during training: EMA with warm-up and SWA, drop-ins for ``torch.optim.swa_utils``.

``AveragedModel``, ``SWALR`` and the averaging-function helpers are torch's own, re-exported.
``EMA`` and ``SWA`` are ``nn.Module``\\ s with ``AveragedModel``'s interface and add what it
lacks: averaging into a copy you provide (FSDP, compiled models) instead of a deep copy, matching
by name with the ``_orig_mod.`` part of ``torch.compile`` and the ``module.`` part of
DDP/``DataParallel`` ignored where those wrappers are (nested, on either side), tensors looked
up on every update (so the copy may be moved with ``.to()``/``.half()``/``.cuda()``;
half-precision copies are averaged in float32), integer buffers copied rather than averaged,
foreach updates, and EMA decay warm-ups.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Callable, Iterator, Mapping
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
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from ember.swa._batches import unwrap_compiled, unwrapped_names, wrapped_child

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
    items: list[tuple[str, Tensor, bool]] = [(n, p, True) for n, p in model.named_parameters()]
    items += [(n, b, False) for n, b in model.named_buffers()]
    strip = unwrapped_names(model)
    for name, t, is_param in items:
        key = strip(name)
        if key in out:
            raise ValueError(
                f"two tensors of the model have the name {key!r} once wrapper prefixes "
                "(module., _orig_mod.) are removed; cannot match them by name"
            )
        out[key] = (t, is_param)
    return out


_HALF = (torch.float16, torch.bfloat16)

AvgFn = Callable[[Tensor, Tensor, Tensor], Tensor]
MultiAvgFn = Callable[[list[Tensor], list[Tensor], Tensor], None]


def _stamp(t: Tensor) -> tuple[int, int] | None:
    """What changes when ``t`` is replaced or written in place through autograd (``copy_``,
    ``load_state_dict``); writes through ``.data`` or ``dist.broadcast`` change neither."""
    try:
        return t._version, t.data_ptr()
    except RuntimeError:  # inference tensors have no version counter
        return None


def _wrapper_prefix(model: nn.Module) -> str:
    """The name prefix the ``torch.compile``/DDP/``DataParallel`` wrappers around ``model`` add
    (``"_orig_mod."``, ``"module."``, nested), i.e. what :func:`unwrap_compiled` removes."""
    prefix = ""
    while (child := wrapped_child(model)) is not None:
        prefix += f"{child}."
        model = getattr(model, child)
    return prefix


def _add_wrapper_prefix(module: _Averager, state_dict: dict[str, Any], prefix: str,
                        local_metadata: Any) -> None:
    """State-dict hook: name the copy's tensors as torch's deep copy of the wrapper does."""
    if not module._prefix:
        return
    plain = f"{prefix}module."
    renamed = {k: (plain + module._prefix + k[len(plain):] if k.startswith(plain) else k)
               for k in state_dict}
    items = [(renamed[k], v) for k, v in state_dict.items()]
    state_dict.clear()
    state_dict.update(items)


def _remove_low_precision_hooks(module: nn.Module) -> None:
    """Drop the hooks of :func:`ember.swa.quantize_activations_` from a deep copy: an averaged
    model is evaluated in full precision (as SWALP's reference does)."""
    for m in module.modules():
        for hooks in (m._forward_hooks, m._forward_pre_hooks):
            for key in [k for k, h in hooks.items() if getattr(h, "ember_low_precision", False)]:
                del hooks[key]


class _Averager(nn.Module):
    """Shared machinery: ``torch.optim.swa_utils.AveragedModel``'s interface over a target module
    whose tensors follow a source model by name."""

    n_averaged: Tensor

    def __init__(
        self,
        model: nn.Module,
        *,
        target: nn.Module | None,
        device: torch.device | str | int | None,
        avg_fn: AvgFn | None,
        multi_avg_fn: MultiAvgFn | None,
        use_buffers: bool,
        foreach: bool | None,
    ) -> None:
        super().__init__()
        if avg_fn is not None and multi_avg_fn is not None:
            raise ValueError("give at most one of avg_fn and multi_avg_fn, got both")
        for name, fn in (("avg_fn", avg_fn), ("multi_avg_fn", multi_avg_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
        # the state dict carries the wrapper's names (torch deep-copies the wrapper) while the copy
        # is the plain module: its state dict loads into an unwrapped model, no DDP is copied
        self._prefix = ""
        if target is None:
            self._prefix = _wrapper_prefix(model)
            target = copy.deepcopy(unwrap_compiled(model))
            _remove_low_precision_hooks(target)
        if device is not None:
            target.to(device)
        self.module = target
        self.avg_fn = avg_fn
        self.multi_avg_fn = multi_avg_fn
        self.use_buffers = use_buffers
        self.foreach = foreach
        # the count is read from this buffer whenever it is needed (as AveragedModel does), never
        # cached: writes that bypass the version counter (.data, dist.broadcast) must count
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long, device=device))
        # float32 copies of the average for tensors the copy holds in float16/bfloat16 (by name):
        # (master, the copy's version and storage after our last write); they only add the bits
        # below the copy's rounding (see _master)
        self._masters: dict[str, tuple[Tensor, tuple[int, int] | None]] = {}
        self._register_state_dict_hook(_add_wrapper_prefix)
        self._pairs(model)  # fail at construction on a mismatched target
        with torch.no_grad():
            for _, dst, src, _ in self._pairs(model):
                dst.copy_(src)

    # -- AveragedModel's interface ----------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the averaged copy."""
        return self.module(*args, **kwargs)

    def update_parameters(self, model: nn.Module) -> None:
        """Fold the current weights of ``model`` into the average (``AveragedModel``'s name)."""
        self.update(model)

    @property
    def n_updates(self) -> int:
        """Number of updates so far: ``n_averaged`` as an int (ember's older name), read from the
        buffer (on an accelerator this waits for it, as ``AveragedModel``'s ``n_averaged == 0``)."""
        return int(self.n_averaged)

    @n_updates.setter
    def n_updates(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"n_updates must be an integer >= 0, got {value!r}")
        self.n_averaged.fill_(value)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # accepts torch's layout with or without the wrapper's names (module._orig_mod.*, ...)
        # and ember's older {"n_updates", "module"}; a parent's load_state_dict calls this too
        if prefix + "n_averaged" not in state_dict and prefix + "n_updates" in state_dict \
                and isinstance(state_dict.get(prefix + "module"), Mapping):
            inner = state_dict.pop(prefix + "module")
            count = state_dict.pop(prefix + "n_updates")
            state_dict[prefix + "n_averaged"] = torch.tensor(int(count), dtype=torch.long)
            for k, v in inner.items():
                state_dict[f"{prefix}module.{k}"] = v
        if self._prefix:
            self._unwrap_names(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _unwrap_names(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Rename ``module.<wrapper prefix>x`` to ``module.x`` when the state dict has the
        wrapper's names. Both layouts are accepted; which one a state dict has is decided by which
        matches more of the copy's names (a model with a child called ``module`` has names like
        ``module.module.x`` in both), so either loads strictly."""
        plain = f"{prefix}module."
        wrapped = plain + self._prefix
        expected = {plain + k for k in self.module.state_dict(keep_vars=True)}
        keys = [k for k in state_dict if k.startswith(plain)]
        renamed = {k: plain + k[len(wrapped):] for k in keys if k.startswith(wrapped)}
        as_is = sum(k in expected for k in keys)
        if sum(v in expected for v in renamed.values()) > as_is:
            for key, new in renamed.items():
                state_dict[new] = state_dict.pop(key)

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> _Averager:
        # .to()/.half()/.float()/.cuda() of the averager: a master follows its tensor to a new
        # device (keeping its bits) while the tensor stays float16/bfloat16, and is dropped
        # (memory freed, never consulted again) when it does not
        out = super()._apply(fn, *args, **kwargs)
        if self._masters:
            current = {name: t for name, (t, _) in _named_state(self.module).items()}
            for name, (master, _) in list(self._masters.items()):
                dst = current.get(name)
                if dst is None or dst.dtype not in _HALF or dst.shape != master.shape:
                    del self._masters[name]
                else:
                    self._masters[name] = (master.to(dst.device), _stamp(dst))
        return out

    # -- pairing ---------------------------------------------------------------------------------

    def _pairs(self, model: nn.Module) -> list[tuple[str, Tensor, Tensor, bool]]:
        """(name, target tensor, source tensor, average it?) for every name, checked for a match."""
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
            pairs.append((name, dst, src, average))
        return pairs

    def _master(self, name: str, dst: Tensor) -> Tensor:
        """The float32 average behind a float16/bfloat16 tensor of the copy.

        The copy's tensor is the truth; the master only adds the bits below its rounding. When
        the copy's tensor was replaced or written in place through autograd (``copy_``, a load)
        since our last update, the master restarts from it; writes that bypass the version
        counter (``.data``, ``dist.broadcast``, numpy views) are caught element by element: every
        element of the master that no longer rounds to the copy's bits is taken from the copy
        (on the device, without a sync)."""
        held = self._masters.get(name)
        if held is None or held[1] is None or held[1] != _stamp(dst) \
                or held[0].device != dst.device or held[0].shape != dst.shape:
            # replaced, or written in place through autograd (copy_, a load): restart from it;
            # a normal tensor even under inference_mode, so that later updates may write it
            with torch.inference_mode(False):
                master = dst.detach().float()
            self._masters[name] = (master, None)
            return master
        master = held[0]
        # writes that bypass the version counter: element by element, no sync
        dst = dst.detach()
        # compared as bits (2-byte integers: fast on CPUs, where half comparisons are not)
        same = master.to(dst.dtype).view(torch.int16) == dst.view(torch.int16)
        torch.where(same, master, dst.float(), out=master)
        return master

    _copy_first = False

    def _weight(self, step: int | None) -> float | None:
        """The weight of the model in this update at ``step`` (``None``: the update count);
        ``None``: torch's SWA rule."""
        raise NotImplementedError

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Context manager: ``model`` holds the averaged weights inside, its own ones after.

        Parameters and buffers of ``model`` are saved, overwritten with the average (cast to their
        dtype) and restored bit for bit on exit, also after an exception. Use it to evaluate the
        average with the live model (``with ema.swapped_into(model): evaluate(model)``); hooks of
        the live model (SWALP's activation quantization, for one) stay active inside.
        """
        with torch.no_grad():
            saved = []
            for _, dst, src, _ in self._pairs(model):
                saved.append((src, src.detach().clone()))
                src.copy_(dst)
        try:
            yield model
        finally:
            with torch.no_grad():
                for src, value in saved:
                    src.copy_(value)

    def _average_into(self, device: torch.device, dsts: list[Tensor], srcs: list[Tensor],
                      weight: float | None) -> None:
        """Fold ``srcs`` into ``dsts`` (one device and dtype): torch's protocol with
        ``avg_fn``/``multi_avg_fn``, SWA's running mean when ``weight`` is None, else a lerp."""
        if self.multi_avg_fn is not None:
            self.multi_avg_fn(dsts, srcs, self.n_averaged.to(device))
            return
        if self.avg_fn is not None:
            n = self.n_averaged.to(device)
            for d, s in zip(dsts, srcs, strict=True):
                d.copy_(self.avg_fn(d, s, n))
            return
        if weight is None:  # SWA: torch's two kernels, picked as torch picks them
            n = self.n_averaged.to(device)
            foreach = self.foreach
            if foreach is None:
                foreach = device.type in _get_foreach_kernels_supported_devices()
            if foreach:
                get_swa_multi_avg_fn()(dsts, srcs, n)
            else:
                swa_avg = get_swa_avg_fn()
                for d, s in zip(dsts, srcs, strict=True):
                    d.copy_(swa_avg(d, s, n))
            return
        foreach = self.foreach
        if foreach is None:
            foreach = device.type in ("cpu", "cuda", "xpu", "mps")
        if foreach:
            torch._foreach_lerp_(dsts, srcs, weight)
        else:
            for d, s in zip(dsts, srcs, strict=True):
                d.lerp_(s, weight)

    @torch.no_grad()
    def update(self, model: nn.Module, step: int | None = None) -> None:
        """Fold the current weights of ``model`` into the average.

        ``step`` (EMA only) is the training step the decay schedule is evaluated at, counted as
        in timm's loop (the first update is step 1; see :meth:`EMA.current_decay`); without it
        ``n_updates + 1`` is used. Tensors the copy holds in float16 or bfloat16 are
        averaged in a float32 master copy and rounded into the copy after each update (a
        half-precision average with a small weight would stop moving).
        """
        custom = self.avg_fn is not None or self.multi_avg_fn is not None
        copy_first = custom or self._copy_first
        first = copy_first and self.n_updates == 0
        weight = None if custom else self._weight(step)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        written: list[tuple[str, Tensor, Tensor]] = []
        for name, dst, src, average in self._pairs(model):
            src = src.detach()
            if not average:
                dst.copy_(src)  # integer buffers (num_batches_tracked, ...) and unaveraged buffers
                continue
            acc = dst
            if dst.dtype in _HALF:
                acc = self._master(name, dst)
                written.append((name, acc, dst))
            # non_blocking only towards an accelerator: a non-blocking copy into host memory may
            # still be in flight when the CPU lerp reads it
            src = src.to(device=acc.device, dtype=acc.dtype, non_blocking=acc.device.type != "cpu")
            if first:
                acc.copy_(src)  # AveragedModel's rule: the first update copies
                continue
            dsts, srcs = groups.setdefault((acc.device, acc.dtype), ([], []))
            dsts.append(acc)
            srcs.append(src)
        for (device, _), (dsts, srcs) in groups.items():
            self._average_into(device, dsts, srcs, weight)
        for name, master, dst in written:
            dst.copy_(master)
            self._masters[name] = (master, _stamp(dst))
        if len(self._masters) > len(written):  # the copy was cast back (ema.module.float())
            kept = {name for name, _, _ in written}
            for name in [n for n in self._masters if n not in kept]:
                del self._masters[name]
        self.n_averaged.add_(1)


class EMA(_Averager):
    """Exponential moving average of a model's weights: ``avg = decay * avg + (1 - decay) * w``.

    An ``nn.Module`` with ``torch.optim.swa_utils.AveragedModel``'s interface
    (:meth:`update_parameters`, the ``n_averaged`` buffer, ``forward`` calling the copy, the same
    ``state_dict`` layout), so ``update_bn(loader, ema)``, ``ema.to(device)`` and ``ema.eval()``
    work as for torch's. ``decay`` is a float (used with a warm-up unless ``warmup=False``) or a
    callable ``decay(k) -> float`` of the schedule index ``k`` (0 on the first update). Warm-ups:
    ``warmup=True`` (or ``"tf"``) is :func:`ema_decay`'s ``min(decay, (1 + k) / (10 + k))``
    (TensorFlow's); ``warmup="power"`` is timm's ``1 - (1 + k / warmup_gamma) ** -warmup_power``
    capped by ``decay`` (``warmup_gamma=1, warmup_power=2/3`` suit long runs, ``3/4`` short ones),
    0 at ``k = 0``: the first update copies, as timm's.
    ``avg_fn``/``multi_avg_fn`` replace the decay rule with torch's averaging-function protocol
    (the first update then copies, as in ``AveragedModel``).

    The average lives in ``target`` when given (it is overwritten with the model's weights now;
    use this for FSDP or compiled models, or to control where the copy lives), otherwise in a deep
    copy of the model, put in eval mode. Floating-point buffers are averaged when
    ``use_buffers`` is true, otherwise copied; integer buffers are always copied. ``foreach=None``
    picks foreach kernels where torch has them. The copy may be moved or cast later (``.to()``,
    ``.cuda()``, ``.half()``): tensors are looked up on every update, and float16/bfloat16 ones are
    averaged in a float32 master copy (see :meth:`update`).

    As timm's ``ModelEmaV3``: ``update(model, step=num_updates)`` evaluates the decay at a
    training step counted from 1 (timm's loop), ``update_after_step`` copies the model until that
    step, ``min_decay`` bounds the warm-up from below, and :meth:`swapped_into` evaluates the
    average inside the live model; with ``warmup="power"`` the decay is timm's ``get_decay`` step
    for step (see :meth:`current_decay`).
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float | Callable[[int], float] = 0.9999,
        *,
        warmup: bool | str = True,
        warmup_gamma: float = 1.0,
        warmup_power: float = 2 / 3,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        target: nn.Module | None = None,
        device: torch.device | str | int | None = None,
        avg_fn: AvgFn | None = None,
        multi_avg_fn: MultiAvgFn | None = None,
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
        if warmup not in (True, False, "tf", "power"):
            raise ValueError(f"warmup must be True/'tf', 'power' or False, got {warmup!r}")
        for name, value in (("warmup_gamma", warmup_gamma), ("warmup_power", warmup_power)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        super().__init__(
            model, target=target, device=device, avg_fn=avg_fn, multi_avg_fn=multi_avg_fn,
            use_buffers=use_buffers, foreach=foreach,
        )
        if target is None:
            self.module.eval()  # an average is for evaluation (timm's ModelEma does the same)
        self.decay = decay
        self.warmup = warmup
        self.warmup_gamma = float(warmup_gamma)
        self.warmup_power = float(warmup_power)
        self.min_decay = min_decay
        self.update_after_step = update_after_step

    def current_decay(self, step: int | None = None) -> float:
        """The decay of an :meth:`update` at training step ``step`` (default: ``n_updates + 1``,
        the next update's).

        Steps count as in timm's training loop, which increments ``num_updates`` after the
        optimizer step and then calls ``ema.update(model, step=num_updates)``: the first update is
        step 1, and an update without ``step`` is at ``n_updates + 1``. The schedule runs on
        ``k = step - 1 - update_after_step``: while ``k < 0`` the decay is 0 (the average copies
        the model); from ``k = 0`` on it is the warm-up at ``k``, never below ``min_decay``.
        ``warmup="power"`` is timm's ``ModelEmaV3.get_decay(step)`` (``use_warmup=True``)
        exactly: 0 for ``k <= 0`` (``min_decay`` does not apply there), then
        ``max(min(1 - (1 + k / warmup_gamma) ** -warmup_power, decay), min_decay)``.
        """
        if step is None:
            if not self.warmup and not callable(self.decay) and not self.update_after_step:
                return max(self.min_decay, self.decay)  # constant: no need to read the count
            step = self.n_updates + 1
        try:  # any integer: int, NumPy integers, 0-dim integer tensors (not bool, not float)
            index = None if isinstance(step, bool) else operator.index(step)
        except TypeError:
            index = None
        if index is None or index < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        step = index
        k = step - 1 - self.update_after_step
        if k < 0:
            return 0.0
        if callable(self.decay):
            d = float(self.decay(k))
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"decay({k}) returned {d}; expected [0, 1]")
        elif self.warmup == "power":
            if k == 0:
                return 0.0  # timm: max(0, step - update_after_step - 1) <= 0 gives 0.0
            d = min(1.0 - (1.0 + k / self.warmup_gamma) ** -self.warmup_power, self.decay)
        else:
            d = ema_decay(k, self.decay, bool(self.warmup))
        return max(d, self.min_decay)

    def _weight(self, step: int | None) -> float | None:
        return 1.0 - self.current_decay(step)


class SWA(_Averager):
    """Equal-weight running average of the weights passed to :meth:`update` (SWA).

    A drop-in for ``torch.optim.swa_utils.AveragedModel``: the same positional arguments
    (``model, device, avg_fn, multi_avg_fn, use_buffers``), an ``nn.Module`` whose ``forward``
    calls the copy, :meth:`update_parameters`, the ``n_averaged`` buffer and the ``state_dict``
    layout (``n_averaged`` and ``module.*``, with the wrapper's names ``module._orig_mod.*`` /
    ``module.module.*`` for a compiled/DDP/``DataParallel`` model, so a state dict of torch's loads
    here and back; one without the wrapper's names loads too, as does ember's older layout
    ``{"n_updates", "module"}``). ``n_averaged`` is the count: loads (also through a parent
    module) and ``n_averaged.zero_()`` set it. The copy's parameters stay trainable, as torch's.
    The first update copies the weights; update ``n`` (from 1) gives them weight ``1/n``, computed
    with torch's own kernels (bit for bit ``AveragedModel``'s), or ``avg_fn``/``multi_avg_fn``
    decide, with torch's protocol. Buffers are copied from the model
    by default (recompute BatchNorm statistics afterwards with :func:`ember.swa.update_bn`);
    integer buffers are always copied (torch's blends them when ``use_buffers=True``).
    On top: ``target`` (average into a copy you provide), ``foreach``, matching by name through
    DDP/``torch.compile`` wrappers, copies moved or cast after construction (see :class:`EMA`),
    :meth:`swapped_into`, and the older names :meth:`update` and :attr:`n_updates`.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str | int | None = None,
        avg_fn: AvgFn | None = None,
        multi_avg_fn: MultiAvgFn | None = None,
        use_buffers: bool = False,
        *,
        target: nn.Module | None = None,
        foreach: bool | None = None,
    ) -> None:
        super().__init__(
            model, target=target, device=device, avg_fn=avg_fn, multi_avg_fn=multi_avg_fn,
            use_buffers=use_buffers, foreach=foreach,
        )

    _copy_first = True

    def _weight(self, step: int | None) -> float | None:
        return None
