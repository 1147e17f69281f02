"""One record per distribution: what torch calls it, its parameters, the dtypes it fills (or, for
``multinomial`` and ``poisson``, reads), and where each backend implements it.

Every table keyed by a method's name is derived from :data:`DISTRIBUTIONS`: the adapter's routing
of torch functions and Tensor methods and its checks, the CUDA backends' fill tables and capture
messages, ``ops``'s methods, the torchcsprng-compatible sampler's refusals. Argument checking
follows torch's rules here, in one place, as NumPy's random validates arguments by constraint: a
record names the constraint of each parameter and the dtype rule, and :func:`check` applies them
with torch's exception types and messages before anything is drawn (on meta tensors too, where
torch does).

Adding a distribution takes a record here and the CPU sampler method (``distributions``); where
torch has a function for it (not only an in-place Tensor method), the function serving it
(``torch_adapter._SERVES``); where the CUDA paths have it, a Triton fill (``cuda_backend``) and the
host side of its NVRTC kernels (``cuda_fast``). Each table is checked against the records when its
module is imported (:func:`dispatch_table`): a record asking for something its module lacks is an
error naming the record.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = ["DISTRIBUTIONS", "Constraint", "Distribution", "DtypeRule", "InvalidArgument", "Param",
           "RecordMismatch", "UnsupportedDtype", "UnsupportedLayout", "by_method", "check",
           "dispatch_table"]

_T = TypeVar("_T")


class InvalidArgument(RuntimeError, ValueError):
    """A bad argument to a random function: torch raises RuntimeError for it (also a ValueError)."""


class UnsupportedDtype(NotImplementedError, TypeError):
    """A dtype the distribution does not support: torch raises NotImplementedError (also a
    TypeError)."""


class UnsupportedLayout(NotImplementedError, TypeError):
    """A tensor layout the draws do not fill (sparse, ...): torch raises NotImplementedError (also
    a TypeError)."""


class RecordMismatch(RuntimeError):
    """A table built from the records does not match them: a record asks for an entry point or a
    backend fill that its module does not implement, or a module implements one that no record
    asks for. Raised when that module is imported."""


class Constraint(enum.Enum):
    """What a scalar parameter must satisfy before anything is drawn (a tensor is not checked
    here). Each value is torch's rule; its message is built by :func:`_violation`."""

    ANY = "any"
    NOT_NAN = "not nan"
    NON_NEGATIVE = ">= 0"
    POSITIVE = "> 0"
    OPEN_UNIT = "in (0, 1)"


@dataclass(frozen=True)
class Param:
    name: str
    default: Any
    constraint: Constraint = Constraint.ANY
    #: how torch names the parameter in its messages, where that differs from ``name``
    torch_name: str = ""


@dataclass(frozen=True)
class DtypeRule:
    """The dtypes a distribution fills (or, for one that returns a new tensor, reads: multinomial's
    probabilities, poisson's rates), and the exception type torch raises for the others."""

    #: raised for an integer or bool tensor; None when integers are filled
    integers: type[Exception] | None = None
    #: raised for a complex tensor; None when complex tensors are filled (each part drawn)
    complex: type[Exception] | None = None
    #: whether bool tensors are filled (when integers are)
    bools: bool = True
    #: whether uint16/uint32/uint64 are filled (torch fills them only with ranged integers)
    wide_uints: bool = False
    #: the only dtypes filled, when the rule is a list
    only: tuple[torch.dtype, ...] | None = None
    #: whether torch applies the rule to meta tensors too (its meta kernels of multinomial and
    #: poisson check no dtype)
    on_meta: bool = True
    #: the errors above that torch raises only where it draws values (its kernel checks the
    #: dtype), so not for a tensor with no elements; the others it checks first
    unraised_when_empty: tuple[type[Exception], ...] = (UnsupportedDtype,)


@dataclass(frozen=True)
class Distribution:
    """A distribution as the adapter, the samplers and the CUDA paths see it."""

    #: the sampler method that draws it (``NativeSampler``, ``MT19937Sampler``)
    method: str
    params: tuple[Param, ...]
    dtypes: DtypeRule
    #: how a user calls it, for messages (e.g. the CUDA graph capture refusal)
    op_name: str
    #: the torch.Tensor in-place method routed to it, if any
    tensor_method: str | None = None
    #: further torch.Tensor methods that draw with it (``Tensor.multinomial``)
    tensor_methods: tuple[str, ...] = ()
    #: torch functions that draw with it
    torch_functions: tuple[str, ...] = ()
    #: whether the Triton path (``cuda_backend``) fills it on CUDA
    triton: bool = False
    #: the NVRTC kernels (``cuda_fast``) a fill may launch; () when it has none
    nvrtc: tuple[str, ...] = ()
    #: whether torchcsprng's stream (``compat.MT19937Sampler``) has it
    compat: bool = True
    #: a further check of the tensor's dtype and the parameters (torch's, where it has one)
    extra: Callable[[torch.dtype, tuple], None] | None = None
    #: whether the sampler method fills a given tensor in place (``multinomial`` and ``poisson``
    #: return a new one, drawn from the tensor the dtype rule is about)
    fills: bool = True

    @property
    def defaults(self) -> tuple[Any, ...]:
        return tuple(p.default for p in self.params)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


_RANDPERM_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                    torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WIDE_UINTS = tuple(getattr(torch, f"uint{b}") for b in (16, 32, 64) if hasattr(torch, f"uint{b}"))


def _check_uniform_bounds(dtype: torch.dtype, params: tuple) -> None:
    """torch's checks of uniform_'s bounds: each within the dtype's finite range, and the width
    too (else the values would be inf)."""
    if not (dtype.is_floating_point and len(params) == 2):
        return
    try:
        low, high = float(params[0]), float(params[1])
    except (TypeError, ValueError):
        return  # the sampler refuses it with the argument named
    info = torch.finfo(dtype)
    for name, v in (("from", low), ("to", high)):
        if v < info.min or v > info.max:
            raise InvalidArgument(f"uniform_: {name} is out of bounds for {dtype}, got {name}={v} "
                                  f"(finite range {info.min}..{info.max})")
    if high - low > info.max:
        raise InvalidArgument(f"uniform_ expects to-from <= {info.max} (the largest {dtype}), but "
                              f"found to={high} and from={low}, which exceed it")


def _check_bernoulli_p(dtype: torch.dtype, params: tuple) -> None:
    p = params[0] if params else None
    if isinstance(p, torch.Tensor) and not (p.is_floating_point() or p.is_complex()):
        raise UnsupportedDtype(f"bernoulli_: not implemented for p of dtype {p.dtype} "
                               "(torch raises too)")


_FLOATS = DtypeRule(integers=UnsupportedDtype)
_CONTINUOUS = DtypeRule(integers=InvalidArgument, complex=InvalidArgument)
# torch checks the dtype before it draws (uniform_'s and random_'s bounds, randperm's)
_CHECKED_FIRST: tuple[type[Exception], ...] = ()

DISTRIBUTIONS: tuple[Distribution, ...] = (
    Distribution("uniform_", (Param("from", 0.0), Param("to", 1.0)),
                 DtypeRule(integers=UnsupportedDtype, unraised_when_empty=_CHECKED_FIRST),
                 "Tensor.uniform_ (torch.rand)", tensor_method="uniform_",
                 torch_functions=("rand", "rand_like"), triton=True, nvrtc=("uniform",),
                 extra=_check_uniform_bounds),
    Distribution("normal_", (Param("mean", 0.0), Param("std", 1.0, Constraint.NON_NEGATIVE)), _FLOATS,
                 "Tensor.normal_ (torch.randn)", tensor_method="normal_",
                 torch_functions=("randn", "randn_like", "normal"), triton=True,
                 nvrtc=("normal",)),
    Distribution("log_normal_", (Param("mean", 1.0), Param("std", 2.0, Constraint.POSITIVE)),
                 DtypeRule(integers=UnsupportedDtype, complex=UnsupportedDtype),
                 "Tensor.log_normal_", tensor_method="log_normal_", triton=True,
                 nvrtc=("normal",)),
    Distribution("exponential_",
                 (Param("lambd", 1.0, Constraint.POSITIVE, torch_name="lambda"),),
                 DtypeRule(integers=InvalidArgument, complex=InvalidArgument,
                           unraised_when_empty=(UnsupportedDtype, InvalidArgument)),
                 "Tensor.exponential_", tensor_method="exponential_", triton=True,
                 nvrtc=("exponential",)),
    Distribution("cauchy_", (Param("median", 0.0), Param("sigma", 1.0, Constraint.POSITIVE)), _CONTINUOUS,
                 "Tensor.cauchy_", tensor_method="cauchy_", triton=True),
    Distribution("geometric_", (Param("p", None, Constraint.OPEN_UNIT),),
                 DtypeRule(complex=UnsupportedDtype, bools=False), "Tensor.geometric_",
                 tensor_method="geometric_", triton=True),
    Distribution("random_", (), DtypeRule(complex=UnsupportedDtype), "Tensor.random_",
                 tensor_method="random_", triton=True, nvrtc=("integer", "refill")),
    Distribution("random_range_", (Param("from", None), Param("to", None)),
                 DtypeRule(complex=InvalidArgument, wide_uints=True,
                           unraised_when_empty=_CHECKED_FIRST),
                 "Tensor.random_ (torch.randint)", torch_functions=("randint", "randint_like"),
                 triton=True, nvrtc=("integer", "refill")),
    Distribution("bernoulli_", (Param("p", 0.5),), DtypeRule(complex=UnsupportedDtype),
                 "Tensor.bernoulli_", tensor_method="bernoulli_", tensor_methods=("bernoulli",),
                 torch_functions=("bernoulli",),
                 triton=True, nvrtc=("bernoulli",), compat=False, extra=_check_bernoulli_p),
    Distribution("randperm_", (), DtypeRule(only=_RANDPERM_DTYPES, unraised_when_empty=_CHECKED_FIRST),
                 "torch.randperm",
                 torch_functions=("randperm",)),
    Distribution("multinomial", (Param("num_samples", None), Param("replacement", False)),
                 DtypeRule(integers=InvalidArgument, complex=InvalidArgument, on_meta=False),
                 "torch.multinomial",
                 torch_functions=("multinomial",), tensor_methods=("multinomial",), compat=False,
                 fills=False),
    Distribution("poisson", (),
                 DtypeRule(integers=UnsupportedDtype, complex=UnsupportedDtype, on_meta=False),
                 "torch.poisson", torch_functions=("poisson",), compat=False, fills=False),
)

_BY_METHOD = {d.method: d for d in DISTRIBUTIONS}


def by_method(method: str) -> Distribution:
    """The record of the sampler method ``method`` (KeyError for an unknown one)."""
    return _BY_METHOD[method]


def _low_precision(dtype: torch.dtype) -> bool:
    return str(dtype).startswith(("torch.float8", "torch.float4"))


def _dtype_error(d: Distribution, dtype: torch.dtype) -> type[Exception] | None:
    """The exception type torch raises for filling a ``dtype`` tensor with ``d``, or None."""
    rule = d.dtypes
    if _low_precision(dtype):
        return UnsupportedDtype
    if rule.only is not None:
        return None if dtype in rule.only else UnsupportedDtype
    if dtype.is_complex:
        return rule.complex
    if dtype.is_floating_point:
        return None
    if rule.integers is not None:
        return rule.integers
    if dtype == torch.bool and not rule.bools:
        return UnsupportedDtype
    if dtype in _WIDE_UINTS and not rule.wide_uints:
        return UnsupportedDtype
    return None


# what a number satisfying each constraint passes (NaN fails every one but ANY)
_ACCEPTS: dict[Constraint, Callable[[float], bool]] = {
    Constraint.NOT_NAN: lambda v: v == v,
    Constraint.NON_NEGATIVE: lambda v: v >= 0.0,
    Constraint.POSITIVE: lambda v: v > 0.0,
    Constraint.OPEN_UNIT: lambda v: 0.0 < v < 1.0,
}
_NUMBERS = (int, float)  # a tensor or another kind of number is left to the sampler
# per method: (position, accepts, parameter) for each constrained parameter, made once
_CHECKS = {d.method: tuple((i, _ACCEPTS[p.constraint], p) for i, p in enumerate(d.params)
                           if p.constraint is not Constraint.ANY) for d in DISTRIBUTIONS}
# per (method, dtype), made on first use: (the dtype's error or None, the checks, the extra check)
_PLANS: dict[tuple[str, torch.dtype], tuple[type[Exception] | None, tuple, Callable | None]] = {}


def _check_params(method: str, params: tuple) -> None:
    """Raise InvalidArgument for a number parameter that breaks its constraint."""
    _check_values(method, _CHECKS[method], params)


def _check_values(method: str, checks: tuple, params: tuple) -> None:
    for i, accepts, p in checks:
        if i < len(params) and isinstance(params[i], _NUMBERS) and not accepts(params[i]):
            name = p.torch_name or p.name  # a bool is the number it stands for, as in torch
            v = int(params[i]) if type(params[i]) is bool else params[i]
            raise InvalidArgument(f"{method} expects {name} {p.constraint.value}, but found "
                                  f"{name}={v}")


def _plan(method: str, dtype: torch.dtype) -> tuple[type[Exception] | None, tuple, Callable | None]:
    d = _BY_METHOD[method]
    plan = _PLANS[(method, dtype)] = (_dtype_error(d, dtype), _CHECKS[method], d.extra)
    return plan


def check(method: str, dtype: torch.dtype, params: tuple) -> None:
    """Raise what torch raises for filling a ``dtype`` tensor with ``method(*params)`` (for
    ``multinomial`` and ``poisson``: for drawing from a ``dtype`` tensor)."""
    # called on every draw: one table lookup, and nothing else for the common unconstrained call
    plan = _PLANS.get((method, dtype)) or _plan(method, dtype)
    error, checks, extra = plan
    if error is not None:
        raise error(f"{method}: not implemented for {dtype} (torch raises too)")
    if checks:
        _check_values(method, checks, params)
    if extra is not None:
        extra(dtype, params)


def check_input(method: str, dtype: torch.dtype, params: tuple, abstract: bool) -> None:
    """:func:`check` for a distribution drawn from an input tensor of ``dtype`` (``multinomial``,
    ``poisson``); for a meta or fake input (``abstract``), only what torch's meta kernel checks."""
    if abstract and not _BY_METHOD[method].dtypes.on_meta:
        _check_params(method, params)
    else:
        check(method, dtype, params)


def check_empty(method: str, dtype: torch.dtype, params: tuple) -> None:
    """Raise what torch raises for filling a ``dtype`` tensor with no elements: the parameters'
    checks, and only the dtype errors torch checks before drawing."""
    _check_params(method, params)
    d = _BY_METHOD[method]
    error = _dtype_error(d, dtype)
    if error is not None and error not in d.dtypes.unraised_when_empty:
        raise error(f"{method}: not implemented for {dtype} (torch raises too)")


def check_params(method: str, params: tuple) -> None:
    """Raise what torch raises for ``method``'s number parameters ``params`` (any dtype)."""
    _check_params(method, params)


def fill_methods() -> tuple[str, ...]:
    """Every sampler method that fills a tensor."""
    return tuple(d.method for d in DISTRIBUTIONS if d.fills)


def dispatch_table(where: str, wanted: Mapping[str, Distribution], impls: Mapping[str, _T],
                   default: Callable[[str, Distribution], _T | None] | None = None
                   ) -> dict[str, _T]:
    """The table ``{name: implementation}`` of every name in ``wanted`` (each mapped to the record
    that asks for it), taken from ``impls`` (what the module ``where`` implements), else from
    ``default(name, record)``.

    Raises :class:`RecordMismatch` naming the record when a name it asks for has no
    implementation, and naming the implementation when no record asks for it.
    """
    unasked = sorted(set(impls) - set(wanted))
    if unasked:
        raise RecordMismatch(f"{where} implements {', '.join(unasked)}, which no record in "
                             "ember.csprng.spec asks for")
    table: dict[str, _T] = {}
    for name, d in wanted.items():
        impl = impls[name] if name in impls else default(name, d) if default else None
        if impl is None:
            raise RecordMismatch(f"the record {d.method!r} (ember.csprng.spec) asks for {name}, "
                                 f"which {where} does not implement")
        table[name] = impl
    return table
