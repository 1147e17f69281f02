"""Every private torch name ember.csprng relies on, checked when ember.csprng is imported.

ember routes torch's random functions to its generators by patching torch (see ``torch_adapter``),
and some of that needs torch's private names: the set of factories that ``torch.device(...)``
contexts redirect, the DataLoader's iterator base class, torch.func's interpreter stack, ... A torch
release may rename or remove any of them. :func:`check` looks each one up when ember.csprng is
imported and raises :class:`TorchIncompatible`, naming the torch version and the missing names,
instead of letting a draw fall through to torch's own (non-secure) generator later.

A fix for a new torch version belongs here: code elsewhere gets these names through :func:`get`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

__all__ = ["HOOKS", "Hook", "TorchIncompatible", "check", "get"]


class TorchIncompatible(ImportError):
    """This torch lacks a private name ember.csprng needs (or has it in another shape)."""


def _is_class(v: Any) -> bool:
    return isinstance(v, type)


def _is_attribute(v: Any) -> bool:
    return v is not None


def _returns_set(v: Any) -> bool:
    return callable(v) and isinstance(v(), set)


@dataclass(frozen=True)
class Hook:
    """A private torch name: ``module`` and ``attr`` (dotted within the module), and its shape."""

    module: str
    attr: str
    why: str
    shape: Callable[[Any], bool] = callable
    #: False where ember has a working path without it (never torch's generator)
    required: bool = True
    #: False for a name whose module is slow to import: looked up on first use (get) instead
    at_import: bool = True

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


HOOKS: tuple[Hook, ...] = (
    Hook("torch.utils._device", "_device_constructors",
         "factories that torch.device(...) contexts put on their device; the wrappers join it",
         _returns_set),
    Hook("torch.utils.data.dataloader", "_BaseDataLoaderIter",
         "its __init__ seeds datapipes from the generator: refused for ember generators",
         _is_class),
    Hook("torch.utils.data.graph_settings", "_is_random_datapipe",
         "tells a random datapipe (shuffle, sample) in a DataLoader's graph"),
    Hook("torch.utils.data.graph_settings", "get_all_graph_pipes", "the datapipes of a graph"),
    Hook("torch.nn.init", "sparse_",
         "draws its zero pattern from the global generator: its code is replaced with a call to "
         "ember's (the parameters are checked when it is installed)",
         lambda v: hasattr(v, "__code__")),
    Hook("torch.jit._builtins", "_find_builtin", "lets torch.jit.script see a wrapper as the op"),
    Hook("torch.jit._builtins", "_register_builtin",
         "lets torch.jit.script see a wrapper as the op"),
    Hook("torch._C._autograd", "_unsafe_set_version_counter",
         "records a write made through NumPy as an in-place modification",
         lambda v: _version_setter(v) is not None),
    Hook("torch._C", "_DisableFuncTorch", "draws into plain tensors inside torch.func",
         _is_class),
    Hook("torch._C._functorch", "is_functorch_wrapped_tensor", "torch.func's wrapped tensors"),
    Hook("torch._C._functorch", "get_unwrapped", "torch.func's wrapped tensors"),
    Hook("torch._C._functorch", "is_batchedtensor", "vmap's batched tensors"),
    Hook("torch._C._functorch", "peek_interpreter_stack", "whether a torch.func transform runs"),
    Hook("torch._C._functorch", "_add_batch_dim", "vmap's randomness='different'"),
    Hook("torch._C._functorch", "_wrap_for_grad", "draws inside grad under vmap"),
    Hook("torch._functorch.pyfunctorch", "retrieve_current_functorch_interpreter",
         "the innermost torch.func transform"),
    Hook("torch._functorch.pyfunctorch", "TransformType", "tells vmap from other transforms",
         _is_class),
    Hook("torch._functorch.pyfunctorch", "retrieve_all_functorch_interpreters",
         "every torch.func transform on the stack (older torch: the innermost only)",
         required=False),
    Hook("torch._dynamo.exc", "Unsupported", "asks torch.compile for a graph break", _is_class,
         at_import=False),
    Hook("torch._library.fake_class_registry", "FakeScriptObject",
         "the placeholder generator torch.compile passes while it computes shapes", _is_class,
         required=False),
    Hook("torch._C", "_is_tracing", "tells a torch.jit.trace in progress: draws refused"),
    Hook("torch._C", "_len_torch_dispatch_stack",
         "whether a dispatch mode runs (a tracer's among them), checked on every draw"),
    Hook("torch._C", "_get_dispatch_mode",
         "tells functionalization (FunctionalTensorMode) in progress: draws refused"),
    Hook("torch._C", "_TorchDispatchModeKey.FUNCTIONAL", "the key of functionalization's mode",
         _is_attribute),
    Hook("torch.fx.experimental.proxy_tensor", "get_proxy_mode",
         "tells a make_fx or torch.export trace in progress: draws refused"),
    Hook("torch._subclasses.fake_tensor", "FakeTensor", "shapes-only tensors draw nothing",
         _is_class),
    Hook("torch._C", "_cuda_getCurrentRawStream", "the CUDA stream handle, fast",
         required=False),
    Hook("torch", "Tensor._version", "the version counter a write through NumPy bumps",
         _is_attribute),
    Hook("torch", "_assert_async", "checks bernoulli_'s p and the integer refill on the GPU"),
    Hook("torch", "_foreach_add_", "sums Opacus's secure noise draws (normal_foreach_)"),
    Hook("torch", "_foreach_div_", "sums Opacus's secure noise draws (normal_foreach_)"),
    Hook("torch", "_foreach_copy_", "sums Opacus's secure noise draws (normal_foreach_)"),
    Hook("torch", "_standard_gamma", "wrapped to refuse ember generators", required=False),
    Hook("torch", "_sample_dirichlet", "wrapped to refuse ember generators", required=False),
)

_BY_NAME = {h.name: h for h in HOOKS}


def _version_setter(setter: Any) -> Callable[[torch.Tensor, int], None] | None:
    """``set(t, version)`` through torch's ``_unsafe_set_version_counter``, which takes tuples of
    tensors and versions in newer torch and one tensor and one int in older; None if neither."""
    probe = torch.empty(0)
    try:
        setter((probe,), (probe._version,))
    except TypeError:
        pass
    else:
        return lambda t, v: setter((t,), (v,))
    try:
        setter(probe, probe._version)
    except TypeError:
        return None
    return cast(Callable[[torch.Tensor, int], None], setter)


_SETTER: Any = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
_SET_VERSION = _version_setter(_SETTER)
_TUPLES = _SET_VERSION is not None and _SET_VERSION is not _SETTER  # newer torch's convention


# factories that have no generator= parameter in some torch versions (rand_like & co. in 2.4),
# with the other arguments of a call that would succeed
_LATE_GENERATOR_PROBES: dict[str, tuple[Any, ...]] = {
    "rand_like": (), "randn_like": (), "randint_like": (1,)}


def takes_generator(name: str, original: Callable[..., Any]) -> bool:
    """Whether torch's function ``torch.<name>`` accepts ``generator=`` in this torch."""
    probe = _LATE_GENERATOR_PROBES.get(name)
    if probe is None:
        return True
    try:
        original(torch.empty(0), *probe, generator=torch.Generator())
    except TypeError:
        return False
    return True


def bump_version(t: torch.Tensor) -> None:
    """Record a write into ``t``'s memory that autograd did not see (one made through NumPy)."""
    if _TUPLES:  # the common case, called directly: this runs on every in-place draw
        _SETTER((t,), (t._version + 1,))
    elif _SET_VERSION is not None:
        _SET_VERSION(t, t._version + 1)
    else:
        hook = _BY_NAME["torch._C._autograd._unsafe_set_version_counter"]
        raise TorchIncompatible(_message([hook]))


def _lookup(hook: Hook) -> Any:
    value: Any = importlib.import_module(hook.module)
    for part in hook.attr.split("."):
        value = getattr(value, part)
    return value


def get(name: str) -> Any:
    """The private torch object ``name`` (``"module.attr"``, one of :data:`HOOKS`)."""
    hook = _BY_NAME[name]
    try:
        return _lookup(hook)
    except (ImportError, AttributeError) as e:
        raise TorchIncompatible(_message([hook])) from e


def _broken(hook: Hook) -> bool:
    try:
        return not hook.shape(_lookup(hook))
    except Exception:  # noqa: BLE001 - missing, or not in the expected shape: either way broken
        return True


def _message(hooks: list[Hook]) -> str:
    names = "; ".join(f"{h.name} ({h.why})" for h in hooks)
    return (f"ember.csprng does not support torch {torch.__version__}: it lacks, or has in another "
            f"shape, {names}. ember will not route draws to torch's own generator instead; use a "
            "torch version in ember's tested range")


def check() -> None:
    """Raise :class:`TorchIncompatible` if a required hook is missing or has another shape."""
    broken = [h for h in HOOKS if h.required and h.at_import and _broken(h)]
    if broken:
        raise TorchIncompatible(_message(broken))
