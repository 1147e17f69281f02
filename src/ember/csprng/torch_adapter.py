"""Routes torch's random functions to ember when they are given an ember generator.

``install()`` (run on ``import ember.csprng``) wraps torch's random entry points (``torch.rand``,
``Tensor.normal_``, ...). A wrapper looks at ``generator=`` first and, for anything other than an
ember generator, calls torch's original function unchanged; non-random torch operations are not
touched at all. Functions that take a generator but that ember does not implement raise for an
ember generator instead of drawing from its inherited Mersenne Twister state.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import pages, patch, spec
from .generator import Generator
from .pages import advise_fresh
from .spec import InvalidArgument, UnsupportedDtype, UnsupportedLayout
from .stream import CounterExhausted

_ORIGINALS: dict[tuple[Any, str], Any] = {}
# device type -> fill(generator, tensor, method, params) for tensors on that device
_DEVICE_BACKENDS: dict[str, Callable[..., bool]] = {}


def register_device_backend(device_type: str, fill: Callable[..., bool]) -> None:
    """Use ``fill(sampler, tensor, method, params) -> bool`` for tensors on ``device_type``.

    It returns False to fall back to generating on the CPU and copying.
    """
    _DEVICE_BACKENDS[device_type] = fill


def _call(impl: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``impl(*args, **kwargs)``, with ember's ValueErrors raised as torch raises them."""
    try:
        return impl(*args, **kwargs)
    except (ValueError, OverflowError) as e:
        _raise_as_torch(e)
        raise


def _raise_as_torch(e: ValueError | OverflowError) -> None:
    """Raise ember's ValueError/OverflowError ``e`` as torch raises it (an InvalidArgument, a
    RuntimeError); return for errors that already are what torch raises."""
    if not isinstance(e, (RuntimeError, CounterExhausted)):
        raise InvalidArgument(str(e)) from e


def _ember(generator: Any) -> bool:
    return generator is not None and isinstance(generator, Generator)


def _bump_version(t: torch.Tensor) -> None:
    # NumPy wrote into the tensor's memory behind autograd's back: record it as a modification
    # (inference tensors have no version counter to record it in)
    if not t.is_inference():
        patch.bump_version(t)


def fill_(t: torch.Tensor, generator: Generator, method: str, *params: Any,
          fresh: bool = False) -> torch.Tensor:
    """Fill ``t`` in place with ``generator``'s sampler ``method``, on any device and layout.

    ``fresh`` says that ``t`` was just created here, so no one else can hold it: no autograd
    checks and no version bump are needed.
    """
    bump = _check_writable(t, method, fresh)
    try:
        spec.check(method, t.dtype, params)
    except (UnsupportedDtype, InvalidArgument):
        if t.numel() or t.is_meta:
            raise
        spec.check_empty(method, t.dtype, params)  # torch's kernel, which checks more, never runs
        return t
    if _abstract(t):  # a meta or fake tensor has no values to fill: torch draws nothing either
        return t
    if type(t) is not _TENSOR_TYPE and type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:
        return _fill_subclass(t, generator, method, params)
    sampler = generator.sampler()
    if _functorch.is_functorch_wrapped_tensor(t):
        # inside torch.func.grad/jvp/...: the wrapper has no storage; draw into a plain tensor
        # and copy it in, which the transform sees as an ordinary (zero-gradient) copy
        with torch._C._DisableFuncTorch():
            tmp = fill_(torch.empty(t.shape, dtype=t.dtype, device=t.device), generator, method,
                        *params, fresh=True)
        return t.copy_(tmp)
    if t.is_complex():
        if t.is_conj() or not t.is_contiguous():
            return t.copy_(fill_(torch.empty(t.shape, dtype=t.dtype, device=t.device), generator,
                                 method, *params, fresh=True))
        fill_(torch.view_as_real(t), generator, method, *_complex_params(method, params))
        return t
    # autograd must see a write into a tensor that requires grad: copy_ gives it torch's zero
    # gradient, as for torch's own in-place draws
    tracked = not fresh and t.requires_grad and torch.is_grad_enabled()
    if not t.is_cpu:
        backend = _DEVICE_BACKENDS.get(t.device.type)
        if not tracked and backend is not None and backend(sampler, t, method, params):
            return t
    elif t.is_contiguous() and not t.is_conj() and not t.is_neg() and not tracked:
        getattr(sampler, method)(t.detach() if t.requires_grad else t, *params)
        if bump and t.numel():
            patch.bump_version(t)
        return t
    # drawn on the CPU and copied in: refused while a CUDA graph is captured (the tracked and
    # fallback fills of CUDA tensors do not pass through the backend's own refusal)
    _refuse_capture(method, t, *params)
    tmp = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    getattr(sampler, method)(tmp, *params)
    t.copy_(tmp)
    return t


# looked up once: the per-draw type tests read a module global, not torch's attribute
_TENSOR_TYPE = torch.Tensor
# what a tensor subclass without its own __torch_dispatch__ inherits
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
# the aten operator that draws each sampler method's values (randperm_ fills fresh tensors only)
_ATEN_DRAWS = {d.method: d.tensor_method for d in spec.DISTRIBUTIONS if d.tensor_method}
_ATEN_DRAWS["random_range_"] = "random_"


def _fill_subclass(t: torch.Tensor, generator: Generator, method: str, params: tuple
                   ) -> torch.Tensor:
    """Fill a tensor subclass that dispatches its own operators (DTensor, a wrapper subclass whose
    values live in inner tensors, MaskedTensor): its memory, if it has any, is not where its values
    are. The values are drawn into a plain tensor and copied in through the subclass's copy_."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    is_dtensor = dtensor is not None and isinstance(t, dtensor.DTensor)
    if is_dtensor:
        _check_replicated_draw(t, generator)
    op = _ATEN_DRAWS.get(method)
    if op is not None:
        # torch's own draw through the subclass, from a throwaway torch generator: it raises
        # where the subclass refuses the draw (as torch does for ember's); copy_ then replaces
        # every value it wrote
        getattr(torch.ops.aten, op)(t, *params, generator=torch.Generator(device=t.device))
    plain = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if type(plain) is not _TENSOR_TYPE:  # a mode makes every new tensor a subclass too
        raise RuntimeError(f"ember.csprng cannot draw into a {type(t).__name__} while new tensors "
                           f"are {type(plain).__name__}s; draw outside this context and pass the "
                           "values in")
    tmp = fill_(plain, generator, method, *params, fresh=True)
    if is_dtensor:
        # every rank draws the whole tensor and keeps its own part of it
        from torch.distributed.tensor.experimental import implicit_replication

        with implicit_replication():
            return t.copy_(tmp)
    return t.copy_(tmp)


def _check_replicated_draw(t: Any, generator: Generator) -> None:
    """A DTensor replicated over several ranks holds the same values on each: every rank draws
    the whole tensor, so their generators must be in the same state, which an OS-keyed one never
    is (ranks would silently hold different values)."""
    replicated = any(p.is_replicate() for p in t.placements)
    if replicated and generator._from_os and t.device_mesh.size() > 1:
        raise RuntimeError(
            "ember.csprng: a DTensor replicated over several ranks needs the same values on every "
            "rank, and an OS-keyed generator draws different ones on each; use "
            "ember.csprng.create_generator(seed) with the same seed (and the same draws) on every "
            "rank, or draw a plain tensor on one rank and distribute it")


def _check_writable(t: Any, method: str, fresh: bool) -> bool:
    """Raise as torch does for an in-place draw into ``t`` that torch refuses; return whether a
    write into ``t``'s memory must be recorded in its version counter."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:  # torch has no random kernels for other layouts either
        raise UnsupportedLayout(f"{method}: only strided tensors are supported, got {t.layout}")
    if fresh:  # made here: nobody else holds it
        return False
    if t.requires_grad and torch.is_grad_enabled() and t.is_leaf:
        raise RuntimeError(
            "a leaf Variable that requires grad is being used in an in-place operation.")
    if t.is_inference():  # no version counter to record a write in
        if not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{method}: Inplace update to inference tensor outside "
                               "InferenceMode is not allowed (torch raises too); make a clone to "
                               "get a normal tensor")
        return False
    return True


def _refuse_capture(op: str, *args: Any) -> None:
    """Raise :class:`~ember.csprng.cuda_backend.CaptureError`, naming ``op``, when one of ``args`` is a CUDA
    tensor and the current CUDA stream is capturing a graph: the draw happens on the host, so every
    replay would repeat its values. Called before anything is drawn: a refused draw consumes no
    stream."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            from .cuda_backend import refuse_capture

            refuse_capture(op)
            return


def _abstract(t: torch.Tensor) -> bool:
    """Whether ``t`` is a meta tensor or a FakeTensor (shapes only, no values)."""
    if t.is_meta:
        return True
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return fake is not None and isinstance(t, fake.FakeTensor)


def _complex_params(method: str, params: tuple) -> tuple:
    # torch draws complex normals with variance std**2 split evenly over the two parts
    if method == "normal_":
        mean, std = params
        return (mean, std / 2**0.5)
    return params


def _size(args: Sequence[Any], kwargs: dict) -> tuple[int, ...]:
    if "size" in kwargs:
        size = kwargs.pop("size")
        if args:
            raise TypeError("size given both positionally and as a keyword")
    elif len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        size = args[0]
    else:
        size = args
    dims = tuple(_int_arg(s, "size") for s in size)
    if any(d < 0 for d in dims):
        raise RuntimeError(f"Trying to create tensor with negative dimension: {list(dims)}")
    return dims


def _int_arg(v: Any, what: str) -> int:
    """``v`` as an int where torch's parser takes an int (floats and bools are refused)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_floating_point():
        return int(v)
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise TypeError(f"{what} must be an int, got {type(v).__name__} {v!r}")
    return v.__index__()


def _new(size: tuple[int, ...], kwargs: dict, default_dtype: torch.dtype | None = None, *,
         op: str) -> tuple[torch.Tensor, bool, bool]:
    """The output tensor of a factory call ``op`` (``out=`` if given), its requires_grad flag,
    and whether the tensor is new (not the caller's ``out=``)."""
    if len(kwargs) == 1:  # generator= alone: the common call, kept short
        return advise_fresh(torch.empty(size, dtype=default_dtype)), False, True
    out = kwargs.pop("out", None)
    kwargs_dtype = kwargs.pop("dtype", None)
    dtype = kwargs_dtype or default_dtype
    requires_grad = bool(kwargs.pop("requires_grad", False))
    layout = kwargs.pop("layout", None) or torch.strided
    device = kwargs.pop("device", None)
    pin_memory = bool(kwargs.pop("pin_memory", False))
    kwargs.pop("generator", None)
    if kwargs:  # names= included: torch has no overload with both generator= and names=
        raise TypeError(f"unexpected keyword arguments: {sorted(kwargs)}")
    if out is not None:
        dtype = kwargs_dtype
        if dtype is not None and out.dtype != dtype:
            raise RuntimeError(f"dtype {dtype} does not match the dtype of out= ({out.dtype})")
        _refuse_capture(op, out)  # before out= is resized: a refused call changes nothing
        if out.shape != size:
            out.resize_(size)
        return out, requires_grad, False
    t = torch.empty(size, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)
    return (t if pin_memory else advise_fresh(t)), requires_grad, True


def _finish(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.requires_grad_() if requires_grad else t


def _new_like(input: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, bool, bool]:
    kwargs.pop("generator", None)
    if input.layout != torch.strided and kwargs.get("layout") in (None, input.layout):
        raise UnsupportedLayout(f"only strided tensors are supported, got {input.layout}")
    requires_grad = bool(kwargs.pop("requires_grad", False))
    t = torch.empty_like(input, dtype=kwargs.pop("dtype", None), layout=kwargs.pop("layout", None),
                         device=kwargs.pop("device", None),
                         pin_memory=bool(kwargs.pop("pin_memory", False)),
                         memory_format=kwargs.pop("memory_format", torch.preserve_format))
    if kwargs:
        raise TypeError(f"unexpected keyword arguments: {sorted(kwargs)}")
    return t, requires_grad, True


def _pick(args: Sequence[Any], kwargs: dict, names: Sequence[str], defaults: Sequence[Any]
          ) -> list[Any]:
    """Positional-or-keyword parameters ``names`` (with ``defaults``) from a call."""
    if len(args) > len(names):
        raise TypeError(f"expected at most {len(names)} positional arguments, got {len(args)}")
    rest = zip(names[len(args):], defaults[len(args):], strict=True)
    values = list(args) + [kwargs.pop(n, d) for n, d in rest]
    kwargs.pop("generator", None)
    if kwargs:
        raise TypeError(f"unexpected keyword arguments: {sorted(kwargs)}")
    return values


# ---------------------------------------------------------------------- factories
def _check_resizable_out(kwargs: dict) -> None:
    # torch's rand/randn resize out= first, which refuses a tensor that requires grad
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor) and out.requires_grad and (
            out.is_leaf or torch.is_grad_enabled()):
        raise RuntimeError("cannot resize variables that require grad")


def _check_size_given(name: str, args: Sequence[Any], kwargs: dict) -> None:
    if not args and "size" not in kwargs:
        raise TypeError(f'{name}() missing 1 required positional arguments: "size"')


def _fresh_cpu(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """For the common call ``torch.rand(n, m, ..., generator=g)`` (int sizes, nothing else): the
    new output if it is a plain contiguous CPU tensor of a float dtype, which the sampler fills
    directly; None for every other call, which takes the general path."""
    if len(kwargs) != 1 or not args:
        return None
    return _fresh_output(args)


def _fresh_output(dims: Sequence[Any]) -> torch.Tensor | None:
    """A new tensor of shape ``dims`` if they are non-negative ints and the default device and
    dtype make it a plain CPU float tensor (huge pages advised where large); else None."""
    for d in dims:
        if type(d) is not int or d < 0:
            return None
    t = torch.empty(*dims) if dims else torch.empty(())  # unpacked ints parse faster than a tuple
    if (type(t) is not torch.Tensor or not t.is_cpu or t.dtype not in _FRESH_DTYPES
            or _functorch.is_functorch_wrapped_tensor(t)):
        return None  # a fake/meta tensor, another default device or dtype, torch.func: the general path
    return advise_fresh(t) if t.numel() * 8 >= pages.ADVISE_BYTES else t  # else too small


def _normal_fresh_cpu(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """For ``torch.normal(mean, std, size, generator=g)`` with number mean and std, int sizes and
    no keyword but ``device="cpu"`` (positional, or all three as keywords, as Opacus calls it):
    the new output as :func:`_fresh_cpu` makes it; None for every other call."""
    if len(args) == 3:
        (mean, std, size), named = args, _NORMAL_FAST_KEYS
    elif not args:
        mean, std, size = kwargs.get("mean"), kwargs.get("std"), kwargs.get("size")
        named = _NORMAL_FAST_KEYWORDS
    else:
        return None
    if (type(mean) not in (int, float) or type(std) not in (int, float)
            or type(size) not in (tuple, list, torch.Size) or not kwargs.keys() <= named
            or not std >= 0):
        return None  # another keyword (dtype=, out=, ...), or a std to refuse: the general path
    device = kwargs.get("device")
    if not (device is None or device == "cpu"
            or (type(device) is torch.device and device.type == "cpu")):
        return None
    return _fresh_output(size)


_NORMAL_FAST_KEYS = frozenset({"generator", "device"})
_NORMAL_FAST_KEYWORDS = _NORMAL_FAST_KEYS | {"mean", "std", "size"}
# default dtypes whose fresh CPU tensors the samplers fill directly
_FRESH_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _rand(*args: Any, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    t = _fresh_cpu(args, kwargs)
    if t is not None:
        g._sampler.uniform_(t, 0.0, 1.0)
        return t
    _check_size_given("rand", args, kwargs)
    _check_resizable_out(kwargs)
    t, rg, fresh = _new(_size(args, kwargs), kwargs, op="torch.rand")
    return _finish(fill_(t, g, "uniform_", 0.0, 1.0, fresh=fresh), rg)


def _randn(*args: Any, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    t = _fresh_cpu(args, kwargs)
    if t is not None:
        g._sampler.normal_(t, 0.0, 1.0)
        return t
    _check_size_given("randn", args, kwargs)
    _check_resizable_out(kwargs)
    t, rg, fresh = _new(_size(args, kwargs), kwargs, op="torch.randn")
    return _finish(fill_(t, g, "normal_", 0.0, 1.0, fresh=fresh), rg)


def _rand_like(input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    t, rg, fresh = _new_like(input, kwargs)
    return _finish(fill_(t, g, "uniform_", 0.0, 1.0, fresh=fresh), rg)


def _randn_like(input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    t, rg, fresh = _new_like(input, kwargs)
    return _finish(fill_(t, g, "normal_", 0.0, 1.0, fresh=fresh), rg)


def _randint(*args: Any, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    rest = list(args)
    if "size" not in kwargs and rest and isinstance(rest[-1], (tuple, list, torch.Size)):
        kwargs["size"] = rest.pop()
    if "high" in kwargs:
        high = kwargs.pop("high")
        low = kwargs.pop("low", rest.pop(0) if rest else 0)
    elif len(rest) == 2:
        low, high = rest
        rest = []
    elif len(rest) == 1 and "low" not in kwargs:  # torch has no randint(high, size, low=)
        low, high = 0, rest.pop()
    else:
        raise TypeError("randint() takes (high, size) or (low, high, size); low= goes with high=")
    if rest:
        raise TypeError("randint(): too many positional arguments")
    if "size" not in kwargs:
        raise TypeError('randint() missing 1 required positional argument: "size"')
    low, high = _int_arg(low, "randint(): low"), _int_arg(high, "randint(): high")
    for v in (low, high):
        if not -(1 << 63) <= v < 1 << 63:
            raise InvalidArgument(f"randint: bound {v} overflows int64 (torch's parser takes "
                                  "int64 bounds)")
    t, rg, fresh = _new(_size((), kwargs), kwargs, default_dtype=torch.int64, op="torch.randint")
    if low >= high and not _abstract(t):  # torch checks the bounds where it draws values
        raise InvalidArgument(f"random_ expects 'from' to be less than 'to', but got "
                              f"from={low} >= to={high}")
    return _finish(fill_(t, g, "random_range_", low, high, fresh=fresh), rg)


def _randint_like(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    if "high" in kwargs:
        high = kwargs.pop("high")
        low = kwargs.pop("low", args[0] if args else 0)
    elif len(args) == 2:
        low, high = args
    elif len(args) == 1:
        low, high = kwargs.pop("low", 0), args[0]
    else:
        raise TypeError("randint_like() missing the high argument")
    low, high = _int_arg(low, "randint_like(): low"), _int_arg(high, "randint_like(): high")
    t, rg, fresh = _new_like(input, kwargs)
    return _finish(fill_(t, g, "random_range_", low, high, fresh=fresh), rg)


def _randperm(n: int, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    n = _int_arg(n, "randperm(): n")
    if n < 0:
        raise RuntimeError(f"randperm: n must be non-negative, got {n}")
    t, rg, fresh = _new((n,), kwargs, default_dtype=torch.int64, op="torch.randperm")
    return _finish(fill_(t, g, "randperm_", fresh=fresh), rg)


def _normal(*args: Any, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    t = _normal_fresh_cpu(args, kwargs)
    if t is not None:  # torch.normal(mean, std, size, [device="cpu"]): Opacus's noise call
        mean, std = args[:2] if len(args) >= 2 else (kwargs["mean"], kwargs["std"])
        g._sampler.normal_(t, float(mean), float(std))
        return t
    if len(args) >= 3 or "size" in kwargs:
        return _normal_sized(g, args, kwargs)
    mean, std = _pick(args, {k: kwargs.pop(k) for k in ("mean", "std") if k in kwargs},
                      ("mean", "std"), (0.0, 1.0))
    out = kwargs.pop("out", None)
    kwargs.pop("generator", None)
    if kwargs:  # factory keywords (dtype=, device=, ...) belong to the float-float-size overload
        raise TypeError(f"normal(): unexpected keyword arguments {sorted(kwargs)}")
    return _normal_tensors(g, mean, std, out)


def _normal_sized(g: Generator, args: tuple, kwargs: dict) -> torch.Tensor:
    """``torch.normal(mean, std, size, ...)`` with number mean and std: a factory."""
    if len(args) >= 2:
        mean, std = (list(args[:2]) + [kwargs.pop("mean", 0.0), kwargs.pop("std", 1.0)])[:2]
    else:
        mean, std = kwargs.pop("mean", args[0] if args else 0.0), kwargs.pop("std", 1.0)
    size = args[2] if len(args) >= 3 else kwargs.pop("size")
    if not isinstance(size, (tuple, list, torch.Size)):
        raise TypeError(f"normal(): size must be a tuple of ints, not {type(size).__name__}")
    if isinstance(mean, torch.Tensor) or isinstance(std, torch.Tensor):
        raise TypeError("normal(mean, std, size) takes float mean and std")
    if kwargs.get("device") is None:  # torch.device(...) contexts do not reach normal
        kwargs["device"] = "cpu"
    t, rg, fresh = _new(_size((size,), {}), kwargs, op="torch.normal")
    return _finish(fill_(t, g, "normal_", float(mean), float(std), fresh=fresh), rg)


def _wants_grad(*xs: Any) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                           for x in xs)


def _check_normal_tensors(mean: Any, std: Any, out: torch.Tensor | None) -> torch.Tensor:
    """torch's checks of normal's tensor overloads; returns the tensor whose dtype and device
    the draw takes (mean, else std)."""
    mt, st = isinstance(mean, torch.Tensor), isinstance(std, torch.Tensor)
    if not (mt or st):
        raise TypeError("normal(mean, std) with float mean and std needs a size")
    abstract = any(isinstance(x, torch.Tensor) and _abstract(x) for x in (mean, std))
    if st and not abstract and bool(((std < 0) | std.isnan()).any()):
        raise RuntimeError("normal expects all elements of std >= 0.0")
    if not st and not float(std) >= 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {float(std)}")
    ref = mean if mt else std
    if not (ref.is_floating_point() or ref.is_complex()):  # torch draws into mean's dtype first
        raise UnsupportedDtype(f"normal: not implemented for {ref.dtype} "
                               f"{'mean' if mt else 'std'} (torch raises too)")
    if out is not None:
        if not (out.is_floating_point() or out.is_complex()):
            raise UnsupportedDtype(f"normal: not implemented for out= of dtype {out.dtype}")
        if _wants_grad(mean, std):
            raise RuntimeError("normal(): functions with out=... arguments don't support "
                               "automatic differentiation, but one of the arguments requires "
                               "grad.")
    return ref


def _normal_tensors(g: Generator, mean: Any, std: Any, out: torch.Tensor | None
                    ) -> torch.Tensor:
    """``torch.normal`` with a tensor mean or std (or both)."""
    ref = _check_normal_tensors(mean, std, out)
    shapes = [x.shape for x in (mean, std) if isinstance(x, torch.Tensor)]
    if out is not None and not isinstance(std, torch.Tensor):
        shapes.append(out.shape)  # torch draws into out= itself here, broadcast with mean
    shape = torch.broadcast_shapes(*shapes)
    # torch draws into the output (out=, else a tensor of mean's dtype, or std's for a float
    # mean) and scales and shifts it in place: the output keeps that dtype
    dtype = out.dtype if out is not None else ref.dtype
    _refuse_capture("torch.normal", mean, std, out)  # a CPU draw copied into a CUDA out= is refused too
    # the tensor overloads draw standard normals, then scale and shift them
    z = fill_(torch.empty(shape, dtype=dtype, device=ref.device), g, "normal_", 0.0, 1.0)
    if _wants_grad(mean, std):
        res = _ScaleShift.apply(z, std, mean)  # torch defines zero gradients for mean and std
    else:
        res = z * std + mean
    res = res.to(dtype)
    if out is not None:
        _resize_output(out, res.shape)
        return out.copy_(res)
    return res


def _resize_output(out: torch.Tensor, shape: torch.Size) -> None:
    """Resize ``out=`` to ``shape`` as torch's out= operators do: with a warning when it held
    elements in another shape."""
    if out.shape == shape:
        return
    if out.numel():
        warnings.warn(
            f"An output with one or more elements was resized since it had shape {list(out.shape)}"
            f", which does not match the required output shape {list(shape)}. This behavior is "
            "deprecated, and in a future PyTorch release outputs will not be resized unless they "
            "have zero elements. You can explicitly reuse an out tensor t by resizing it, "
            "inplace, to zero elements with t.resize_(0).", UserWarning, stacklevel=5)
    out.resize_(shape)


class _ScaleShift(torch.autograd.Function):
    """``z * std + mean`` whose gradients to ``std`` and ``mean`` are zero (torch's definition for
    ``torch.normal``'s tensor overloads)."""

    @staticmethod
    def forward(z: torch.Tensor, std: Any, mean: Any) -> torch.Tensor:
        return z * std + mean

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.likes = [(x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else None
                     for x in inputs[1:]]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        zeros = [None if like is None else torch.zeros(like[0], dtype=like[1], device=like[2])
                 for like in ctx.likes]
        return (None, *zeros)


def _bernoulli(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    out = kwargs.pop("out", None)
    (p,) = _pick(args, kwargs, ("p",), (None,))
    if isinstance(p, torch.Tensor):
        raise TypeError("bernoulli(): p must be a float (torch has no bernoulli(input, Tensor p)"
                        "; use input.bernoulli_(p))")
    if p is None and not (input.is_floating_point() or input.is_complex()):
        raise UnsupportedDtype(f"bernoulli: not implemented for p of dtype {input.dtype} "
                               "(torch raises too)")
    _refuse_capture("torch.bernoulli", input, out)  # before out= is resized: a refused call changes nothing
    t = out.resize_(input.shape) if out is not None else torch.empty_like(
        input, memory_format=torch.contiguous_format)
    res = fill_(t, g, "bernoulli_", input.resolve_neg() if p is None else p)
    if out is None:
        res = _no_gradient(res, input, "bernoulli" if p is None else None)
    return res


def _no_gradient(res: torch.Tensor, input: torch.Tensor, name: str | None) -> torch.Tensor:
    """``res`` (drawn from ``input``) as torch returns it when ``input`` requires grad: requiring
    grad too, with torch's zero gradient (or, ``name`` None, a backward that raises as torch's)."""
    if not (input.requires_grad and torch.is_grad_enabled() and res.is_floating_point()):
        return res
    return _ZeroGradient.apply(res, input, name)


class _ZeroGradient(torch.autograd.Function):
    """The identity on a draw, whose gradient to the tensor it was drawn from is zero."""

    @staticmethod
    def forward(res: torch.Tensor, input: torch.Tensor, name: str | None) -> torch.Tensor:
        return res.view_as(res)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        _, input, ctx.name = inputs
        ctx.like = (input.shape, input.dtype, input.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.name is None:
            raise RuntimeError("derivative for aten::bernoulli is not implemented")
        return None, torch.zeros(ctx.like[0], dtype=ctx.like[1], device=ctx.like[2]), None


def _multinomial(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    out = kwargs.pop("out", None)
    num_samples, replacement = _pick(args, kwargs, _MULTINOMIAL.names, _MULTINOMIAL.defaults)
    if num_samples is None:
        raise TypeError("multinomial() missing num_samples")
    num_samples = _int_arg(num_samples, "multinomial(): argument 'num_samples'")
    if not isinstance(replacement, bool):
        raise TypeError(f"multinomial(): argument 'replacement' must be bool, not "
                        f"{type(replacement).__name__}")
    abstract = _abstract(input)
    spec.check_input("multinomial", input.dtype, (num_samples, replacement), abstract)
    if input.dim() in (1, 2) and input.shape[-1] > 1 << 24:
        raise InvalidArgument("multinomial: number of categories cannot exceed 2^24, got "
                              f"{input.shape[-1]}")
    if out is not None and out.dtype != torch.int64 and not abstract:  # torch's meta kernel takes it
        raise InvalidArgument(f"multinomial expects Long tensor out, got: {out.dtype}")
    if abstract:  # shapes only: nothing to draw
        if input.dim() not in (1, 2):
            raise InvalidArgument(f"multinomial: prob_dist must be 1 or 2 dim, got {input.dim()}")
        res = torch.empty((*input.shape[:-1], num_samples), dtype=torch.int64, device=input.device)
        return out.resize_(res.shape) if out is not None else res
    _refuse_capture("torch.multinomial", input, out)  # drawn on the CPU, then copied to the input's device
    with torch._C._DisableFuncTorch():  # inside torch.func: NumPy reads plain tensors
        res = g.sampler().multinomial(_unwrapped(input), num_samples, bool(replacement))
    res = res.to(input.device)
    if out is not None:
        out.resize_(res.shape).copy_(res)
        return out
    return res if res.numel() else torch.empty(res.shape, dtype=res.dtype, device=res.device)


_MULTINOMIAL = spec.by_method("multinomial")


def _poisson(input: torch.Tensor, generator: Any = None) -> torch.Tensor:
    abstract = _abstract(input)
    spec.check_input("poisson", input.dtype, (), abstract)
    if abstract:  # shapes only: nothing to draw
        return torch.empty_like(input)
    _refuse_capture("torch.poisson", input)  # drawn on the CPU, then copied to the input's device
    with torch._C._DisableFuncTorch():  # inside torch.func: NumPy reads plain tensors
        res = generator.sampler().poisson(_unwrapped(input))
    return _no_gradient(res.to(input.device), input, "poisson")


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """``t`` without torch.func's wrappers (inside grad/jvp/...): the values, which the draw reads
    and does not differentiate."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


def _unsupported(name: str) -> Callable[..., Any]:
    def raiser(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{name} is not implemented for ember.csprng generators (torch would silently draw "
            "from the generator's non-secure inherited state); call it without generator=")
    return raiser


# ---------------------------------------------------------------------- in-place methods
def _scalar_method(method: str, names: tuple[str, ...], defaults: tuple[Any, ...]):
    def impl(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        g = kwargs["generator"]
        params = _pick(args, kwargs, names, defaults)
        for name, v in zip(names, params, strict=True):
            if isinstance(v, (str, bytes)):  # float() would parse it; torch's parser refuses
                raise TypeError(f"{method}(): argument '{name}' must be float, not "
                                f"{type(v).__name__}")
        return fill_(self, g, method, *params)
    return impl


def _random_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    if (args and args[0] is None) or ("from" in kwargs and kwargs["from"] is None):
        raise TypeError("random_(): argument 'from' must be int, not NoneType")
    low, high = _pick(args, kwargs, ("from", "to"), (None, None))
    if low is None and high is None:
        return fill_(self, g, "random_")
    if high is None and len(args) == 1 and "from" not in kwargs:
        low, high = 0, low  # random_(to)
    low = 0 if low is None else _int_arg(low, "random_(): argument 'from'")
    for v in (low, high):
        if isinstance(v, int) and not -(1 << 63) <= v < 1 << 63:
            raise InvalidArgument(f"random_: bound {v} overflows int64 (torch's parser takes "
                                  "int64 bounds)")
    if high is None:
        from .distributions import representable_range

        spec.check("random_range_", self.dtype, ())  # before the dtype's range is looked up
        high = representable_range(self.dtype)[1] + 1
        if high - 1 >= 1 << 63:  # torch's int64 bound: uint64's largest value is refused
            raise InvalidArgument(f"random_: to - 1 = {high - 1} is out of bounds for {self.dtype}")
    return fill_(self, g, "random_range_", low, _int_arg(high, "random_(): argument 'to'"))


def _bernoulli_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    g = kwargs["generator"]
    (p,) = _pick(args, kwargs, ("p",), (0.5,))
    if not isinstance(p, torch.Tensor):
        if isinstance(p, (str, bytes)):  # float() would parse it; torch's parser refuses
            raise TypeError(f"bernoulli_(): argument 'p' must be float, not {type(p).__name__}")
        return fill_(self, g, "bernoulli_", p)
    if p.is_cuda:  # a CUDA p read for a CPU draw (a CUDA self is refused by its fill)
        _refuse_capture("Tensor.bernoulli_", p)
    p = p.resolve_neg()  # the sampler reads p's memory: a negated view's values are elsewhere
    if not (_wants_grad(p) and self.is_floating_point()):
        return fill_(self, g, "bernoulli_", p)
    # torch's in-place draw joins p's graph, with a zero gradient to p
    drawn = fill_(torch.empty_like(self), g, "bernoulli_", p.detach(), fresh=True)
    return self.copy_(_ZeroGradient.apply(drawn, p, "bernoulli"))


def _tensor_bernoulli(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return _bernoulli(self, *args, **kwargs)


# ---------------------------------------------------------------------- installation
# The function serving each entry point that a record of ember.csprng.spec names (its
# torch_functions, tensor_method and tensor_methods); a record's in-place Tensor method not listed
# here is served by _scalar_method. _routes checks this against the records on import.
_SERVES: dict[str, Callable[..., Any]] = {
    "torch.rand": _rand, "torch.randn": _randn, "torch.rand_like": _rand_like,
    "torch.randn_like": _randn_like, "torch.randint": _randint, "torch.randint_like": _randint_like,
    "torch.randperm": _randperm, "torch.normal": _normal, "torch.bernoulli": _bernoulli,
    "torch.multinomial": _multinomial, "torch.poisson": _poisson,
    "Tensor.random_": _random_, "Tensor.bernoulli_": _bernoulli_,
    "Tensor.bernoulli": _tensor_bernoulli, "Tensor.multinomial": _multinomial,
}
# torch functions whose first argument is a tensor whose type's __torch_function__ sees the call
_TENSOR_FIRST = frozenset({"rand_like", "randn_like", "randint_like", "bernoulli", "multinomial",
                           "poisson"})
# torch functions that take a generator and have no record: refused for an ember generator
_REFUSED = ("binomial", "_standard_gamma", "_sample_dirichlet", "rrelu", "rrelu_")


def _routes(records: Sequence[spec.Distribution], serves: dict[str, Callable[..., Any]],
            refused: Sequence[str]) -> tuple[dict[str, Callable[..., Any]],
                                             dict[str, Callable[..., Any]]]:
    """``(torch functions, Tensor methods)``: name -> the function that serves it, for every entry
    point the ``records`` name, and the ``refused`` torch functions; raises
    :class:`~ember.csprng.spec.RecordMismatch` where ``serves`` and the records disagree."""
    wanted: dict[str, spec.Distribution] = {}
    for d in records:
        wanted.update({f"torch.{n}": d for n in d.torch_functions})
        on_tensors = (*d.tensor_methods, *((d.tensor_method,) if d.tensor_method else ()))
        wanted.update({f"Tensor.{n}": d for n in on_tensors})

    def generic(name: str, d: spec.Distribution) -> Callable[..., Any] | None:
        if d.fills and name == f"Tensor.{d.tensor_method}":
            return _scalar_method(d.method, d.names, d.defaults)
        return None

    table = spec.dispatch_table("ember.csprng.torch_adapter", wanted, serves, generic)
    routed = sorted(n for n in refused if f"torch.{n}" in table)
    if routed:
        raise spec.RecordMismatch(f"torch.{routed[0]} is both routed to a record and refused")
    functions = {n.partition(".")[2]: f for n, f in table.items() if n.startswith("torch.")}
    functions.update({n: _unsupported(f"torch.{n}") for n in refused})
    methods = {n.partition(".")[2]: f for n, f in table.items() if n.startswith("Tensor.")}
    return functions, methods


_TORCH, _TENSOR = _routes(spec.DISTRIBUTIONS, _SERVES, _REFUSED)


def _wraps(original: Callable[..., Any]):
    """functools.wraps without ``__wrapped__``: torch.compile must trace the wrapper itself,
    not skip to the original function it would find there; and keep this module as
    ``__module__`` so that it does not take the wrapper for a torch function."""
    return functools.wraps(original, updated=(), assigned=("__name__", "__doc__"))


def _wrap(original: Callable[..., Any], impl: Callable[..., Any], positional_generator: int = -1,
          tensor_first: bool = False):
    # Under torch.compile the draw runs eagerly at a graph break: the generator's stream is Python
    # state that a graph cannot hold, and the eager draw keeps compiled and eager output equal.
    # The disabled wrapper is made on first use: torch.compiler.disable imports torch._dynamo,
    # which costs seconds at import time.
    disabled: list[Callable[..., Any]] = []
    name = getattr(original, "__name__", "random function")

    def eager_impl(*args: Any, **kwargs: Any) -> Any:
        # the wrapper runs again at torch.compile's graph break, eagerly: the same routing as an
        # eager call (vmap's randomness rules included). torch.export traces with
        # is_compiling() still True: the flag tells the wrapper it is that eager run
        if not disabled:
            disabled.append(torch.compiler.disable(functools.partial(_eager, wrapper)))
        _AT_GRAPH_BREAK.depth += 1
        try:
            return disabled[0](*args, **kwargs)
        finally:
            _AT_GRAPH_BREAK.depth -= 1
    @_wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        g = kwargs.get("generator")
        if g is None and 0 <= positional_generator < len(args):  # torch.poisson(input, generator)
            g = args[positional_generator]
            if _ember(g):
                args, kwargs = args[:positional_generator], {"generator": g}
        if g is None or not isinstance(g, Generator):
            return original(*args, **kwargs)
        if torch.compiler.is_compiling() and not _AT_GRAPH_BREAK.depth:
            return eager_impl(*args, **kwargs)
        if _jit_tracing() or _dispatch_modes():
            _refuse_tracing(name)  # torch.export traces at the graph break, as torch.compile does
        if tensor_first and args and type(args[0]) is not _TENSOR_TYPE and _own_torch_function(
                args[0]):
            # a subclass with its own __torch_function__ sees the call, as torch's methods do
            return _handle_torch_function(wrapper, args[:1], *args, **kwargs)
        if _functorch.peek_interpreter_stack() is not None:  # inside vmap, grad, ...
            return _under_transform(name, impl, args, kwargs)
        try:  # _call(impl, args, kwargs), inlined: one frame fewer on every draw
            return impl(*args, **kwargs)
        except (ValueError, OverflowError) as e:
            _raise_as_torch(e)
            raise

    # each wrapper runs its own code object: torch.compile caches the frames it resumes after a
    # graph break inside a wrapper (torch's own generator) per code object, so one shared by
    # every routed function would be recompiled for each of them and reach its recompile limit
    wrapper.__code__ = wrapper.__code__.replace(co_qualname=f"{name} (ember.csprng wrapper)")
    wrapper.__ember_original__ = original
    return wrapper


class _GraphBreakDepth(threading.local):
    """How deep this thread is in wrappers run at a graph break (eagerly); 0 elsewhere."""

    depth = 0


_AT_GRAPH_BREAK = _GraphBreakDepth()
_jit_tracing = patch.get("torch._C._is_tracing")
_dispatch_modes = patch.get("torch._C._len_torch_dispatch_stack")
_handle_torch_function = torch.overrides.handle_torch_function
_PLAIN_TORCH_FUNCTION = vars(torch.Tensor)["__torch_function__"].__func__


def _own_torch_function(x: Any) -> bool:
    """Whether ``x``'s type defines its own ``__torch_function__`` (not Tensor's, nor disabled)
    and it is not disabled now (inside it). A subclass that inherits Tensor's sees the draw's
    operations as before, on subclass tensors."""
    method = getattr(type(x), "__torch_function__", None)
    impl = getattr(method, "__func__", None)
    return (impl is not None and impl is not _PLAIN_TORCH_FUNCTION
            and _has_torch_function_unary(x))


_has_torch_function_unary = torch.overrides.has_torch_function_unary


def _refuse_tracing(name: str) -> None:
    """Raise if torch.jit.trace, make_fx or torch.export is recording the call: the draw writes
    through NumPy, which a trace cannot see, so the traced program would hold an empty tensor
    where the draw was and return uninitialised memory as its noise."""
    if _jit_tracing():
        tracer = "torch.jit.trace"
    elif patch.get("torch.fx.experimental.proxy_tensor.get_proxy_mode")() is not None:
        tracer = "torch.export / make_fx"
    elif patch.get("torch._C._get_dispatch_mode")(
            patch.get("torch._C._TorchDispatchModeKey.FUNCTIONAL")) is not None:
        tracer = "functionalization (AOTAutograd, aot_function)"
    else:
        return  # another dispatch mode (FakeTensorMode, FlopCounterMode, ...): draws as usual
    raise RuntimeError(
        f"ember.csprng: {name} with an ember generator cannot be recorded by {tracer}: the traced "
        "program would return uninitialised memory where the draw was. Draw outside the traced "
        "function and pass the values in as an input (torch.compile runs ember draws eagerly)")


def install() -> None:
    """Route torch's random functions to ember for ember generators (idempotent)."""
    if _ORIGINALS:
        return
    patch.check()  # fail closed on a torch without the private names the routing needs
    # torch.device(...) as a context manager (and set_default_device) puts the factories that
    # it finds in this set on its device; it is built from torch.rand & co. on first use, so
    # build it now, from torch's own functions, and add the wrappers below
    base = patch.get("torch.utils._device._device_constructors")()
    for name, impl in _TORCH.items():
        original = getattr(torch, name, None)
        if original is None or not patch.takes_generator(name, original):
            continue  # torch has no such call with a generator: it refuses ember's as any other
        _ORIGINALS[(torch, name)] = original
        wrapper = _wrap(original, impl, 1 if name == "poisson" else -1, name in _TENSOR_FIRST)
        setattr(torch, name, wrapper)
        _script_as_builtin(wrapper, original, name)
    for name, impl in _TENSOR.items():
        original = getattr(torch.Tensor, name)
        _ORIGINALS[(torch.Tensor, name)] = torch.Tensor.__dict__.get(name, _INHERITED)
        setattr(torch.Tensor, name, _wrap(original, impl, tensor_first=True))
    if isinstance(base, set):  # the cached set itself: torch.compile keeps tracing torch's function
        _DEVICE_WRAPPERS.update(getattr(torch, n) for (m, n), o in _ORIGINALS.items()
                                if m is torch and o in base)
        base.update(_DEVICE_WRAPPERS)
    from . import python_paths

    python_paths.install(_ORIGINALS)
    # modules that did `from torch import randperm` (torch.utils.data.dataset) hold the original
    replaced = {id(o): getattr(torch, n) for (m, n), o in list(_ORIGINALS.items()) if m is torch}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is torch or not mod_name.startswith("torch"):
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in replaced and not attr.startswith("__"):
                _ORIGINALS[(mod, attr)] = value
                setattr(mod, attr, replaced[id(value)])


def _script_as_builtin(wrapper: Callable[..., Any], original: Callable[..., Any], name: str
                       ) -> None:
    """Let torch.jit.script compile calls of ``wrapper`` as calls of the aten operator, as it
    did for ``original``: scripted code never sees an ember generator (it only takes
    torch.Generator), and a Python wrapper cannot be scripted."""
    from torch.jit import _builtins

    op = _builtins._find_builtin(original) or f"aten::{name}"
    _builtins._register_builtin(wrapper, op)


_INHERITED = object()
_functorch = torch._C._functorch
_VMAP_ERROR = ("vmap: called random operation while in randomness error mode. Please either use "
               "the 'same' or 'different' randomness flags on vmap or perform the randomness "
               "operation out of vmap")


def _interpreters() -> list[Any]:
    """torch.func's interpreters on the stack, outermost first."""
    from torch._functorch import pyfunctorch

    every = getattr(pyfunctorch, "retrieve_all_functorch_interpreters", None)
    interps = every() if every is not None else [
        pyfunctorch.retrieve_current_functorch_interpreter()]
    return sorted(interps, key=lambda i: i.level())


def _vmap_key() -> Any:
    from torch._functorch.pyfunctorch import TransformType

    return TransformType.Vmap


def _batched_anywhere(t: torch.Tensor) -> bool:
    """Whether ``t`` is batched by a vmap at some level, under any other torch.func wrappers."""
    while True:
        if _functorch.is_batchedtensor(t):
            return True
        if not _functorch.is_functorch_wrapped_tensor(t):
            return False
        t = _functorch.get_unwrapped(t)


def _under_transform(name: str, impl: Callable[..., Any], args: Any, kwargs: dict) -> Any:
    """A draw inside torch.func transforms: vmap's randomness modes, as torch's generator has them.

    Every vmap on the stack counts, not only the innermost (``vmap(grad(f))``, ``jacfwd`` and
    ``hessian`` are vmaps around other transforms): ``"error"`` at any level raises as torch does;
    ``"same"`` shares the draw across that vmap's batch; ``"different"`` draws one independent
    result per batch element of every such vmap and batches them at their levels. Draws that take
    batched tensors, and in-place draws with ``"different"``, raise.
    """
    interps = _interpreters()
    vmaps = [i for i in interps if i.key() == _vmap_key()]
    if not vmaps:
        return _call(impl, args, kwargs)
    if any(v.randomness() == "error" for v in vmaps):
        raise RuntimeError(_VMAP_ERROR)
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(_batched_anywhere(t) for t in tensors):
        raise RuntimeError(
            f"ember.csprng: {name} with a batched tensor argument inside torch.vmap is not "
            "supported; draw with factory functions (torch.rand/randn/randint/randperm/normal "
            "with a size) inside vmap, or draw outside it")
    different = [v for v in vmaps if v.randomness() == "different"]
    if not different:
        return _call(impl, args, kwargs)
    if name.endswith("_") or "out" in kwargs:
        raise RuntimeError(
            "vmap: Cannot ask for different inplace randomness on an unbatched tensor. This "
            "will appear like same randomness. If this is necessary for your usage, please file "
            f"an issue with functorch. (ember.csprng: {name})")
    sizes = [v.batch_size() for v in different]
    count = math.prod(sizes)
    # plain tensors (the values of any unbatched tensor arguments: a draw does not differentiate
    # them); the levels are added below, in order
    args = tuple(_unwrapped(a) if isinstance(a, torch.Tensor) else a for a in args)
    kwargs = {k: _unwrapped(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch._C._DisableFuncTorch():
        draws = torch.stack([_call(impl, args, dict(kwargs)) for _ in range(count)])
        draws = draws.reshape(*sizes, *draws.shape[1:])
    batched = False
    for i in interps:  # outermost first: each level's wrapper holds the inner ones' dims
        if i.key() == _vmap_key():
            if i.randomness() == "different":
                draws = _functorch._add_batch_dim(draws, 0, i.level())
                batched = True
        elif batched:  # grad/jvp inside a batching vmap: what its ops return is wrapped for it
            draws = _functorch._wrap_for_grad(draws, i.level())
    return draws


try:
    from torch._library.fake_class_registry import FakeScriptObject as _FakeScriptObject
except ImportError:  # pragma: no cover - older torch

    class _FakeScriptObject:  # type: ignore[no-redef]
        pass


def _eager(impl: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``impl`` for real; under torch.compile this runs at a graph break.

    When a traced tensor method reaches here while torch.compile computes its output shape, the
    generator is a placeholder: ask for a graph break so that the call runs eagerly instead.
    """
    if type(kwargs.get("generator")) is _FakeScriptObject:
        unsupported = patch.get("torch._dynamo.exc.Unsupported")
        raise unsupported("ember.csprng draws run eagerly (graph break)")
    return impl(*args, **kwargs)


_DEVICE_WRAPPERS: set[Any] = set()


def uninstall() -> None:
    """Restore torch's original functions."""
    if _DEVICE_WRAPPERS:
        patch.get("torch.utils._device._device_constructors")().difference_update(_DEVICE_WRAPPERS)
        _DEVICE_WRAPPERS.clear()
    for (owner, name), original in _ORIGINALS.items():
        if original is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _ORIGINALS.clear()


def installed() -> bool:
    return bool(_ORIGINALS)
