"""Functional draws as ``torch.library`` custom ops, for ``torch.compile(fullgraph=True)``.

A generator object cannot live inside a compiled graph, so these ops take the stream position as a
tensor instead: ``values, state = ember.csprng.ops.sample(state, "normal_", (4, 4))`` is a pure
function of ``state`` (like JAX's explicit keys) and returns the state after the draw. Get a state
from a generator with :func:`state_of` and continue the generator from one with :func:`load_into`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import spec
from .distributions import NativeSampler
from .stream import BlockStream
from .views import tensor_bytes

STATE_BYTES = 33  # 16-byte key, then the block counter as 17 little-endian bytes
_METHODS = spec.fill_methods()


def _stream_from(state: torch.Tensor) -> BlockStream:
    if state.dtype != torch.uint8 or state.numel() != STATE_BYTES:
        raise ValueError(f"expected a uint8 state of {STATE_BYTES} bytes, got {state.dtype} "
                         f"with {state.numel()} elements")
    raw = tensor_bytes(state)
    return BlockStream(raw[:16], int.from_bytes(raw[16:], "little"))


def _state_tensor(stream: BlockStream) -> torch.Tensor:
    raw = stream.key + stream.counter.to_bytes(17, "little")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


# The schema is spelled out: torch before 2.5 cannot infer one from postponed (string) annotations.
@torch.library.custom_op("ember::sample", mutates_args=(), schema=(
    "(Tensor state, str method, SymInt[] shape, ScalarType dtype, float[] fparams, SymInt[] iparams)"
    " -> (Tensor, Tensor)"))
def _sample(state: torch.Tensor, method: str, shape: list[int], dtype: torch.dtype,
            fparams: list[float], iparams: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    if method not in _METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {_METHODS}")
    if state.is_cuda:  # the draw runs on the host: a captured one would replay the same values
        from .torch_adapter import _refuse_capture

        _refuse_capture("ember.csprng.ops.sample", state)
    stream = _stream_from(state)
    out = torch.empty(shape, dtype=dtype)
    getattr(NativeSampler(stream), method)(out, *iparams, *fparams)
    return out.to(state.device), _state_tensor(stream).to(state.device)


@_sample.register_fake
def _sample_fake(state, method, shape, dtype, fparams, iparams):
    return (torch.empty(shape, dtype=dtype, device=state.device),
            torch.empty(STATE_BYTES, dtype=torch.uint8, device=state.device))


def sample(state: torch.Tensor, method: str, shape: Sequence[int], *params: float | int,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, next_state)``: a draw of ``method`` (a NativeSampler method such as
    ``"uniform_"`` or ``"random_range_"``) with ``params``, from the stream position ``state``."""
    ints = all(isinstance(p, int) and not isinstance(p, bool) for p in params)
    if method in ("random_range_", "random_") and ints:
        return _sample(state, method, list(shape), dtype, [], [int(p) for p in params])
    return _sample(state, method, list(shape), dtype, [float(p) for p in params], [])


def state_of(generator) -> torch.Tensor:
    """The functional state (key and counter) of a native ember generator."""
    stream = getattr(generator, "_stream", None)
    if stream is None or stream.cipher_name != "aes128":
        raise TypeError("state_of: expected a native AES-128 ember.csprng generator")
    return _state_tensor(stream)


def load_into(generator, state: torch.Tensor) -> None:
    """Move ``generator`` to the position ``state`` (its key must be the generator's key)."""
    stream = _stream_from(state)
    if stream.key != generator._stream.key:
        raise ValueError("load_into: the state belongs to a different key")
    generator._stream.reset(stream.key, stream.counter)
