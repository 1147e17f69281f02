"""Keystream words -> values: the native ember distributions on CPU.

A :class:`NativeSampler` turns blocks of a :class:`~ember.csprng.stream.BlockStream` into values
for a contiguous CPU tensor, in row-major element order. Which bytes feed which element is fixed by
docs/csprng-stream.md (the contract the CUDA kernels reproduce); the arithmetic is done with NumPy on
chunks small enough to stay in cache. Every method reserves a block count that depends only on the
sizes and dtypes involved, never on the values drawn.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np
import torch

from . import shuffle, small, spec, transforms
from .ciphers import BLOCK_BYTES
from .stream import BlockStream, Draw
from .views import array_view, flat_view

CHUNK_BYTES = 1 << 20  # keystream bytes generated and transformed at a time
_TWO_PI = 2.0 * math.pi

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_REAL_DTYPES = (torch.bool,) + _INT_DTYPES + FLOAT_DTYPES  # what random_ and bernoulli_ fill
_WORD64 = (torch.int64, getattr(torch, "uint64", torch.int64))  # written as raw 64-bit words
# torch fills these only with ranged integers (randint, random_(from, to))
_UINT_DTYPES = tuple(getattr(torch, f"uint{b}") for b in (16, 32, 64) if hasattr(torch, f"uint{b}"))
_MANTISSA_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def _overflow_to_inf() -> np.errstate:
    """Values past a dtype's range become inf (and inf - inf NaN), as torch's kernels make them,
    without NumPy's overflow and invalid-value warnings (helper threads do not inherit the
    caller's state: each enters its own)."""
    return np.errstate(over="ignore", invalid="ignore")


_NO_OVERFLOW = contextlib.nullcontext()
# the largest finite value of each float dtype
_FINITE_MAX = {d: torch.finfo(d).max for d in (torch.float16, torch.bfloat16, torch.float32,
                                               torch.float64)}
_HALF_MAX = {d: m / 2 for d, m in _FINITE_MAX.items()}
# the same for each float dtype's compute dtype (float32 for the narrower ones)
_COMPUTE_HALF_MAX = {d: _HALF_MAX[torch.float64 if d == torch.float64 else torch.float32]
                     for d in _HALF_MAX}
# bounds of |z| for a standard normal and of |tan(pi (u - 1/2))| for a Cauchy value, over every
# keystream word (float64's 53-bit grids; float32's are smaller)
_NORMAL_BOUND = 9.0
_TAN_BOUND = 6e15


def _overflow_if(dtype: torch.dtype, bound: float) -> contextlib.AbstractContextManager:
    """:func:`_overflow_to_inf` where a value as large as ``bound`` would pass the range of
    ``dtype``; else nothing to enter (NumPy's error state costs microseconds per call)."""
    if not bound < _HALF_MAX.get(dtype, 0.0):
        return _overflow_to_inf()
    return _NO_OVERFLOW


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of :func:`_compute`'s compute dtype for a float ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_float32(x: float) -> float:
    """``x`` rounded to float32 (inf past its range), without NumPy's overflow warning."""
    return torch.tensor(x, dtype=torch.float32).item()


def _affine_exact(out: torch.Tensor, z: torch.Tensor, loc: float, scale: float,
                  log: bool = False) -> None:
    """Write ``loc + scale * z`` (its exp if ``log``) into ``out`` as torch's kernels give it past
    the compute dtype's range: in float64, rounded once to out's dtype, and an infinite ``loc``
    with a finite ``scale`` gives ``loc`` itself (torch's fused multiply-add has no overflowing
    product to meet it as inf - inf). NaN only where torch gives NaN (inf - inf, 0 * inf)."""
    if math.isinf(loc) and math.isfinite(scale):
        wide = torch.full(z.shape, loc, dtype=torch.float64)
    else:
        wide = z.double().mul_(scale).add_(loc)
    if log:
        wide.exp_()
    out.copy_(wide)


def blocks_for(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES)


def _check_dtype(op: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> None:
    if dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{op}: dtype {dtype} is not supported; expected one of {names}")


def _compute(dtype: torch.dtype) -> tuple[type, type, int]:
    """(word dtype, compute dtype, bits) for transcendental transforms of ``dtype``."""
    if dtype == torch.float64:
        return np.uint64, np.float64, 53
    return np.uint32, np.float32, 24


def _flat_np(out: torch.Tensor) -> np.ndarray | None:
    """A NumPy view of ``out`` when NumPy has its dtype (every dtype but bfloat16)."""
    if out.dtype == torch.bfloat16:
        return None
    return flat_view(out)


def _step(chunk_bytes: int, wbytes: int, granule: int) -> int:
    """Items per chunk: as many as fit in ``chunk_bytes``, a positive multiple of ``granule``."""
    return max(chunk_bytes // wbytes // granule, 1) * granule


def _chunks(draw: Draw, lo: int, hi: int, words_per_item: int, word_dtype: type,
            chunk_bytes: int | None = None, into: np.ndarray | None = None, granule: int = 1):
    """Yield ``(a, b, words)``: the keystream words of items ``a..b``, for items ``lo..hi`` in order.

    ``draw`` must be positioned at item ``lo``. With ``into`` (``(hi - lo) * words_per_item`` words
    of the output's own memory) the keystream is written there, and ``words`` are views of it.
    Every chunk but the last holds a multiple of ``granule`` items.
    """
    if chunk_bytes is None:  # looked up per call, so that tests can shrink the chunks
        chunk_bytes = CHUNK_BYTES
    step = _step(chunk_bytes, _ITEMSIZE[word_dtype] * words_per_item, granule)
    buf = _words(min(hi - lo, step) * words_per_item, word_dtype) if into is None else None
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        if buf is not None:
            w = buf[: (b - a) * words_per_item]
        else:  # buf is None exactly when into is given
            w = cast(np.ndarray, into)[(a - lo) * words_per_item: (b - lo) * words_per_item]
        draw.fill(_bytes(w))
        yield a, b, w


_SIGNED = {np.dtype(f"{order}u{size}"): np.dtype(f"{order}i{size}")
           for order in "<>=" for size in (1, 2, 4, 8)}
_ITEMSIZE: dict[type, int] = {np.uint16: 2, np.uint32: 4, np.uint64: 8}


def _signed(w: np.ndarray) -> np.ndarray:
    """``w`` viewed as signed integers: NumPy converts those to floats faster than unsigned ones
    (the same values, since every caller has masked the words below the sign bit)."""
    return w.view(_SIGNED[w.dtype])


_scratch = threading.local()


def _tmp(slot: str, n: int, dtype) -> np.ndarray:
    """A scratch array of ``n`` items, kept per thread and reused by later draws.

    Allocating and freeing a few MiB on every draw makes glibc hand the memory back to the
    system and fault it in again, which can cost as much as the keystream. Each slot is used by
    one step of one draw at a time (draws do not nest on a thread).
    """
    try:
        pool = _scratch.pool
    except AttributeError:
        pool = _scratch.pool = {}
    buf = pool.get(slot)
    nbytes = n * np.dtype(dtype).itemsize
    if buf is None or buf.size < nbytes:
        buf = pool[slot] = np.empty(max(nbytes, CHUNK_BYTES), np.uint8)
    return buf[:nbytes].view(dtype)


def _words(n: int, word_dtype: type) -> np.ndarray:
    """``n`` little-endian scratch words."""
    return _tmp("words", n, np.dtype(word_dtype).newbyteorder("<"))


def _bytes(w: np.ndarray) -> memoryview:
    """The bytes of a contiguous word array, for ``Draw.fill`` (which completes a partial last
    block itself)."""
    return w.view(np.uint8).data


# Draws of at least this much keystream are split across threads (OpenSSL and NumPy release the
# GIL). Below it there is a single chunk: waking a thread and collecting its result costs about
# 50 us on small VMs, and 1 MiB draws gained nothing measurable; 4 and 16 MiB draws were up to
# 1.8x faster on two threads than on one (randn most, randint least; 2-vCPU VM).
PARALLEL_BYTES = 2 << 20
# Threads work on 1 MiB chunks: smaller ones (256 KiB) lost a third of the speed to GIL hand-offs.
PARALLEL_CHUNK_BYTES = 1 << 20
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one (Linux), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def _threads(nbytes: int) -> int:
    """Threads for a draw of ``nbytes`` of keystream: one below PARALLEL_BYTES, and never more
    than ``torch.get_num_threads()`` (the user's knob) or the CPUs the process may use, so that a
    process pinned to one core, or told to use one thread, runs every draw on the calling thread."""
    if nbytes < PARALLEL_BYTES:
        return 1
    return max(1, min(torch.get_num_threads(), _usable_cpus(), 8))


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid() or _pool._max_workers < workers:
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ember-csprng")
        _pool_pid = os.getpid()  # a forked child has no pool threads: make a new pool there
    return _pool


def _drive(draw: Draw, n: int, words_per_item: int, word_dtype: type, body,
           into: np.ndarray | None = None, granule: int = 1) -> None:
    """Call ``body(a, b, words)`` over all ``n`` items, on several threads for large draws.

    Every chunk's keystream starts at that chunk's own first block, so the values do not depend
    on which thread handles which chunk, nor on how many threads there are. ``into``, when given,
    is the output's own memory as ``n * words_per_item`` words: the keystream goes there and the
    body transforms it in place, which saves a pass over the data. Every chunk but the last holds
    a multiple of ``granule`` items (normal_ pairs come in groups).
    """
    wbytes = _ITEMSIZE[word_dtype] * words_per_item
    nbytes = n * wbytes
    if nbytes <= CHUNK_BYTES:  # one chunk: the common small call, kept short
        w = _words(n * words_per_item, word_dtype) if into is None else into
        draw.fill(_bytes(w))
        body(0, n, w)
        return
    workers = _threads(nbytes)
    if workers == 1:
        for a, b, w in _chunks(draw, 0, n, words_per_item, word_dtype, into=into, granule=granule):
            body(a, b, w)
        return
    _share_chunks(draw, n, words_per_item, word_dtype, body, PARALLEL_CHUNK_BYTES, workers, into, granule)


def _share_chunks(draw: Draw, n: int, words_per_item: int, word_dtype: type, body,
                  chunk_bytes: int, workers: int, into: np.ndarray | None = None,
                  granule: int = 1) -> None:
    """Run ``body`` over the chunks of a draw on the calling thread and ``workers - 1`` helpers.

    Every thread takes the next unclaimed chunk until none is left, each chunk with a keystream
    writer at its own first block. The calling thread starts at once and waits only for chunks
    already claimed: a helper that wakes up late (waking a pool thread takes tens of microseconds
    on small VMs) finds the work done and just returns.
    """
    wbytes = _ITEMSIZE[word_dtype] * words_per_item
    step = _step(chunk_bytes, wbytes, granule)
    nchunks = -(-n // step)
    lock = threading.Lock()
    claims = [0, 0]  # next chunk to hand out, chunks handed to helpers (both under `lock`)
    finished = threading.Semaphore(0)  # released once per chunk a helper has finished
    errors: list[BaseException] = []

    def claim(helper: bool) -> int:
        with lock:
            i = claims[0]
            claims[0] += 1
            if helper and i < nchunks:
                claims[1] += 1
            return i

    def run(helper: bool) -> None:
        with _overflow_to_inf():
            work(helper)

    def work(helper: bool) -> None:
        buf = _words(step * words_per_item, word_dtype) if into is None else None
        while not errors:
            i = claim(helper)
            if i >= nchunks:
                return
            try:
                a = i * step
                b = min(a + step, n)
                nb = (b - a) * wbytes
                if buf is not None:
                    w = buf[: (b - a) * words_per_item]
                else:  # buf is None exactly when into is given
                    w = cast(np.ndarray, into)[a * words_per_item: b * words_per_item]
                draw.part(a * wbytes // BLOCK_BYTES, blocks_for(nb)).fill(_bytes(w))
                body(a, b, w)
            except BaseException as exc:  # re-raised on the calling thread
                errors.append(exc)
            finally:
                if helper:
                    finished.release()

    pool = _executor(workers - 1)
    for _ in range(workers - 1):
        pool.submit(run, True)
    run(False)
    with lock:  # every chunk is claimed now (or an error stopped the claims)
        claims[0] = nchunks
        pending = claims[1]
    for _ in range(pending):
        finished.acquire()
    if errors:
        raise errors[0]


# normal_ pairs come in groups of NORMAL_GROUP: a group of q pairs has its q radius words, then its
# q angle words, and gives q cosines, then q sines (docs/csprng-stream.md). Contiguous halves keep
# the NumPy steps on unit strides; interleaved pairs cost a third of a float32 randn in strided
# copies.
NORMAL_GROUP = 16384


class _Sink:
    """Writes float/int/bool chunks into ``out`` (directly when NumPy has its dtype)."""

    def __init__(self, out: torch.Tensor) -> None:
        self.np = _flat_np(out)
        self.out = out.view(-1) if self.np is None else out  # torch view only for bfloat16

    def write(self, lo: int, hi: int, values: np.ndarray) -> None:
        if self.np is not None:
            np.copyto(self.np[lo:hi], values, casting="unsafe")
        else:
            self.out[lo:hi].copy_(torch.from_numpy(values))

    def words(self, word: type, cd: type) -> np.ndarray | None:
        """The output's memory as ``word``s when the values are computed in its own dtype ``cd``
        with one word of the same width each (float32, float64): the keystream can then be
        written into the output and transformed in place."""
        if self.np is not None and self.np.dtype == cd:
            return self.np.view(word)
        return None

    def direct(self, lo: int, hi: int, dtype: type) -> np.ndarray | None:
        """The output slice itself when it has exactly ``dtype`` (so transforms can write in place)."""
        if self.np is not None and self.np.dtype == dtype:
            return self.np[lo:hi]
        return None


class NativeSampler:
    """The native ember distributions over a :class:`BlockStream`."""

    def __init__(self, stream: BlockStream) -> None:
        self.stream = stream

    def _draw(self, nbytes: int) -> Draw:
        return self.stream.draw(blocks_for(nbytes))

    # ------------------------------------------------------------------ uniform floats
    def uniform_(self, out: torch.Tensor, a: float = 0.0, b: float = 1.0) -> None:
        _check_dtype("uniform_", out.dtype, FLOAT_DTYPES)
        a, b = float(a), float(b)
        if not (math.isfinite(a) and math.isfinite(b)):
            raise ValueError(f"uniform_: from and to must be finite, got from={a}, to={b}")
        if a > b:
            raise ValueError(f"uniform_: expected from <= to, got from={a}, to={b}")
        if not math.isfinite(b - a):
            raise ValueError(f"uniform_: to - from must be finite, got {b - a}")
        n = out.numel()
        bits = _MANTISSA_BITS[out.dtype]
        if 0 < n <= small.SMALL_ITEMS:
            clamp = out.dtype == torch.float64 and a != b and not (a == 0.0 and b == 1.0)
            if small.uniform(self.stream, out, n, a, b, bits, _below(b, out.dtype) if clamp else b):
                return
        if out.dtype == torch.float64:
            word, cd = np.uint64, np.float64
        elif out.dtype == torch.float32:
            word, cd = np.uint32, np.float32
        else:  # 16-bit floats: one 16-bit word per value, exactly on the dtype's grid
            word, cd = np.uint16, np.float32
        draw = self._draw(n * _ITEMSIZE[word])
        if n == 0:
            return
        mask = word((1 << bits) - 1)
        scale = cd((b - a) * 2.0**-bits)
        shift = cd(a)
        sink = _Sink(out)
        into = sink.words(word, cd)

        one_pass = word is np.uint32 and cd is np.float32 and shift == 0

        def body(lo: int, hi: int, w: np.ndarray) -> None:
            dst = sink.direct(lo, hi, cd)
            tmp = dst if dst is not None else _tmp("uniform", hi - lo, cd)
            if one_pass:  # mask, exact conversion and scaling in one pass (the same values)
                transforms.unit_float32(w, bits, float(scale), tmp)
                if dst is None:
                    sink.write(lo, hi, tmp)
                return
            np.bitwise_and(w, mask, out=w)
            np.copyto(tmp, _signed(w), casting="unsafe")  # exact: k < 2**bits
            np.multiply(tmp, scale, out=tmp)
            if shift != 0:
                np.add(tmp, shift, out=tmp)
            if dst is None:
                sink.write(lo, hi, tmp)

        _drive(draw, n, 1, word, body, into=into)
        if not (a == 0.0 and b == 1.0):
            lo = _rounded(a, out.dtype)
            if lo == _rounded(b, out.dtype):  # a and b are one value of the dtype: torch gives a
                out.fill_(lo)
            else:
                out.clamp_(min=lo, max=_below(b, out.dtype))

    # ------------------------------------------------------------------ normal family
    def normal_(self, out: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> None:
        if out.dtype not in FLOAT_DTYPES:
            _check_dtype("normal_", out.dtype, FLOAT_DTYPES)
        mean, std = float(mean), float(std)
        if not std >= 0.0:  # the record's rule, with its message
            spec.check_params("normal_", (mean, std))
        if mean == 0.0 and std == 1.0:  # randn: within every dtype's range
            self._normal(out, mean, std, log=False)
            return
        bound = abs(mean) + _NORMAL_BOUND * std
        if bound < _HALF_MAX[out.dtype]:  # the common case
            self._normal(out, mean, std, log=False)
        elif bound < _COMPUTE_HALF_MAX[out.dtype]:  # values past out's range become inf
            with _overflow_to_inf():
                self._normal(out, mean, std, log=False)
        else:
            self._normal_past_range(out, mean, std, log=False)

    def log_normal_(self, out: torch.Tensor, mean: float = 1.0, std: float = 2.0) -> None:
        _check_dtype("log_normal_", out.dtype, FLOAT_DTYPES)
        mean, std = float(mean), float(std)
        if not std > 0.0:
            spec.check_params("log_normal_", (mean, std))
        top = mean + _NORMAL_BOUND * std  # the largest log of a value
        if abs(mean) + _NORMAL_BOUND * std >= _COMPUTE_HALF_MAX[out.dtype]:
            self._normal_past_range(out, mean, std, log=True)
            return
        with _overflow_if(out.dtype, math.exp(top) if top < 700.0 else math.inf):
            self._normal(out, mean, std, log=True)

    def _normal_past_range(self, out: torch.Tensor, mean: float, std: float, log: bool) -> None:
        """normal_/log_normal_ whose arithmetic passes the compute dtype's range, with the kinds
        of values torch's CPU kernels give there (see :func:`_affine_exact`): its serial kernel
        (log_normal_, and normal_ of fewer than 16 values) takes the parameters as float64, its
        vectorised one (normal_ of 16 values or more) as float32 for the narrower dtypes. The
        keystream and the standard normal values are the common path's."""
        if out.dtype != torch.float64 and not log and out.numel() >= 16:
            mean, std = _as_float32(mean), _as_float32(std)
        z = torch.empty(out.shape, dtype=_compute_dtype(out.dtype))
        self._normal(z, 0.0, 1.0, log=False)
        _affine_exact(out, z, mean, std, log)

    def normal_foreach_(self, outs: list[torch.Tensor], mean: float = 0.0, std: float = 1.0) -> None:
        """``normal_(out, mean, std)`` for each contiguous CPU tensor of ``outs`` in order (the same
        values and stream position), with one keystream pass for all tensors of up to 1 MiB and
        one transform for all float32/float64 tensors of up to 32768 values (one group of pairs)."""
        for out in outs:
            _check_dtype("normal_", out.dtype, FLOAT_DTYPES)
        mean, std = float(mean), float(std)
        if not std >= 0.0:
            spec.check_params("normal_", (mean, std))
        sizes = []
        for out in outs:
            word = _compute(out.dtype)[0]
            sizes.append(blocks_for((out.numel() + 1) // 2 * 2 * _ITEMSIZE[word]))
        small_blocks = sum(nb for nb in sizes if nb * BLOCK_BYTES <= CHUNK_BYTES)
        start = self.stream.reserve(sum(sizes))
        buf = _tmp("foreach.keystream", small_blocks * BLOCK_BYTES, np.uint8)
        if small_blocks:
            # the small tensors' keystream, one cipher call per run of consecutive small tensors
            # (a large tensor between two small ones splits the run; it is filled on its own)
            view, at, pos, run = buf.data, 0, start, None
            for nb in [*sizes, None]:
                small_one = nb is not None and nb * BLOCK_BYTES <= CHUNK_BYTES
                if small_one and run is None:
                    run = (pos, at)
                if not small_one and run is not None:
                    if at > run[1]:
                        self.stream.keystream(run[0]).fill(view[run[1]: at])
                    run = None
                if nb is not None:
                    at += nb * BLOCK_BYTES if small_one else 0
                    pos += nb
        at, pos = 0, start
        batch: dict[torch.dtype, list[tuple[torch.Tensor, int]]] = {}
        for out, nb in zip(outs, sizes, strict=True):
            if nb * BLOCK_BYTES <= CHUNK_BYTES:
                if out.dtype in _BATCHED_NORMAL and 0 < out.numel() <= 2 * NORMAL_GROUP:
                    batch.setdefault(out.dtype, []).append((out, at))
                else:
                    self._normal(out, mean, std, False,
                                 _BufferDraw(buf.data[at: at + nb * BLOCK_BYTES]))
                at += nb * BLOCK_BYTES
            else:
                self._normal(out, mean, std, False, Draw(self.stream, pos, nb))
            pos += nb
        for dtype, items in batch.items():
            _normal_one_group_each(buf, items, dtype, mean, std)

    def _normal(self, out: torch.Tensor, mean: float, std: float, log: bool, draw=None) -> None:
        n = out.numel()
        if draw is None and 0 < n <= small.SMALL_ITEMS and not transforms.normal_compiled():
            small.normal(self.stream, out, n, mean, std, log)  # faster than NumPy's set-up
            return
        if draw is None and 0 < n <= 2 * min(small.MEDIUM_PAIRS, NORMAL_GROUP):  # one group
            small.normal_medium(self.stream, out, n, mean, std, log)
            return
        word, cd, bits = _compute(out.dtype)
        pairs = (n + 1) // 2
        if draw is None:
            draw = self._draw(pairs * 2 * _ITEMSIZE[word])
        if n == 0:
            return
        angle = float(cd(_TWO_PI * 2.0**-bits))
        wide = cd is np.float64
        affine = not (mean == 0.0 and std == 1.0)
        mean_c, std_c = cd(mean), cd(std)
        sink = _Sink(out)

        def body(plo: int, phi: int, w: np.ndarray) -> None:
            m = phi - plo  # plo is a multiple of NORMAL_GROUP: the chunk holds whole groups
            lo, hi = 2 * plo, min(2 * phi, n)
            r, th, c = (_tmp("normal." + name, m, cd) for name in "rtc")  # radius, angle, cos
            # radius from u1 = (k + 1) * 2**-bits in (0, 1]; angle from u2 = k * 2**-bits
            transforms.normal_inputs(w, m, NORMAL_GROUP, bits, angle, r, th, wide)
            np.log(r, out=r)
            np.cos(th, out=c)
            np.sin(th, out=th)
            dst = sink.direct(lo, hi, cd) if hi - lo == 2 * m else None
            z = dst if dst is not None else _tmp("normal.z", 2 * m, cd)
            # cosines in the first half of each group, sines in the second
            transforms.normal_outputs(r, c, th, m, NORMAL_GROUP, z, wide)
            if affine:
                np.multiply(z, std_c, out=z)
                np.add(z, mean_c, out=z)
            if log:
                np.exp(z, out=z)
            if dst is None:
                sink.write(lo, hi, z[: hi - lo])

        _drive(draw, pairs, 2, word, body, granule=NORMAL_GROUP)

    # ------------------------------------------------------------------ other continuous
    def _unit_open(self, out: torch.Tensor, op: str, offset: float, transform) -> None:
        """Fill ``out`` with ``transform(u)``, u = (k + offset) * 2**-bits, k the masked word."""
        _check_dtype(op, out.dtype, FLOAT_DTYPES)
        n = out.numel()
        word, cd, bits = _compute(out.dtype)
        draw = self._draw(n * _ITEMSIZE[word])
        if n == 0:
            return
        if offset != 1.0:  # k + offset must stay exact and below 2**bits: one bit fewer
            bits -= 1
        mask = word((1 << bits) - 1)
        unit = cd(2.0**-bits)
        sink = _Sink(out)

        def body(lo: int, hi: int, w: np.ndarray) -> None:
            np.bitwise_and(w, mask, out=w)
            dst = sink.direct(lo, hi, cd)
            u = dst if dst is not None else _tmp("unit_open", hi - lo, cd)
            np.copyto(u, _signed(w), casting="unsafe")  # exact: k < 2**bits
            np.add(u, cd(offset), out=u)
            np.multiply(u, unit, out=u)
            transform(u, cd)
            if dst is None:
                sink.write(lo, hi, u)

        _drive(draw, n, 1, word, body, into=sink.words(word, cd))

    def exponential_(self, out: torch.Tensor, lambd: float = 1.0) -> None:
        lambd = float(lambd)
        if not lambd > 0.0:
            spec.check_params("exponential_", (lambd,))

        def tf(u: np.ndarray, cd: type) -> None:  # -log(u) / lambd, u in (0, 1]
            np.log(u, out=u)
            # u = 1 would give 0, outside the support x > 0: as torch, log(u) is at most -eps/2
            np.minimum(u, cd(-np.finfo(cd).eps / 2), out=u)
            np.multiply(u, cd(-1.0 / lambd), out=u)

        with _overflow_if(out.dtype, 40.0 / lambd):  # -log(u) <= 37 for every word
            self._unit_open(out, "exponential_", 1.0, tf)

    def cauchy_(self, out: torch.Tensor, median: float = 0.0, sigma: float = 1.0) -> None:
        median, sigma = float(median), float(sigma)
        if not sigma > 0.0:
            spec.check_params("cauchy_", (median, sigma))

        def standard(u: np.ndarray, cd: type) -> None:  # tan(pi * (u - 1/2)), u in (0, 1)
            np.subtract(u, cd(0.5), out=u)
            np.multiply(u, cd(math.pi), out=u)
            np.tan(u, out=u)

        def tf(u: np.ndarray, cd: type) -> None:  # median + sigma * tan(pi * (u - 1/2))
            standard(u, cd)
            np.multiply(u, cd(sigma), out=u)
            np.add(u, cd(median), out=u)

        bound = abs(median) + sigma * _TAN_BOUND
        if bound < _COMPUTE_HALF_MAX[out.dtype]:
            with _overflow_if(out.dtype, bound):
                self._unit_open(out, "cauchy_", 0.5, tf)
            return
        z = torch.empty(out.shape, dtype=_compute_dtype(out.dtype))
        self._unit_open(z, "cauchy_", 0.5, standard)  # the common path's keystream and values
        _affine_exact(out, z, median, sigma)

    def geometric_(self, out: torch.Tensor, p: float) -> None:
        _check_dtype("geometric_", out.dtype, FLOAT_DTYPES + _INT_DTYPES)
        p = float(p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"geometric_: expected p in (0, 1], got {p}")
        n = out.numel()
        draw = self._draw(n * 8)
        if n == 0:
            return
        if p == 1.0:
            out.fill_(1)  # the blocks stay reserved, so the position moves as usual
            return
        denom = math.log1p(-p)
        limit = _max_value(out.dtype)
        sink = _Sink(out)
        mask = np.uint64((1 << 52) - 1)
        def body(lo: int, hi: int, w: np.ndarray) -> None:
            np.bitwise_and(w, mask, out=w)
            u = w.astype(np.float64)  # u = (k + 1/2) * 2**-52, exactly, in (0, 1)
            np.add(u, 0.5, out=u)
            np.multiply(u, 2.0**-52, out=u)
            np.log(u, out=u)
            with np.errstate(over="ignore"):  # p below 2**-1022: counts past float64's range
                np.divide(u, denom, out=u)
            np.ceil(u, out=u)
            if out.dtype == torch.int64:  # float(2**63 - 1) is 2**63, which has no int64
                big = u >= 2.0**63
                np.minimum(u, 2.0**63 - 1024, out=u)  # the largest float64 below 2**63
                u = u.astype(np.int64)
                u[big] = np.iinfo(np.int64).max
            else:
                np.minimum(u, limit, out=u)
            with np.errstate(over="ignore"):  # counts past a float dtype's range are inf, as in torch
                sink.write(lo, hi, u)

        _drive(draw, n, 1, np.uint64, body)

    # ------------------------------------------------------------------ integers
    def random_(self, out: torch.Tensor) -> None:
        """``random_()`` with no range: torch's default range for the dtype."""
        _check_dtype("random_", out.dtype, _REAL_DTYPES)
        low, high = default_range(out.dtype)
        self.random_range_(out, low, high)

    def random_range_(self, out: torch.Tensor, low: int, high: int) -> None:
        """Uniform integers in ``[low, high)``, exactly unbiased."""
        dtype = out.dtype
        _check_dtype("random_", dtype, _REAL_DTYPES + _UINT_DTYPES)
        low, high = int(low), int(high)
        if high <= low:
            raise ValueError(f"random_: expected from < to, got from={low}, to={high}")
        if dtype in _MANTISSA_BITS:
            _check_float_range(dtype, low, high)
        else:
            dmin, dmax = representable_range(dtype)
            if low < dmin or high - 1 > dmax:
                raise ValueError(
                    f"random_: range [{low}, {high}) does not fit dtype {dtype} "
                    f"(representable integers {dmin}..{dmax})"
                )
        n = out.numel()
        r = high - low
        wide = r > 1 << 32
        offset = np.uint64(low % (1 << 64))
        if 0 < n <= small.SMALL_ITEMS:
            done = small.integers(self.stream, out, n, low, r)
            if done is not None:
                start, bad = done
                if bad:
                    dst = flat_view(out).view(np.uint64) if dtype in _WORD64 else None
                    draw = Draw(self.stream, start, blocks_for(n * (8 if wide else 4)))
                    self._refill_integers(draw, np.array(bad, np.int64), r, offset, out, dst)
                return
        draw = self._draw(n * (8 if wide else 4))
        if n == 0:
            return
        dst = flat_view(out).view(np.uint64) if dtype in _WORD64 else None
        sink = None if dst is not None else _Sink(out)
        rejected: list[np.ndarray] = []
        word = np.uint64 if wide else np.uint32

        def body(lo: int, hi: int, w: np.ndarray) -> None:
            x = dst[lo:hi] if dst is not None else _tmp("integers.x", hi - lo, np.uint64)
            if not wide:  # one pass: the bounded values with the offset added
                if transforms.bounded32(w, r, int(offset), x):
                    low = np.multiply(w, np.uint32(r % (1 << 32)))
                    rejected.append(np.flatnonzero(low < np.uint32((1 << 32) % r)) + lo)
            else:
                bad = _bounded(w, r, x)
                if bad is not None:
                    rejected.append(bad + lo)
                if offset:
                    np.add(x, offset, out=x)
            if sink is not None:  # else the values were written into the output itself
                sink.write(lo, hi, x.view(np.int64))

        _drive(draw, n, 1, word, body)
        if rejected:
            positions = np.sort(np.concatenate(rejected))
            self._refill_integers(draw, positions, r, offset, out, dst)

    def _refill_integers(self, draw: Draw, positions: np.ndarray, r: int, offset: np.uint64,
                         out: torch.Tensor, dst) -> None:
        """Replace rejected values, in position order, from the draw's refill stream."""
        refill = NativeSampler(draw.refill_stream())
        wide = r > 1 << 32
        word = np.uint64 if wide else np.uint32
        while positions.size:
            d = refill._draw(positions.size * (8 if wide else 4))
            w = np.empty(positions.size, word)
            d.fill(w.view(np.uint8).data)
            x = np.empty(positions.size, np.uint64)
            bad = _bounded(w, r, x)
            np.add(x, offset, out=x)
            keep = np.ones(positions.size, bool)
            if bad is not None:
                keep[bad] = False
            if dst is not None:
                dst[positions[keep]] = x[keep]
            else:
                flat = out.view(-1)
                flat[torch.from_numpy(positions[keep])] = torch.from_numpy(
                    x[keep].view(np.int64)).to(flat.dtype)
            positions = positions[~keep]

    # ------------------------------------------------------------------ bernoulli
    def bernoulli_(self, out: torch.Tensor, p: float | torch.Tensor = 0.5) -> None:
        """1 with probability p, else 0: compares a 64-bit word with floor(p * 2**64)."""
        _check_dtype("bernoulli_", out.dtype, _REAL_DTYPES)
        n = out.numel()
        if isinstance(p, torch.Tensor):
            if p.is_complex() or not (p.is_floating_point() or p.dtype == torch.bool):
                raise TypeError(f"bernoulli_: p must be a floating-point tensor, got {p.dtype}")
            src = p.detach()
            try:
                if src.device.type == "cpu" and src.dtype != torch.bfloat16:
                    # NumPy's widening copy: torch's float32 -> float64 .to() took 16 ms for
                    # 256K values on the 2-vCPU VM, NumPy's well under 1 ms (the same values)
                    pn = np.ascontiguousarray(np.broadcast_to(
                        array_view(src).astype(np.float64, copy=False), tuple(out.shape))).reshape(-1)
                else:
                    pn = src.to("cpu", torch.float64).expand(out.shape).contiguous().view(-1).numpy()
            except (RuntimeError, ValueError) as exc:
                raise ValueError(f"bernoulli_: p of shape {tuple(p.shape)} does not broadcast "
                                 f"to the output shape {tuple(out.shape)}") from exc
            if not ((pn >= 0.0) & (pn <= 1.0)).all():
                raise ValueError("bernoulli_: expected all probabilities in [0, 1]")
        else:
            p = float(p)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"bernoulli_: expected p in [0, 1], got {p}")
            pn = None
        if pn is None and 0.0 < p < 1.0 and 0 < n <= small.SMALL_ITEMS and small.bernoulli(
                self.stream, out, n, math.floor(math.ldexp(p, 64))):
            return
        draw = self._draw(n * 8)
        if n == 0:
            return
        if pn is None and p in (0.0, 1.0):
            out.fill_(p == 1.0)  # the blocks stay reserved, so the position moves as usual
            return
        sink = _Sink(out)
        thr_scalar = np.uint64(math.floor(math.ldexp(p, 64))) if pn is None else None

        def body(lo: int, hi: int, w: np.ndarray) -> None:
            rc = _tmp("bernoulli", hi - lo, bool)
            if thr_scalar is not None:
                np.less(w, thr_scalar, out=rc)
            else:
                pc = cast(np.ndarray, pn)[lo:hi]  # thr_scalar is None exactly when pn is given
                ones = pc >= 1.0
                thr = np.ldexp(np.where(ones, 0.0, pc), 64).astype(np.uint64)
                np.less(w, thr, out=rc)
                rc |= ones
            sink.write(lo, hi, rc)

        _drive(draw, n, 1, np.uint64, body)

    # ------------------------------------------------------------------ permutations
    def randperm_(self, out: torch.Tensor) -> None:
        """An exactly uniform permutation of ``0..n-1``: random buckets, then Fisher-Yates in each
        (:mod:`ember.csprng.shuffle`, stream layout version 3)."""
        _check_dtype("randperm", out.dtype, _INT_DTYPES + FLOAT_DTYPES)
        n = out.numel()
        # torch limits floats to their exact integers, except bfloat16 (whose values it rounds)
        if out.dtype != torch.bfloat16 and n - 1 > representable_range(out.dtype)[1]:
            raise ValueError(f"randperm: n={n} is too large for dtype {out.dtype}")
        draw = self._draw(n * 8)
        if n == 0:
            return
        words = np.empty(2 * n, np.uint32)
        draw.fill(words.view(np.uint8).data)
        if n == 1:
            out.view(-1).fill_(0)
            return
        flat = out.view(-1)
        direct = out.dtype == torch.int64 and flat.is_contiguous()
        values = flat_view(flat) if direct else np.empty(n, np.int64)
        refill = NativeSampler(draw.refill_stream())

        def more(k: int) -> np.ndarray:
            w = np.empty(k, np.uint32)
            refill._draw(k * 4).fill(w.view(np.uint8).data)
            return w

        threads = _threads(n * 8)
        shuffle.permutation(words, values, more, _executor(threads) if threads > 1 else None)
        if not direct:
            flat.copy_(torch.from_numpy(values))

    # ------------------------------------------------------------------ multinomial / poisson
    def multinomial(self, probs: torch.Tensor, num_samples: int, replacement: bool = False
                    ) -> torch.Tensor:
        """Category indices drawn from each row of ``probs`` (weights, not necessarily normalised)."""
        if probs.dim() not in (1, 2):
            raise ValueError(f"multinomial: prob_dist must be 1 or 2 dim, got {probs.dim()} dims")
        if not probs.is_floating_point():
            raise TypeError(f"multinomial: expected a floating-point input, got {probs.dtype}")
        num_samples = int(num_samples)
        if num_samples <= 0:
            raise ValueError(f"multinomial: num_samples must be positive, got {num_samples}")
        p = probs.detach().to("cpu", torch.float64).reshape(-1, probs.shape[-1]).contiguous()
        rows, k = p.shape
        if k == 0:
            raise ValueError("multinomial: the input has no categories")
        pn = flat_view(p).reshape(rows, k)
        if not np.isfinite(pn).all() or (pn < 0).any():
            raise ValueError("multinomial: probabilities must be finite and non-negative")
        with _overflow_to_inf():
            sums = pn.sum(axis=1)
        if not np.isfinite(sums).all():  # weights summing past float64: the same weights scaled
            pn = pn / pn.max(axis=1, keepdims=True)
            sums = pn.sum(axis=1)
        if (sums <= 0).any():
            raise ValueError("multinomial: every row must have a positive sum")
        if not replacement and num_samples > k:
            raise ValueError(f"multinomial: cannot take num_samples={num_samples} > "
                             f"{k} categories without replacement")
        nwords = rows * (num_samples if replacement else k)
        w = np.empty(nwords, "<u8")
        self._draw(nwords * 8).fill(w.view(np.uint8).data)
        u = (w & np.uint64((1 << 53) - 1)).astype(np.float64)
        if replacement:
            # inversion: u in [0, 1) against the normalised cumulative weights of each row
            np.multiply(u, 2.0**-53, out=u)
            u = u.reshape(rows, num_samples)
            cdf = np.cumsum(pn, axis=1) / sums[:, None]
            last = k - 1 - np.argmax(pn[:, ::-1] > 0, axis=1)
            res = np.empty((rows, num_samples), np.int64)
            for i in range(rows):
                res[i] = np.minimum(np.searchsorted(cdf[i], u[i], side="right"), last[i])
        else:
            # exponential races: the order of E_i / w_i is a draw without replacement
            np.add(u, 1.0, out=u)
            np.multiply(u, 2.0**-53, out=u)
            keys = -np.log(u).reshape(rows, k)
            with np.errstate(divide="ignore", over="ignore"):  # a tiny weight's key: inf
                keys = np.where(pn > 0, keys / np.where(pn > 0, pn, 1.0), np.inf)
            order = np.argsort(keys, axis=1, kind="stable")
            res = np.ascontiguousarray(order[:, :num_samples]).astype(np.int64)
        t = torch.from_numpy(res).clone()  # a tensor of torch's own memory: resizable, as torch's
        return t.view(num_samples) if probs.dim() == 1 else t

    def poisson(self, rates: torch.Tensor) -> torch.Tensor:
        """Poisson counts with the given rates: inversion of the CDF below POISSON_PTRS_RATE,
        Hörmann's transformed rejection (PTRS) from it on, whose cost does not grow with the rate."""
        if not rates.is_floating_point():
            raise TypeError(f"poisson: expected a floating-point rate tensor, got {rates.dtype}")
        lam = rates.detach().to("cpu", torch.float64).contiguous().view(-1)
        ln = flat_view(lam)
        if not np.isfinite(ln).all() or (ln < 0).any():
            raise ValueError("poisson: rates must be finite and non-negative")
        n = ln.size
        draw = self._draw(n * 16)
        k = np.zeros(n)
        if n == 0:
            return torch.from_numpy(k).to(rates.dtype, copy=True).view(rates.shape)  # resizable
        u = _u53_pairs(draw, n)
        low = (ln > 0) & (ln < POISSON_PTRS_RATE)
        if low.any():
            k[low] = _poisson_inverse(torch.from_numpy(ln[low]),
                                      torch.from_numpy(np.ascontiguousarray(u[low, 0]))).numpy()
        pending = np.flatnonzero(ln >= POISSON_PTRS_RATE)
        if pending.size:
            refill = NativeSampler(draw.refill_stream())
            uu = u[pending]
            while True:  # rejected elements redraw, in element order, from the refill stream
                values, ok = _ptrs(ln[pending], uu[:, 0], uu[:, 1])
                k[pending[ok]] = values[ok]
                pending = pending[~ok]
                if not pending.size:
                    break
                uu = _u53_pairs(refill._draw(pending.size * 16), pending.size)
        return torch.from_numpy(k).to(rates.dtype, copy=True).view(rates.shape)  # resizable


POISSON_PTRS_RATE = 10.0  # rates from here on use PTRS (as NumPy does)


def _u53_pairs(draw: Draw, n: int) -> np.ndarray:
    """``n`` pairs of uniforms ``(w & (2**53 - 1)) * 2**-53`` from ``2n`` 64-bit words."""
    w = np.empty(2 * n, "<u8")
    draw.fill(w.view(np.uint8).data)
    return ((w & np.uint64((1 << 53) - 1)).astype(np.float64) * 2.0**-53).reshape(n, 2)


def _ptrs(lam: np.ndarray, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One round of PTRS (W. Hörmann, "The transformed rejection method for generating Poisson
    random variables", 1993) for rates ``lam`` >= 10: (candidate counts, which are accepted)."""
    slam = np.sqrt(lam)
    b = 0.931 + 2.53 * slam
    a = -0.059 + 0.02483 * b
    inv_alpha = 1.1239 + 1.1328 / (b - 3.4)
    vr = 0.9277 - 3.6224 / (b - 2.0)
    uc = u - 0.5
    us = 0.5 - np.abs(uc)
    with np.errstate(divide="ignore", invalid="ignore"):  # us = 0, v = 0: rejected / accepted
        k = np.floor((2.0 * a / us + b) * uc + lam + 0.43)
        quick = (us >= 0.07) & (v <= vr)
        out = (k < 0) | ~np.isfinite(k) | ((us < 0.013) & (v > us))
        lhs = np.log(v) + np.log(inv_alpha) - np.log(a / (us * us) + b)
        kk = np.where(out, lam, k)  # any valid count where the element is rejected anyway
        ok = quick | (~out & (lhs <= _poisson_log_pmf(kk, lam)))
    return k, ok


def _poisson_log_pmf(k: np.ndarray, lam: np.ndarray) -> np.ndarray:
    """log P(X = k) for X ~ Poisson(lam), accurate where k and lam are both large: Loader's
    saddle-point form, -stirlerr(k) - lam * phi((k - lam) / lam) - log(2 pi k) / 2."""
    res = np.empty_like(k)
    direct = k < 16
    if direct.any():
        kd, ld = k[direct], lam[direct]
        res[direct] = -ld + kd * np.log(ld) - torch.lgamma(torch.from_numpy(kd + 1.0)).numpy()
    big = ~direct
    if big.any():
        kb, lb = k[big], lam[big]
        x = (kb - lb) / lb
        bd0 = lb * ((1.0 + x) * np.log1p(x) - x)
        k2 = kb * kb
        stirlerr = (1 / 12 - (1 / 360 - (1 / 1260 - (1 / 1680 - 1 / (1188 * k2)) / k2) / k2) / k2) / kb
        res[big] = -stirlerr - bd0 - 0.5 * np.log(2.0 * math.pi * kb)
    return res


_BATCHED_NORMAL = (torch.float32, torch.float64)


def _normal_one_group_each(buf, items: list[tuple[torch.Tensor, int]], dtype: torch.dtype,
                           mean: float, std: float) -> None:
    """``normal_`` into many small tensors of one dtype (each at most one group of pairs) whose
    keystream lies in ``buf`` at the given byte offsets: the transform of ``_normal`` done once
    for all of them, element for element the same float operations, so the same values.

    A tensor of ``n`` values and ``m = ceil(n / 2)`` pairs reads ``m`` radius words then ``m``
    angle words; it gets the ``m`` cosine values then the ``m`` sine values, cut to ``n``.
    """
    word, cd, bits = _compute(dtype)
    isz = _ITEMSIZE[word]
    words = np.frombuffer(buf, dtype=np.dtype(word).newbyteorder("<"))
    key = tuple((out.numel(), at // isz) for out, at in items)
    r_at, t_at, cos_at, sin_at, starts = _pair_indices(key)
    total = len(r_at)
    mask = word((1 << bits) - 1)
    k = _tmp("batch.words", total, word)
    r, th, c = (_tmp("batch." + name, total, cd) for name in "rtc")
    np.take(words, r_at, out=k)
    np.bitwise_and(k, mask, out=k)
    np.copyto(r, _signed(k), casting="unsafe")  # exact: k < 2**bits
    np.take(words, t_at, out=k)
    np.bitwise_and(k, mask, out=k)
    np.copyto(th, _signed(k), casting="unsafe")
    np.add(r, cd(1.0), out=r)
    np.multiply(r, cd(2.0**-bits), out=r)
    np.log(r, out=r)
    np.multiply(r, cd(-2.0), out=r)
    np.sqrt(r, out=r)
    np.multiply(th, cd(_TWO_PI * 2.0**-bits), out=th)
    np.cos(th, out=c)
    np.sin(th, out=th)
    np.multiply(c, r, out=c)
    np.multiply(th, r, out=th)
    z = _tmp("batch.z", 2 * total, cd)
    z[cos_at] = c
    z[sin_at] = th
    if not (mean == 0.0 and std == 1.0):
        np.multiply(z, cd(std), out=z)
        np.add(z, cd(mean), out=z)
    for (out, _), (n, _), lo in zip(items, key, starts, strict=True):
        np.copyto(flat_view(out.detach()), z[lo: lo + n])


@functools.lru_cache(maxsize=16)
def _pair_indices(key: tuple[tuple[int, int], ...]):
    """For tensors of ``(values, first keystream word)``: where each pair's radius and angle
    words are, where its cosine and sine values go in the concatenated output, and where each
    tensor's values start there (the same layout repeats every step of a training loop)."""
    ns = np.array([n for n, _ in key], np.int64)
    ms = (ns + 1) // 2
    before = np.cumsum(ms) - ms  # pairs of the earlier tensors
    local = np.arange(int(ms.sum()), dtype=np.int64) - np.repeat(before, ms)
    half = np.repeat(ms, ms)
    r_at = np.repeat(np.array([f for _, f in key], np.int64), ms) + local
    cos_at = 2 * np.repeat(before, ms) + local
    arrays = (r_at, r_at + half, cos_at, cos_at + half)
    for a in arrays:
        a.flags.writeable = False  # shared by every call with this layout
    return (*arrays, (2 * before).tolist())


class _BufferDraw:
    """A draw whose keystream was generated beforehand into ``view`` (read front to back)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.at = view, 0

    def fill(self, buf: memoryview) -> None:
        n = len(buf)
        buf[:] = self.view[self.at: self.at + n]
        self.at += n


def _poisson_inverse(lam: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The smallest k with P(X <= k) > u for X ~ Poisson(lam), elementwise."""
    k = torch.zeros_like(lam)
    pos = lam > 0
    if not bool(pos.any()):
        return k
    lp, up = lam[pos], u[pos]
    # start near the answer (normal approximation with a skew term), then step to it exactly
    z = torch.special.ndtri(up.clamp(1e-300, 1 - 1e-16))
    guess = torch.floor(lp + lp.sqrt() * z + (z * z - 1) / 6).clamp_(min=0)

    def cdf(kk: torch.Tensor, ll: torch.Tensor) -> torch.Tensor:
        return torch.special.gammaincc(kk + 1, ll)

    kk = guess
    for _ in range(10_000):
        low = cdf(kk, lp) <= up  # P(X <= k) <= u: answer is above k
        if not bool(low.any()):
            break
        kk = torch.where(low, kk + 1, kk)
    for _ in range(10_000):
        high = (kk > 0) & (cdf(kk - 1, lp) > up)  # answer is at or below k - 1
        if not bool(high.any()):
            break
        kk = torch.where(high, kk - 1, kk)
    k[pos] = kk
    return k


def _bounded(w: np.ndarray, r: int, x: np.ndarray) -> np.ndarray | None:
    """Write floor(w * r / 2**W) into ``x`` (uint64); return the indices to reject, if any.

    W is the word width (32 or 64 bits). Power-of-two ranges take the low bits and never reject.
    Other ranges use Lemire's multiply-and-reject: a word is rejected when the low W bits of the
    product fall below 2**W mod r, which makes every value exactly equally likely.
    """
    bits = w.dtype.itemsize * 8
    if r & (r - 1) == 0:
        np.bitwise_and(w, w.dtype.type(min(r, 1 << bits) - 1), out=x, casting="unsafe")
        return None
    if bits == 32:
        np.copyto(x, w, casting="unsafe")  # widen, then multiply in place: 10% faster than a
        np.multiply(x, np.uint64(r), out=x)  # casting multiply in NumPy, the same values
        # the low 32 bits of the product (wrapping)
        low = np.multiply(w, np.uint32(r), out=_tmp("bounded.low", w.size, np.uint32))
        np.right_shift(x, np.uint64(32), out=x)
        threshold = np.uint32((1 << 32) % r)
    else:
        hi, low = _mul64(w, r)
        x[...] = hi
        threshold = np.uint64((1 << 64) % r)
    if np.minimum.reduce(low) >= threshold:  # the common case: one pass, no temporary
        return None
    return np.flatnonzero(low < threshold)


def _mul64(w: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) 64-bit halves of the 128-bit products w * r, for uint64 w and r < 2**64."""
    m32 = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    wl, wh = w & m32, w >> s32
    rl, rh = np.uint64(r & 0xFFFFFFFF), np.uint64(r >> 32)
    ll, lh, hl, hh = wl * rl, wl * rh, wh * rl, wh * rh
    mid = (ll >> s32) + (lh & m32) + (hl & m32)
    high = hh + (lh >> s32) + (hl >> s32) + (mid >> s32)
    low = (mid << s32) | (ll & m32)
    return high, low


@functools.lru_cache(maxsize=256)
def _rounded(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to ``dtype``."""
    return float(torch.tensor(x, dtype=dtype, device="cpu"))


@functools.lru_cache(maxsize=256)
def _below(b: float, dtype: torch.dtype) -> float:
    """The largest value of ``dtype`` strictly below ``b``."""
    t = torch.tensor(b, dtype=dtype, device="cpu")
    return float(torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype, device="cpu")))


def _check_float_range(dtype: torch.dtype, low: int, high: int) -> None:
    """torch's rules for integers in ``[low, high)`` drawn into a float dtype: both ends within
    its finite range, and a warning where they pass its exact integers (the values are the
    integers drawn, rounded to the dtype)."""
    info = torch.finfo(dtype)
    for name, v in (("from", low), ("to - 1", high - 1)):
        if not info.min <= v <= info.max:
            raise ValueError(f"random_: {name} is out of bounds for {dtype}, got {v}")
    digits = _MANTISSA_BITS[dtype]
    for name, v in (("from", low), ("to - 1", high - 1)):
        if not -(1 << digits) <= v <= 1 << digits:
            warnings.warn(
                f"{name} is out of bounds [-(2^{digits}), 2^{digits}]. Due to precision "
                f"limitations {dtype} can support discrete uniform distribution only within this "
                "range (ember.csprng draws the integers exactly and rounds them to the dtype, as "
                "torch does)", UserWarning, stacklevel=4)


@functools.cache
def representable_range(dtype: torch.dtype) -> tuple[int, int]:
    """The integers ``dtype`` holds exactly (for floats: the contiguous range ±2**digits)."""
    if dtype == torch.bool:
        return 0, 1
    if dtype in _MANTISSA_BITS:
        m = 1 << _MANTISSA_BITS[dtype]
        return -m, m
    info = torch.iinfo(dtype)
    return info.min, info.max


def default_range(dtype: torch.dtype) -> tuple[int, int]:
    """torch's ``random_()`` range ``[0, high)`` for ``dtype``."""
    if dtype == torch.bool:
        return 0, 2
    if dtype in _MANTISSA_BITS:
        return 0, (1 << _MANTISSA_BITS[dtype]) + 1
    return 0, torch.iinfo(dtype).max + 1


def _max_value(dtype: torch.dtype) -> float:
    if dtype in _MANTISSA_BITS:
        return math.inf
    return float(torch.iinfo(dtype).max)
