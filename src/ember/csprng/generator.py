"""``ember.csprng.Generator``: a generator for torch's random API whose values come from a cipher.

The object is deliberately *not* a ``torch.Generator``: it has no Mersenne Twister state at all.
:mod:`ember.csprng.torch_adapter` routes torch's random functions to its sampler when it is passed
as ``generator=``; every other path into torch's C++ kernels (``torch.ops.aten.*``,
``torch._C._VariableFunctions.*``, functions bound before ember was imported, ...) is refused by
torch's own argument parser with a TypeError or RuntimeError before anything is drawn. So a value
either comes from ember's stream or the call raises: there is no state to fall back on.
"""

from __future__ import annotations

import os
import pickle
import threading
import weakref
from typing import Any, SupportsIndex, cast

import torch

from .ciphers import cipher_names
from .distributions import NativeSampler
from .stream import (
    BlockStream,
    check_key,
    derive_key,
    forget_fork_rekey,
    key_from_seed,
    rekey_after_fork,
    renew_lock_after_fork,
)
from .views import tensor_bytes

_MAGIC = b"EMBR"
_VERSION = 2
_HEADER = 72  # see _state_bytes for the layout
_V1_CIPHERS = ("aes128", "chacha20")  # version 1 stored the cipher as its index in this list
KINDS = ("random_device", "seeded", "keyed", "derived", "mt19937")
_CPU = torch.device("cpu")


class InheritedStateUsed(RuntimeError):
    """A draw from a state the generator does not have. ember's generator is not a
    ``torch.Generator`` and has no inherited state: torch paths that ember does not route raise
    at once instead, so ember itself never raises this; it stays importable for code that
    catches it."""


class Generator:
    """A cryptographically secure generator: AES-128 in counter mode over a 128-bit counter.

    Construct it with :func:`create_random_device_generator` (key from the OS), with
    :func:`create_generator` (key derived from a seed, reproducible) or with
    :func:`create_mt19937_generator` (torchcsprng-compatible streams). ``Generator()`` alone is a
    random-device generator. Pass it as ``generator=`` to torch's random functions; it is not a
    ``torch.Generator`` subclass (use :func:`ember.csprng.is_generator` to test for one).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        renew_lock_after_fork(self)
        self._spawned = 0
        self._seed: int | None = None
        self.allow_pickle = False
        self._from_os = False
        self._configure_os(cipher="aes128")

    # ------------------------------------------------------------------ configuration
    def _configure_os(self, cipher: str) -> None:
        self._set_stream("random_device", os.urandom(16), 0, cipher, from_os=True)

    def _set_stream(self, kind: str, key: bytes, counter: int, cipher: str,
                    from_os: bool = False, seed: int | None = None) -> None:
        old = getattr(self, "_stream", None)
        if old is not None:
            forget_fork_rekey(old)
        _RESEED_AFTER_FORK.discard(self)
        self._kind = kind
        self._seed = seed
        self._stream: BlockStream | None = BlockStream(key, counter, cipher)
        self._sampler: Any = NativeSampler(self._stream)
        self._from_os = from_os
        if from_os and seed is not None:  # seeded from the OS by seed(): a child re-seeds
            _RESEED_AFTER_FORK.add(self)
        elif from_os:
            rekey_after_fork(self._stream)

    def _set_compat(self, sampler: Any) -> None:
        old = getattr(self, "_stream", None)
        if old is not None:
            forget_fork_rekey(old)
        _RESEED_AFTER_FORK.discard(self)
        self._kind = "mt19937"
        self._stream = None
        self._sampler = sampler
        self._from_os = False
        self._seed = sampler.initial_seed

    # ------------------------------------------------------------------ properties
    @property
    def kind(self) -> str:
        """How the key was made: one of ``random_device``, ``seeded``, ``keyed``, ``derived``,
        ``mt19937``."""
        return self._kind

    @property
    def reproducible(self) -> bool:
        """Whether the stream can be re-created from a seed or saved state (not OS-keyed)."""
        return not self._from_os

    @property
    def cipher(self) -> str:
        return "aes128" if self._stream is None else self._stream.cipher_name

    @property
    def counter(self) -> int:
        """The next unused block counter (0 for the torchcsprng-compatible kind)."""
        return 0 if self._stream is None else self._stream.counter

    @property
    def device(self) -> torch.device:
        """The device of the generator's state: always the CPU (it fills tensors on any device)."""
        return _CPU

    def sampler(self) -> Any:
        """The sampler that produces this generator's values."""
        return self._sampler

    # ------------------------------------------------------------------ torch.Generator API
    def manual_seed(self, seed: int) -> Generator:
        """Re-key deterministically from ``seed`` at counter 0; the generator becomes seeded.

        ``seed`` is an int as for ``torch.Generator.manual_seed``: a negative seed in
        ``[-2**63, 0)`` means ``seed + 2**64`` as in torch; non-negative seeds may be up to
        ``2**128 - 1`` (torch: ``2**64 - 1``). Floats, bools, strings and tensors raise
        ``RuntimeError`` and out-of-range ints ``ValueError``, as in torch.
        """
        seed = check_seed(seed, "manual_seed")
        if self._kind == "mt19937":
            from .compat import MT19937Sampler

            self._set_compat(MT19937Sampler(seed))
            return self
        self._set_stream("seeded", key_from_seed(seed), 0, self.cipher, seed=seed)
        return self

    def seed(self) -> int:
        """Re-key from a fresh 128-bit seed taken from the OS; returns the seed.

        The generator stays OS-keyed: it refuses pickling (unless ``allow_pickle``) and a forked
        child re-seeds itself from the OS, so parent and child never share a stream (its
        ``initial_seed()`` then returns the child's own seed). ``manual_seed(returned seed)``
        repeats the stream deterministically. The torchcsprng-compatible kind takes a 32-bit seed
        and, like torchcsprng, is not re-seeded after a fork.
        """
        if self._kind == "mt19937":
            seed = int.from_bytes(os.urandom(4), "little")
            self.manual_seed(seed)
            return seed
        return self._reseed_from_os()

    def _reseed_from_os(self) -> int:
        seed = int.from_bytes(os.urandom(16), "little")
        self._set_stream("seeded", key_from_seed(seed), 0, self.cipher, from_os=True, seed=seed)
        return seed

    def initial_seed(self) -> int:
        """The seed the current key was derived from."""
        if self._seed is None:
            raise RuntimeError(
                f"this ember.csprng.Generator (kind={self._kind!r}) was keyed directly, not from "
                "a seed, so it has no initial seed; save and restore it with get_state()/"
                "set_state() instead"
            )
        return self._seed

    def get_state(self) -> torch.Tensor:
        """The full state (kind, key, counter, spawn count, seed) as a uint8 tensor."""
        # a copy in torch's own memory: resizable like torch's get_state (frombuffer's is not)
        return torch.frombuffer(bytearray(self._state_bytes()), dtype=torch.uint8).clone()

    def set_state(self, new_state: torch.Tensor) -> Generator:
        """Restore a state returned by :meth:`get_state` (of any ember generator)."""
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8:
            raise TypeError("set_state: expected a uint8 tensor from ember's get_state()")
        self._load_state_bytes(tensor_bytes(new_state))
        return self

    def graphsafe_get_state(self):
        raise NotImplementedError("ember.csprng.Generator has no CUDA-graph state")

    def graphsafe_set_state(self, state):
        raise NotImplementedError("ember.csprng.Generator has no CUDA-graph state")

    def clone_state(self):
        raise NotImplementedError("use get_state()/set_state() to copy an ember.csprng state")

    # ------------------------------------------------------------------ substreams
    def fold_in(self, index: int) -> Generator:
        """An independent generator for ``index`` (a rank, worker or step): a pure function of
        this generator's key and ``index``; this generator is unchanged."""
        if isinstance(index, bool) or not hasattr(index, "__index__"):
            raise TypeError(f"fold_in: index must be an int, got {type(index).__name__} {index!r}")
        return self._child("fold_in", index.__index__())

    def spawn(self, n: int) -> list[Generator]:
        """``n`` new independent generators; each call returns different ones."""
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise TypeError(f"spawn: n must be an int, got {type(n).__name__} {n!r}")
        n = n.__index__()
        if n < 0:
            raise ValueError(f"spawn: n must be non-negative, got {n}")
        with self._lock:
            first, self._spawned = self._spawned, self._spawned + n
        return [self._child("spawn", first + i) for i in range(n)]

    def _child(self, label: str, index: int) -> Generator:
        if self._stream is None:
            raise NotImplementedError(
                "the torchcsprng-compatible generator has no substreams; use create_generator")
        child = Generator()
        child._set_stream("derived", derive_key(self._stream.key, label, index), 0, self.cipher,
                          from_os=self._from_os)
        child.allow_pickle = self.allow_pickle
        return child

    # ------------------------------------------------------------------ persistence
    def _state_bytes(self) -> bytes:
        # magic(4) version(1) kind(1) flags(1) cipher name length L(1) key(16) counter(17, LE:
        # 2**128 fits) padding(7) spawn count(8, LE) seed(16, LE), then the cipher name (L ASCII
        # bytes; L = 0 for the mt19937 kind, which appends its source state instead). The name,
        # not a code, so that registering another cipher cannot change what a saved state means.
        flags = (self.allow_pickle << 0) | (self._from_os << 1) | ((self._seed is not None) << 2)
        head = bytearray(_HEADER)
        head[0:4] = _MAGIC
        head[4] = _VERSION
        head[5] = KINDS.index(self._kind)
        head[6] = flags
        name = self.cipher.encode("ascii") if self._stream is not None else b""
        head[7] = len(name)
        if self._stream is not None:
            head[8:24] = self._stream.key
            head[24:41] = self._stream.counter.to_bytes(17, "little")
        head[48:56] = self._spawned.to_bytes(8, "little")
        if self._seed is not None:
            head[56:72] = (self._seed % (1 << 128)).to_bytes(16, "little")
        tail = self._sampler.state_bytes() if self._stream is None else name
        return bytes(head) + tail

    def _load_state_bytes(self, data: bytes) -> None:
        if len(data) < _HEADER or data[0:4] != _MAGIC:
            raise ValueError("set_state: not an ember.csprng state (bad magic or length)")
        if data[4] not in (1, _VERSION):
            raise ValueError(f"set_state: unsupported state version {data[4]}")
        if data[5] >= len(KINDS):
            raise ValueError(f"set_state: unknown generator kind code {data[5]}")
        kind, flags = KINDS[data[5]], data[6]
        seed = int.from_bytes(data[56:72], "little") if flags & 4 else None
        if kind == "mt19937":
            from .compat import MT19937Sampler

            sampler = MT19937Sampler(seed)
            sampler.load_state_bytes(data[_HEADER:])
            self._set_compat(sampler)
        else:
            cipher = self._cipher_of_state(data)
            counter = int.from_bytes(data[24:41], "little")
            self._set_stream(kind, bytes(data[8:24]), counter, cipher,
                             from_os=bool(flags & 2), seed=seed)
        self.allow_pickle = bool(flags & 1)
        self._spawned = int.from_bytes(data[48:56], "little")

    @staticmethod
    def _cipher_of_state(data: bytes) -> str:
        if data[4] == 1:
            if len(data) != _HEADER:
                raise ValueError(f"set_state: expected {_HEADER} bytes, got {len(data)}")
            if data[7] >= len(_V1_CIPHERS):
                raise ValueError(f"set_state: unknown cipher code {data[7]}")
            return _V1_CIPHERS[data[7]]
        if len(data) != _HEADER + data[7] or data[7] == 0:
            raise ValueError(f"set_state: expected {_HEADER} bytes and the cipher name, got "
                             f"{len(data)} bytes")
        name = bytes(data[_HEADER:]).decode("ascii", "replace")
        if name not in cipher_names():
            raise ValueError(f"set_state: the state's cipher {name!r} is not registered; "
                             f"expected one of {cipher_names()}")
        return name

    def __reduce_ex__(self, protocol: SupportsIndex):
        if self._from_os and not self.allow_pickle:
            raise pickle.PicklingError(
                "refusing to pickle/copy an OS-keyed ember.csprng.Generator: a copy would repeat "
                "its secret stream. Set g.allow_pickle = True if that is really intended."
            )
        return (_from_state_bytes, (self._state_bytes(),))

    def __repr__(self) -> str:
        return (f"ember.csprng.Generator(kind={self._kind!r}, cipher={self.cipher!r}, "
                f"counter={self.counter})")


def _from_state_bytes(data: bytes) -> Generator:
    g = Generator()
    g._load_state_bytes(data)
    return g


def check_seed(seed: Any, what: str) -> int:
    """``seed`` as a non-negative int under torch's rules for ``manual_seed`` (see there)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        if _is_numpy_integer(seed):
            raise TypeError(f"{what}: an integer is required (got {type(seed).__name__}); "
                            "pass int(seed)")
        raise SeedError(f"{what} expected a long, but got {type(seed).__name__}")
    if seed < 0:
        if seed < -(1 << 63):
            raise ValueError(f"{what}: seed {seed} is below -2**63 (torch's range)")
        return seed + (1 << 64)  # torch reads a negative seed as its two's complement
    if seed >= 1 << 128:
        raise ValueError(f"{what}: seed {seed} does not fit in 128 bits")
    return seed


def _is_numpy_integer(x: Any) -> bool:
    np = __import__("sys").modules.get("numpy")
    return np is not None and isinstance(x, np.integer)


class SeedError(RuntimeError, TypeError):
    """A seed that is not an int (torch raises RuntimeError; it is also a TypeError)."""


# Generators re-seeded by seed(): a forked child re-seeds each from the OS.
_RESEED_AFTER_FORK: weakref.WeakSet = weakref.WeakSet()


def _reseed_in_child() -> None:
    for g in list(_RESEED_AFTER_FORK):
        g._lock = threading.Lock()
        g._reseed_from_os()


if hasattr(os, "register_at_fork"):  # POSIX only; Windows has no fork
    os.register_at_fork(after_in_child=_reseed_in_child)


# ---------------------------------------------------------------------- constructors
def create_random_device_generator(token: str | None = None, *, cipher: str = "aes128",
                                   allow_pickle: bool = False) -> Generator:
    """A generator keyed from the operating system's CSPRNG (``os.urandom``).

    ``token`` is accepted for torchcsprng compatibility and ignored (the OS source is always used).
    The stream is not reproducible; a forked child process gets a fresh key.
    """
    if token is not None and not isinstance(token, str):
        raise TypeError(f"token must be a str or None, got {type(token).__name__}")
    g = Generator()
    g._configure_os(cipher)
    g.allow_pickle = bool(allow_pickle)
    return g


def create_generator(seed: int | None = None, *, key: bytes | torch.Tensor | None = None,
                     cipher: str = "aes128") -> Generator:
    """A reproducible generator: its key is derived from ``seed`` (documented KDF) or given.

    With neither ``seed`` nor ``key``, a fresh 128-bit seed is taken from the OS and is available
    from :meth:`Generator.initial_seed`, so the run can be repeated.
    """
    if seed is not None and key is not None:
        raise ValueError("create_generator: give seed or key, not both")
    g = Generator()
    if key is not None:
        if isinstance(key, torch.Tensor):
            key = tensor_bytes(key)
        g._set_stream("keyed", check_key(key), 0, cipher)
    else:
        seed = (int.from_bytes(os.urandom(16), "little") if seed is None
                else check_seed(seed, "create_generator"))
        g._set_stream("seeded", key_from_seed(seed), 0, cipher, seed=seed)
    return g


def create_mt19937_generator(seed: int | None = None) -> Generator:
    """A generator reproducing torchcsprng's ``create_mt19937_generator(seed)`` streams.

    For re-running experiments seeded with torchcsprng; its key schedule follows torchcsprng (a
    Mersenne Twister seeds a fresh AES key per call), so prefer :func:`create_generator`.
    """
    from .compat import MT19937Sampler

    g = Generator()
    g._set_compat(MT19937Sampler(seed))
    return g


def for_torch(g: Generator) -> torch.Generator:
    """``g`` as type checkers should see it where torch's stubs ask for a ``torch.Generator``:
    the routed functions take an ember generator in its place."""
    return cast(torch.Generator, g)


def is_generator(obj: Any) -> bool:
    """Whether ``obj`` is an ember generator (they are not ``torch.Generator`` instances)."""
    return isinstance(obj, Generator)


def supports_cuda() -> bool:
    """Whether ember.csprng can fill CUDA tensors here (a CUDA device is present)."""
    return torch.cuda.is_available()
