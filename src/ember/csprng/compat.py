"""torchcsprng-compatible value streams: the sampler behind ``create_mt19937_generator``.

:class:`MT19937Sampler` reproduces the values torchcsprng's ``create_mt19937_generator(seed)``
produced (layout in ``shared/specs/torchcsprng-stream.md``): a 32-bit Mersenne Twister supplies four
words per call that form a fresh AES-128 key, and the call's values are cut from the encryptions of
the counter blocks ``LE64(idx) || 8 zero bytes``, ``idx = 0, 1, ...``.

Exactness: every integer op, ``random_``, ``uniform_`` and ``randperm_`` match torchcsprng bit for bit.
The transcendental transforms (normal, log-normal, exponential, Cauchy, geometric) call the C
library's ``log``/``log1p``/``exp``/``cos``/``tan`` element by element through Python's ``math``
module, as torchcsprng's C++ kernels did, so float64 outputs match too (NumPy's vectorized versions
differ by an ulp in some elements). This is not a speed path.

This stream is for re-running old experiments only: its integer ranges are biased (``v % range``)
and its key comes from a non-cryptographic generator. Use ``ember.csprng.create_generator``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from . import spec
from .stream import renew_lock_after_fork
from .views import array_view

__all__ = ["MT19937Sampler", "STATE_BYTES"]

_MT_WORDS = 624
STATE_BYTES = _MT_WORDS * 4 + 4  # 624 little-endian uint32 words, then the position as uint32
_DEFAULT_SEED = 5489
_CHUNK_BLOCKS = 1 << 15  # counter blocks encrypted and transformed at a time (512 KiB)
_U53 = (1 << 53) - 1

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_NUMPY = {
    torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
    torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16,
    torch.float32: np.float32, torch.float64: np.float64,
}
_WORD: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

# random_() with no range: (word bytes, modulus) per dtype; bool keeps the low bit
_FULL_RANGE = {
    torch.bool: (4, 2), torch.uint8: (4, 1 << 8), torch.int8: (4, 1 << 7),
    torch.int16: (4, 1 << 15), torch.int32: (4, 1 << 31), torch.int64: (8, 1 << 63),
    torch.float32: (4, (1 << 24) + 1), torch.float64: (8, (1 << 53) + 1),
    torch.float16: (2, 2049), torch.bfloat16: (2, 257),
}
_WIDE_RANGE_DTYPES = (torch.int64, torch.float64, torch.float32, torch.bfloat16)
# geometric_: (word bytes, mantissa bits) per dtype; all but float64 compute in float32
_GEOMETRIC = {torch.float64: (8, 53), torch.float32: (4, 24), torch.float16: (2, 11),
              torch.bfloat16: (2, 8)}

_Values = Callable[[np.ndarray], np.ndarray]


def _check_dtype(op: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> None:
    if dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{op}: dtype {dtype} is not supported by the torchcsprng-compatible "
                        f"stream; expected one of {names}")


def _check_out(op: str, out: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"{op}: out must be a contiguous CPU tensor, got device {out.device}, "
                         f"contiguous={out.is_contiguous()}")


def _libm(fn: Callable[[float], float], x: np.ndarray) -> np.ndarray:
    """``fn`` (a ``math`` function, i.e. the C library's) applied to every element of ``x``."""
    return np.fromiter(map(fn, x.tolist()), dtype=np.float64, count=x.size)


def _u53(v: np.ndarray) -> np.ndarray:
    return (v & np.uint64(_U53)).astype(np.float64) * 2.0**-53


def _store(out: torch.Tensor, lo: int, hi: int, values: np.ndarray) -> None:
    """Write ``values`` (int64, float64 or float32) to elements ``lo..hi`` of ``out``, converting
    as C++ ``static_cast`` does (half and bfloat16 from a double go through float)."""
    dtype = out.dtype
    flat = out.view(-1)
    if dtype in (torch.float16, torch.bfloat16) and values.dtype != np.float32:
        with np.errstate(over="ignore"):  # past float's range: inf, as C++'s cast gives
            values = values.astype(np.float32)
    if dtype == torch.bfloat16:
        flat[lo:hi].copy_(torch.from_numpy(values))
        return
    dst = array_view(flat)
    if dtype == torch.bool:
        np.not_equal(values, 0, out=dst[lo:hi])
    else:
        with np.errstate(over="ignore"):  # past the dtype's range: inf, as C++'s cast gives
            dst[lo:hi] = values.astype(_NUMPY[dtype], copy=False)


class MT19937Sampler:
    """Values of torchcsprng's ``create_mt19937_generator(seed)`` for contiguous CPU tensors.

    ``seed`` is reduced to 32 bits (``seed & 0xffffffff``); ``None`` means std::mt19937's default
    seed 5489. Every method fills ``out`` in row-major order and returns None. Each AES-based call
    consumes exactly four 32-bit Mersenne Twister outputs (the call's key), even for an empty
    tensor; ``randperm_`` consumes ``n - 1`` outputs and no key.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.initial_seed: int = _DEFAULT_SEED if seed is None else int(seed)
        self._mt = np.random.MT19937()
        self._mt._legacy_seeding(self.initial_seed & 0xFFFFFFFF)  # std::mt19937(seed) seeding
        self._lock = threading.Lock()
        renew_lock_after_fork(self)

    def __repr__(self) -> str:
        return f"MT19937Sampler(initial_seed={self.initial_seed})"

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> bytes:
        """The Mersenne Twister state: 624 little-endian uint32 words, then the uint32 position
        (0..624) of the next word to use; 2500 bytes."""
        with self._lock:
            st = self._mt.state["state"]
            key = np.asarray(st["key"], dtype="<u4")
            pos = int(st["pos"])
        return key.tobytes() + pos.to_bytes(4, "little")

    def load_state_bytes(self, b: bytes) -> None:
        """Restore a state produced by :meth:`state_bytes`."""
        b = bytes(b)
        if len(b) != STATE_BYTES:
            raise ValueError(f"load_state_bytes: expected {STATE_BYTES} bytes, got {len(b)}")
        key = np.frombuffer(b[:-4], dtype="<u4").astype(np.uint32)
        pos = int.from_bytes(b[-4:], "little")
        if pos > _MT_WORDS:
            raise ValueError(f"load_state_bytes: position must be in 0..{_MT_WORDS}, got {pos}")
        with self._lock:
            self._mt.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}

    # ------------------------------------------------------------------ sources
    def _raw(self, n: int) -> np.ndarray:
        """``n`` raw 32-bit outputs (as uint64); the caller holds the lock."""
        return self._mt.random_raw(n) if n else np.empty(0, np.uint64)

    def _new_key(self) -> bytes:
        with self._lock:
            return self._raw(4).astype("<u4").tobytes()

    def _fill(self, out: torch.Tensor, word_bytes: int, words_per_value: int,
              values: _Values) -> None:
        """Draw a key, then write ``values(words)`` for every element of ``out``.

        ``values`` gets the words of consecutive elements (shape ``(k,)`` or ``(k, N)``).
        """
        key = self._new_key()
        n = out.numel()
        per_block = 16 // (word_bytes * words_per_value)
        for lo, hi, words in _keystream_words(key, n, per_block, word_bytes):
            if words_per_value > 1:
                words = words.reshape(-1, 16 // word_bytes)[:, :words_per_value * per_block]
                words = words.reshape(-1, words_per_value)
            _store(out, lo, hi, values(words[: hi - lo]))

    # ------------------------------------------------------------------ integers
    def random_(self, out: torch.Tensor) -> None:
        """``random_()`` with no range: ``v % (max + 1)`` per dtype (float: ``2**digits + 1``)."""
        _check_out("random_", out)
        _check_dtype("random_", out.dtype, tuple(_FULL_RANGE))
        word_bytes, modulus = _FULL_RANGE[out.dtype]
        if out.dtype == torch.bool:
            self._fill(out, 4, 1, lambda w: (w & 1).astype(np.int64))
        else:
            m = np.uint64(modulus)
            self._fill(out, word_bytes, 1, lambda w: (w.astype(np.uint64) % m).astype(np.int64))

    def random_range_(self, out: torch.Tensor, low: int, high: int) -> None:
        """``random_(low, high)`` / ``randint``: ``(w % (high - low)) + low`` (biased)."""
        _check_out("random_", out)
        _check_dtype("random_", out.dtype, (torch.bool,) + _INTS + _FLOATS)
        low, high = int(low), int(high)
        span = high - low
        if not 0 < span <= 1 << 64:
            raise ValueError(f"random_: expected from < to with to - from <= 2**64, "
                             f"got from={low}, to={high}")
        wide_dtype = out.dtype in _WIDE_RANGE_DTYPES
        base = np.uint64(low % (1 << 64))
        if span == 1 << 64:
            # torchcsprng's full 64-bit range kernel: the whole word reinterpreted as int64
            # (from = -2**63 is implied, not added)
            if not wide_dtype:
                raise ValueError(f"random_: a range of 2**64 needs int64, float64, float32 or "
                                 f"bfloat16, got {out.dtype}")
            self._fill(out, 8, 1, lambda w: w.astype(np.uint64).view(np.int64))
            return
        word_bytes = 8 if wide_dtype else 4
        r = np.uint64(span)
        whole = word_bytes == 8 and span >= 1 << 32

        def values(w: np.ndarray) -> np.ndarray:
            w = w.astype(np.uint64)
            if word_bytes == 8 and not whole:
                w &= np.uint64(0xFFFFFFFF)
            return (w % r + base).view(np.int64)

        self._fill(out, word_bytes, 1, values)

    # ------------------------------------------------------------------ real-valued
    def uniform_(self, out: torch.Tensor, a: float = 0.0, b: float = 1.0) -> None:
        """``u53(v) * (b - a) + a`` in double, then cast."""
        _check_out("uniform_", out)
        _check_dtype("uniform_", out.dtype, _FLOATS)
        a, b = float(a), float(b)
        width = b - a
        self._fill(out, 8, 1, lambda w: _u53(w) * width + a)

    def _normal(self, op: str, out: torch.Tensor, mean: float, std: float, log: bool) -> None:
        _check_out(op, out)
        _check_dtype(op, out.dtype, _FLOATS)
        mean, std = float(mean), float(std)

        def values(w: np.ndarray) -> np.ndarray:
            u1, u2 = _u53(w[:, 0]), _u53(w[:, 1])
            z = np.sqrt(-2.0 * _libm(math.log1p, -u2)) * _libm(math.cos, (2.0 * math.pi) * u1)
            z = z * std + mean
            return _libm(math.exp, z) if log else z

        self._fill(out, 8, 2, values)

    def normal_(self, out: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> None:
        """Box-Muller, one value per block: ``sqrt(-2 log1p(-u2)) cos(2 pi u1) * std + mean``."""
        self._normal("normal_", out, mean, std, log=False)

    def log_normal_(self, out: torch.Tensor, mean: float = 1.0, std: float = 2.0) -> None:
        """``exp`` of the ``normal_(mean, std)`` value."""
        self._normal("log_normal_", out, mean, std, log=True)

    def exponential_(self, out: torch.Tensor, lambd: float = 1.0) -> None:
        """``-1/lambd * log1p(-u53(v))``."""
        _check_out("exponential_", out)
        _check_dtype("exponential_", out.dtype, _FLOATS)
        scale = -1.0 / float(lambd)
        self._fill(out, 8, 1, lambda w: scale * _libm(math.log1p, -_u53(w)))

    def cauchy_(self, out: torch.Tensor, median: float = 0.0, sigma: float = 1.0) -> None:
        """``median + sigma * tan(pi * (u53(v) - 0.5))``."""
        _check_out("cauchy_", out)
        _check_dtype("cauchy_", out.dtype, _FLOATS)
        median, sigma = float(median), float(sigma)
        self._fill(out, 8, 1,
                   lambda w: median + sigma * _libm(math.tan, math.pi * (_u53(w) - 0.5)))

    def geometric_(self, out: torch.Tensor, p: float) -> None:
        """``ceil(log(x) / log1p(-p))`` with ``x`` the dtype's mantissa bits of a word as a
        fraction in [0, 1); float64 in double, the other dtypes in float."""
        _check_out("geometric_", out)
        _check_dtype("geometric_", out.dtype, _FLOATS)
        word_bytes, bits = _GEOMETRIC[out.dtype]
        p = float(p)
        mask = np.uint64((1 << bits) - 1)
        if out.dtype == torch.float64:
            denom = math.log1p(-p)

            def values(w: np.ndarray) -> np.ndarray:
                u = _u53(w)
                lg = np.full(u.shape, -np.inf)  # log(0) = -inf, as in C
                nz = u > 0
                lg[nz] = _libm(math.log, u[nz])
                return np.ceil(lg / denom)
        else:
            # float math: p and log1p(-p) rounded to float; log computed in double and rounded,
            # which is the correctly rounded float log
            pf = float(np.float32(p))
            denom32 = np.float32(math.log1p(-pf))
            scale = np.float32(2.0**-bits)

            def values(w: np.ndarray) -> np.ndarray:
                x = (w.astype(np.uint64) & mask).astype(np.float32) * scale
                with np.errstate(divide="ignore"):
                    lg = np.log(x.astype(np.float64)).astype(np.float32)
                return np.ceil(lg / denom32)

        self._fill(out, word_bytes, 1, values)

    # ------------------------------------------------------------------ permutations
    def randperm_(self, out: torch.Tensor) -> None:
        """Fisher-Yates from index 0: swap ``i`` and ``i + r() % (n - i)`` for ``i < n - 1``."""
        _check_out("randperm", out)
        _check_dtype("randperm", out.dtype, _INTS + _FLOATS)
        n = out.numel()
        with self._lock:
            draws = self._raw(max(n - 1, 0))
        if n == 0:
            return
        steps = (draws % np.arange(n, 1, -1, dtype=np.uint64)).tolist()
        perm = list(range(n))
        for i, z in enumerate(steps):
            j = i + z
            perm[i], perm[j] = perm[j], perm[i]
        out.view(-1).copy_(torch.tensor(perm, dtype=torch.int64))


def _refusal(op: str) -> Callable[..., None]:
    def missing(self: MT19937Sampler, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(_missing(op))

    missing.__name__ = op
    return missing


for _d in spec.DISTRIBUTIONS:  # the distributions torchcsprng did not have (bernoulli_, poisson, ...)
    if not _d.compat:
        setattr(MT19937Sampler, _d.method, _refusal(_d.method))


def _missing(op: str) -> str:
    return (f"torchcsprng did not implement {op}, so the torchcsprng-compatible generator "
            "(create_mt19937_generator) has no stream to reproduce; use "
            "ember.csprng.create_generator(seed) for a reproducible secure generator")


def _keystream_words(key: bytes, n: int, per_block: int, word_bytes: int
                     ) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield ``(lo, hi, words)`` covering elements ``0..n``: the little-endian words of the
    blocks ``AES-ECB_key(LE64(idx) || 0^64)`` that feed elements ``lo..hi``."""
    if n == 0:
        return
    enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    nblocks = -(-n // per_block)
    for first in range(0, nblocks, _CHUNK_BLOCKS):
        count = min(_CHUNK_BLOCKS, nblocks - first)
        counters = np.zeros((count, 2), dtype="<u8")
        counters[:, 0] = np.arange(first, first + count, dtype=np.uint64)
        blocks = enc.update(counters.tobytes())
        lo = first * per_block
        yield lo, min(n, lo + count * per_block), np.frombuffer(blocks, dtype=_WORD[word_bytes])
