"""SWALP: SWA of low-precision training iterates (Yang et al., ICML 2019).

Training runs with block-floating-point weights, gradients, momentum, activations and activation
gradients (:func:`quantize_activations_` plus :class:`LowPrecisionOptimizer`); the SWA average of
the low-precision weights is kept in full precision with :class:`ember.swa.SWA` (or ``fit``'s
``swa_start``), and BatchNorm statistics are recomputed with :func:`ember.swa.update_bn`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ember.swa.quantize import BlockQuantizer

__all__ = ["ActivationQuantization", "LowPrecisionOptimizer", "quantize_activations_"]

_LAYERS: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
)
_DEFAULT_TYPES: tuple[type[nn.Module], ...] = _LAYERS + _ACTIVATIONS


class _QuantizeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fwd: Any, bwd: Any, generator: Any) -> Tensor:
        ctx.bwd, ctx.generator = bwd, generator
        return fwd(x, generator=generator) if fwd is not None else x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        if ctx.bwd is None:
            return grad, None, None, None
        return ctx.bwd(grad, generator=ctx.generator), None, None, None


class ActivationQuantization:
    """Handle returned by :func:`quantize_activations_`; :meth:`remove` restores full precision."""

    def __init__(self, handles: list[Any], modules: list[nn.Module]) -> None:
        self._handles = handles
        self.modules = modules

    def remove(self) -> None:
        """Remove every hook this call installed."""
        for h in self._handles:
            h.remove()
        self._handles = []


def quantize_activations_(
    model: nn.Module,
    activation: BlockQuantizer | None,
    error: BlockQuantizer | None,
    *,
    types: tuple[type[nn.Module], ...] = _DEFAULT_TYPES,
    inputs: tuple[type[nn.Module], ...] = _LAYERS,
    generator: Any = None,
) -> ActivationQuantization:
    """Quantize activations of ``model`` in low-precision training (SWALP's placement).

    The output of every submodule of one of ``types`` (default: Linear/Conv layers and the
    activation modules of ``torch.nn``) and the input of every submodule of one of ``inputs``
    (default: Linear/Conv layers, so a layer fed by a functional activation or by the data sees a
    quantized input too) is quantized with ``activation`` going forward, and the gradient flowing
    back through that point with ``error``. SWALP's reference places its quantizers after each
    activation and at the inputs and outputs of convolutions. Either quantizer may be None (that
    direction stays full precision). Stochastic rounding draws from ``generator``. Returns a
    handle whose ``remove()`` undoes it. Averagers built from ``model``
    (:class:`ember.swa.SWA`, :class:`ember.swa.EMA`) leave these hooks out of their copy: the
    average is evaluated in full precision, as in the reference.
    """
    if activation is None and error is None:
        raise ValueError("quantize_activations_ needs an activation or an error quantizer (both None)")
    outs = [m for m in model.modules() if isinstance(m, types)]
    ins = [m for m in model.modules() if isinstance(m, inputs)]
    if not outs and not ins:
        raise ValueError(f"model has no submodule of types {[t.__name__ for t in types + inputs]} "
                         "to quantize")

    def quantize(t: Any) -> Any:
        if not isinstance(t, Tensor) or not t.is_floating_point():
            return t
        return _QuantizeFn.apply(t, activation, error, generator)

    def hook(_mod: nn.Module, _inp: Any, out: Any) -> Any:
        return quantize(out)

    def pre_hook(_mod: nn.Module, args: Any) -> Any:
        return tuple(quantize(a) for a in args)

    # the mark tells averagers to drop these hooks from their copy
    hook.ember_low_precision = True  # type: ignore[attr-defined]
    pre_hook.ember_low_precision = True  # type: ignore[attr-defined]
    handles = [m.register_forward_pre_hook(pre_hook) for m in ins]
    handles += [m.register_forward_hook(hook) for m in outs]
    return ActivationQuantization(handles, list(dict.fromkeys(ins + outs)))


def _accumulators(state: dict[str, Any], p: Tensor, keys: tuple[str, ...]) -> Iterable[Tensor]:
    for key in keys:
        value = state.get(key)
        if isinstance(value, Tensor) and value.is_floating_point() and value.shape == p.shape:
            yield value


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that each :meth:`step` works on a block-floating-point grid.

    Before the inner step the gradients are quantized with ``grad``; after it, the optimizer-state
    tensors named in ``accumulators`` (default: SGD's ``momentum_buffer`` and Adam's first moment
    ``exp_avg``) with ``momentum`` and the parameters with ``weight``. Adam's ``exp_avg_sq`` is
    left in full precision by default: BFP flushes a block's small entries to zero, and Adam then
    divides by ``eps`` (the loss diverges). Any quantizer may be None (left in full
    precision). Stochastic rounding draws from ``generator`` (a ``torch.Generator`` or an
    :mod:`ember.csprng` generator). ``param_groups``, ``state``, ``state_dict()`` and
    ``load_state_dict()`` are the inner optimizer's, so LR schedulers and ``ember.train.fit`` drive
    it like any optimizer. Call :meth:`quantize_weights_` once before training to start on the grid.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        weight: BlockQuantizer | None = None,
        grad: BlockQuantizer | None = None,
        momentum: BlockQuantizer | None = None,
        accumulators: tuple[str, ...] = ("momentum_buffer", "exp_avg"),
        generator: Any = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for name, q in (("weight", weight), ("grad", grad), ("momentum", momentum)):
            if q is not None and not callable(q):
                raise TypeError(f"{name}= must be a BlockQuantizer (or None), got {type(q).__name__}")
        # Share the inner optimizer's groups and state instead of calling Optimizer.__init__.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.weight_quantizer, self.grad_quantizer, self.momentum_quantizer = weight, grad, momentum
        if isinstance(accumulators, str) or not all(isinstance(k, str) for k in accumulators):
            raise TypeError(f"accumulators must be a tuple of state names, got {accumulators!r}")
        self.accumulators = tuple(accumulators)
        self.generator = generator
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._zero_grad_profile_name = f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"

    def __repr__(self) -> str:
        return (f"LowPrecisionOptimizer({self.optimizer!r}, weight={self.weight_quantizer}, "
                f"grad={self.grad_quantizer}, momentum={self.momentum_quantizer})")

    def _params(self) -> Iterable[Tensor]:
        for group in self.param_groups:
            yield from group["params"]

    @torch.no_grad()
    def quantize_weights_(self) -> None:
        """Quantize every parameter in place with the weight quantizer."""
        if self.weight_quantizer is None:
            return
        for p in self._params():
            p.copy_(self.weight_quantizer(p, generator=self.generator))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Quantize gradients, take the inner step, then quantize accumulators and weights."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.grad_quantizer is not None:
            for p in self._params():
                if p.grad is not None:
                    p.grad.copy_(self.grad_quantizer(p.grad, generator=self.generator))
        self.optimizer.step()
        for p in self._params():
            if self.momentum_quantizer is not None and p in self.state:
                for buf in _accumulators(self.state[p], p, self.accumulators):
                    buf.copy_(self.momentum_quantizer(buf, generator=self.generator))
        self.quantize_weights_()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self.state = self.optimizer.state
        self.param_groups = self.optimizer.param_groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
