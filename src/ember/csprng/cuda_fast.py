"""Host side of the fast NVIDIA path: one fill becomes one or two kernel launches, with no copy.

Every parameter travels in the launch's :class:`~ember.csprng.nvrtc_kernels.Params` (round keys,
counter, scales, thresholds), so a fill neither copies to the device nor waits for it. Block
reservation is the CPU sampler's, so the stream position and the values match the CPU path (bit for
bit for integers, bernoulli and uniform; within the documented ulp bounds for the transcendental
transforms). Integer rejections are refilled on the device by a second kernel from the draw's
``reject`` stream.

The launcher is replaceable (:func:`set_launcher`): tests record the launches on a machine without
a GPU instead of executing them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch

from . import nvrtc_kernels as nk
from . import spec
from .distributions import NativeSampler, blocks_for, default_range
from .stream import BlockStream, derive_key

FAST_METHODS = frozenset(d.method for d in spec.DISTRIBUTIONS if d.nvrtc)
_KIND = {
    torch.float32: nk.K_F32, torch.float64: nk.K_F64, torch.float16: nk.K_F16, torch.bfloat16: nk.K_BF16,
    torch.int64: nk.K_I64, torch.int32: nk.K_I32, torch.int16: nk.K_I16, torch.int8: nk.K_I8,
    torch.uint8: nk.K_U8, torch.bool: nk.K_U8,
}
_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
_CIPHER = {"aes128": "aes", "chacha20": "chacha"}
_launcher: Any = None


def set_launcher(launcher: Any) -> Any:
    """Use ``launcher`` (``launch(device, name, grid, params, stream)``,
    ``resident_blocks(device, name)``);
    returns the previous one. ``None`` restores the CUDA driver launcher."""
    global _launcher
    old, _launcher = _launcher, launcher
    return old


def launcher() -> Any:
    global _launcher
    if _launcher is None:
        _launcher = nk.DriverLauncher()
    return _launcher


@lru_cache(maxsize=64)
def key_words(cipher: str, key: bytes) -> tuple[int, ...]:
    """The 44 key words of the kernels' Params for ``cipher`` under ember key ``key``."""
    from .cuda_backend import cipher_table

    table = cipher_table(cipher, key).view("uint32")
    words = table[-44:] if cipher == "aes128" else table[:8]
    return tuple(int(v) for v in words) + (0,) * (44 - len(words))


@lru_cache(maxsize=64)
def _keyed(cipher: str, key: bytes) -> nk.Params:
    """A Params with only the key words set (copied per launch: cheaper than setting 44 words)."""
    p = nk.Params()
    p.key[:] = key_words(cipher, key)
    return p


_OPS = {d.method: d.nvrtc for d in spec.DISTRIBUTIONS if d.nvrtc}


@lru_cache(maxsize=64)
def kernel_names(cipher: str, method: str) -> tuple[str, ...]:
    """The kernels a fill with ``method`` may launch."""
    return tuple(f"ember_{_CIPHER[cipher]}_{op}" for op in _OPS[method])


def supports(sampler: Any, tensor: torch.Tensor, method: str) -> bool:
    """Whether the fast path handles this fill."""
    return (
        method in FAST_METHODS
        and type(sampler) is NativeSampler
        and sampler.stream.cipher_name in _CIPHER
        and tensor.dtype in _KIND
    )


class _Call:
    """One fill: its stream, flat output, device and the launches it makes."""

    __slots__ = ("stream", "out", "n", "dtype", "device", "cname", "lch", "stream_handle")

    def __init__(self, stream: BlockStream, out: torch.Tensor) -> None:
        self.stream, self.out = stream, out
        self.n, self.dtype = out.numel(), out.dtype
        self.device = out.device.index if out.device.type == "cuda" else 0
        self.cname = _CIPHER[stream.cipher_name]
        self.lch = launcher()
        self.stream_handle = _raw_stream(self.device) if out.device.type == "cuda" else 0

    def params(self, start: int, wb: int, mbits: int = 0, flags: int = 0) -> nk.Params:
        p = nk.Params.from_buffer_copy(_keyed(self.stream.cipher_name, self.stream.key))
        first, skip = (start, 0) if self.cname == "aes" else divmod(start, 4)
        p.ctr[:] = [(first >> (32 * j)) & 0xFFFFFFFF for j in range(4)]
        p.skip, p.wb, p.mbits, p.kind, p.n = skip, wb, mbits, _KIND[self.dtype], self.n
        p.out = self.out.data_ptr()
        aligned = p.out % 16 == 0
        p.flags = flags | (nk.F_ALIGNED if aligned else 0)
        return p

    def grid(self, work: int, name: str) -> int:
        """Blocks for ``work`` thread-items: one per NT items, at most as many as the GPU holds at
        once (a persistent grid: a second, partial wave would leave most SMs idle)."""
        return max(1, min(-(-work // nk.NT), self.lch.resident_blocks(self.device, name)))

    def fill(self, op: str, p: nk.Params, nbytes: int) -> None:
        p.nunits = blocks_for(nbytes)
        work = p.nunits if self.cname == "aes" else -(-(p.nunits + p.skip) // 4)
        name = f"ember_{self.cname}_{op}"
        self.lch.launch(self.device, name, self.grid(work, name), p, self.stream_handle)


def _raw_stream(device: int) -> int:
    """The handle of torch's current stream on ``device`` (cheaper than ``current_stream()``)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream


def fast_fill_(sampler: NativeSampler, tensor: torch.Tensor, method: str, params: tuple) -> None:
    """Fill ``tensor`` (contiguous) like ``getattr(sampler, method)(tensor, *params)``.

    The caller has validated the arguments (the CPU sampler's checks) and checked :func:`supports`.
    """
    c = _Call(sampler.stream, tensor.view(-1))
    _FILLS[method](c, params)


def _uniform(c: _Call, params: tuple) -> None:
    a, b = (float(v) for v in (tuple(params) + (0.0, 1.0)[len(params):]))
    bits = _BITS[c.dtype]
    wb = {53: 8, 24: 4}.get(bits, 2)
    start = c.stream.reserve(blocks_for(c.n * wb))
    if c.n == 0:
        return
    lo = _rounded(a, c.dtype)
    if lo == _rounded(b, c.dtype) and not (a == 0.0 and b == 1.0):
        c.out.fill_(lo)  # a and b are one value of the dtype: torch gives a (layout 4)
        return
    f32 = c.dtype != torch.float64
    scale, shift = _round((b - a) * 2.0**-bits, f32), _round(a, f32)
    clamp = not (a == 0.0 and b == 1.0)
    p = c.params(start, wb, bits, (nk.F_SHIFT if shift != 0 else 0) | (nk.F_CLAMP if clamp else 0))
    p.fp[0], p.fp[1], p.fp[2] = scale, shift, _below(b, c.dtype) if clamp else 0.0
    c.fill("uniform", p, c.n * wb)
    if clamp and bits < 24:  # a float32 value >= a can round below a's own 16-bit rounding
        c.out.clamp_(min=lo)


@lru_cache(maxsize=1024)
def _round(x: float, f32: bool) -> float:
    """``x`` rounded to float32 (as a Python float) when ``f32``."""
    return float(torch.tensor(x, dtype=torch.float32)) if f32 else x


@lru_cache(maxsize=256)
def _rounded(x: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(x, dtype=dtype))


@lru_cache(maxsize=256)
def _below(b: float, dtype: torch.dtype) -> float:
    t = torch.tensor(b, dtype=dtype)
    return float(torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype)))


@lru_cache(maxsize=256)
def _normal_consts(f64: bool, mean: float, std: float) -> tuple[float, float, float, float]:
    bits = 53 if f64 else 24
    scale, angle, s, m = (_round(v, not f64) for v in (2.0**-bits, 2.0 * math.pi * 2.0**-bits,
                                                        std, mean))
    return scale, angle, s, m


def _normal_family(log: bool):
    def fill(c: _Call, params: tuple) -> None:
        mean, std = _mean_std(params, log)
        f64 = c.dtype == torch.float64
        wb, bits = (8, 53) if f64 else (4, 24)
        pairs = (c.n + 1) // 2
        start = c.stream.reserve(blocks_for(pairs * 2 * wb))
        if c.n == 0:
            return
        flags = (nk.F_F64 if f64 else 0) | (nk.F_LOG if log else 0)
        if not (mean == 0.0 and std == 1.0):
            flags |= nk.F_AFFINE
        p = c.params(start, wb, bits, flags)
        p.fp[:] = _normal_consts(f64, mean, std)
        p.pairs = pairs
        full, q = divmod(pairs, nk.GROUP)
        off = nk.GROUP * wb // 16
        work = full * (off if c.cname == "aes" else off // 4 + 1)
        name = f"ember_{c.cname}_normal"
        c.lch.launch(c.device, name, c.grid(max(work, q), name), p, c.stream_handle)

    return fill


def _mean_std(params: tuple, log: bool) -> tuple[float, float]:
    defaults = (1.0, 2.0) if log else (0.0, 1.0)
    full = tuple(params) + defaults[len(params):]
    return float(full[0]), float(full[1])


def _exponential(c: _Call, params: tuple) -> None:
    lambd = float(params[0]) if params else 1.0
    f64 = c.dtype == torch.float64
    wb, bits = (8, 53) if f64 else (4, 24)
    start = c.stream.reserve(blocks_for(c.n * wb))
    if c.n == 0:
        return
    p = c.params(start, wb, bits, nk.F_F64 if f64 else 0)
    p.fp[0], p.fp[1] = _round(2.0**-bits, not f64), _round(-1.0 / lambd, not f64)
    c.fill("exponential", p, c.n * wb)


def _random(c: _Call, params: tuple) -> None:
    _random_range(c, default_range(c.dtype))


def _random_range(c: _Call, params: tuple) -> None:
    low, high = int(params[0]), int(params[1])
    r = high - low
    wb = 8 if r > 1 << 32 else 4
    start = c.stream.reserve(blocks_for(c.n * wb))
    if c.n == 0:
        return
    m64 = (1 << 64) - 1
    if r & (r - 1) == 0:
        p = c.params(start, wb, 0, nk.F_POW2)
        p.ip[0], p.ip[1], p.ip[2] = (r - 1) & m64, 0, low & m64
        c.fill("integer", p, c.n * wb)
        return
    thresh = (1 << (8 * wb)) % r
    cap = min(c.n, _reject_capacity(c.n, thresh, wb))
    dev = c.out.device
    cnt = torch.zeros(2, dtype=torch.int32, device=dev)  # [count, overflow flag]
    pos = torch.full((cap,), (1 << 63) - 1, dtype=torch.int64, device=dev)
    p = c.params(start, wb, 0, 0)
    p.ip[0], p.ip[1], p.ip[2] = r, thresh, low & m64
    p.cnt, p.pos, p.cap = cnt.data_ptr(), pos.data_ptr(), cap
    c.fill("integer", p, c.n * wb)
    # the positions in increasing order (unused slots hold the largest int64 and sort last)
    pos = torch.sort(pos).values
    refill = BlockStream(derive_key(c.stream.key, "reject", start), 0, c.stream.cipher_name)
    q = _Call(refill, c.out)
    rp = q.params(0, wb, 0, 0)
    rp.ip[0], rp.ip[1], rp.ip[2] = r, thresh, low & m64
    rp.cnt, rp.pos, rp.cap, rp.err = cnt.data_ptr(), pos.data_ptr(), cap, cnt.data_ptr() + 4
    c.lch.launch(c.device, f"ember_{c.cname}_refill", 1, rp, c.stream_handle)
    if c.out.device.type == "cuda":
        # more rejections than room (beyond 8 standard deviations): fail loudly, never silently
        torch._assert_async(cnt[1] == 0, "ember.csprng: integer rejection list overflow")


def _reject_capacity(n: int, thresh: int, wb: int) -> int:
    """Room for rejected positions: the expected count plus 8 standard deviations and 64."""
    expected = n * thresh / 2.0 ** (8 * wb)
    return int(expected + 8 * math.sqrt(expected) + 64)


def _bernoulli(c: _Call, params: tuple) -> None:
    prob = params[0] if params else 0.5
    start = c.stream.reserve(blocks_for(c.n * 8))
    if c.n == 0:
        return
    if isinstance(prob, torch.Tensor):
        p = c.params(start, 8, 0, nk.F_PTENSOR)
        p.p = prob.data_ptr()
        c.fill("bernoulli", p, c.n * 8)
        return
    prob = float(prob)
    if prob in (0.0, 1.0):
        c.out.fill_(prob == 1.0)
        return
    p = c.params(start, 8, 0, 0)
    p.ip[0] = math.floor(math.ldexp(prob, 64))
    c.fill("bernoulli", p, c.n * 8)


# the host side of each record with NVRTC kernels (ember.csprng.spec)
_IMPLEMENTS: dict[str, Callable[[_Call, tuple], None]] = {
    "uniform_": _uniform,
    "normal_": _normal_family(log=False),
    "log_normal_": _normal_family(log=True),
    "exponential_": _exponential,
    "random_": _random,
    "random_range_": _random_range,
    "bernoulli_": _bernoulli,
}


def _fill_table(records: Sequence[spec.Distribution]) -> dict[str, Callable[[_Call, tuple], None]]:
    """method -> host fill, for each of ``records`` with NVRTC kernels; raises
    :class:`~ember.csprng.spec.RecordMismatch` naming a record whose fill or kernels (for either
    cipher) this module or ``nvrtc_kernels`` lacks."""
    wanted = {d.method: d for d in records if d.nvrtc}
    for d in wanted.values():
        missing = [k for op in d.nvrtc for c in _CIPHER.values()
                   if (k := f"ember_{c}_{op}") not in nk.KERNELS]
        if missing:
            raise spec.RecordMismatch(
                f"the record {d.method!r} (ember.csprng.spec) asks for the NVRTC kernel "
                f"{missing[0]}, which ember.csprng.nvrtc_kernels does not have")
    return spec.dispatch_table("ember.csprng.cuda_fast (NVRTC)", wanted, _IMPLEMENTS)


_FILLS = _fill_table(spec.DISTRIBUTIONS)


MULTI_BLOCKS = 1024  # blocks of a normal_multi launch per tensor at most (grid-stride beyond)


def normal_multi_(sampler: NativeSampler, tensors: list[torch.Tensor], mean: float, std: float) -> None:
    """``normal_(t, mean, std)`` for every tensor (contiguous, float, on one device) in order, in
    one launch: the same values and stream position as one call per tensor."""
    if not tensors:
        return
    stream = sampler.stream
    c = _Call(stream, tensors[0].view(-1))
    descs = (nk.Desc * len(tensors))()
    affine = 0 if (mean == 0.0 and std == 1.0) else nk.F_AFFINE
    off_units = {8: nk.GROUP * 8 // 16, 4: nk.GROUP * 4 // 16}
    block = 0
    for d, t in zip(descs, tensors, strict=True):
        flat = t.view(-1)
        n = flat.numel()
        f64 = t.dtype == torch.float64
        wb, bits = (8, 53) if f64 else (4, 24)
        pairs = (n + 1) // 2
        start = stream.reserve(blocks_for(pairs * 2 * wb))
        first, skip = (start, 0) if c.cname == "aes" else divmod(start, 4)
        d.ctr[:] = [(first >> (32 * j)) & 0xFFFFFFFF for j in range(4)]
        ptr = flat.data_ptr() if n else 0
        d.n, d.pairs, d.out = n, pairs, ptr
        d.fp[:] = _normal_consts(f64, mean, std)
        d.skip, d.kind, d.wb, d.mbits = skip, _KIND[t.dtype], wb, bits
        d.flags = affine | (nk.F_F64 if f64 else 0) | (nk.F_ALIGNED if ptr % 16 == 0 else 0)
        full, q = divmod(pairs, nk.GROUP)
        off = off_units[wb]
        work = max(full * (off if c.cname == "aes" else off // 4 + 1), q)
        nb = 0 if n == 0 else max(1, min(-(-work // nk.NT), MULTI_BLOCKS))
        d.first_block, d.nblocks = block, nb
        block += nb
    if block == 0:
        return
    raw = torch.frombuffer(bytearray(bytes(descs)), dtype=torch.uint8)
    if tensors[0].is_cuda:  # pinned, copied without waiting (torch keeps the host buffer alive)
        raw = raw.pin_memory().to(tensors[0].device, non_blocking=True)
    p = c.params(0, 4, 24, 0)
    p.p, p.n = raw.data_ptr(), len(tensors)
    c.lch.launch(c.device, f"ember_{c.cname}_normal_multi", block, p, c.stream_handle)
    if not tensors[0].is_cuda:
        del raw  # the (emulated or recorded) launch has run


def secure_noise_(sampler: NativeSampler, outs: list[torch.Tensor], std: float) -> None:
    """Opacus's secure-mode noise into each float32 tensor of ``outs`` (contiguous, one device),
    AES-128 only, in one launch: per tensor one throw-away one-value draw, then
    ``((((0 + z1) + z2) + z3) + z4) / 2`` of four ``normal_(0, std)`` draws of its size; the same
    values and stream position as those five calls per tensor followed by the sums."""
    if not outs:
        return
    stream = sampler.stream
    c = _Call(stream, outs[0].view(-1))
    descs = (nk.Desc4 * len(outs))()
    block = 0
    for d, t in zip(descs, outs, strict=True):
        n = t.numel()
        pairs = (n + 1) // 2
        stream.reserve(blocks_for(2 * 4))  # the throw-away normal(0, std, (1, 1))
        for draw in range(4):
            start = stream.reserve(blocks_for(pairs * 2 * 4))
            d.ctr[draw][:] = [(start >> (32 * j)) & 0xFFFFFFFF for j in range(4)]
        d.n, d.pairs, d.out = n, pairs, t.data_ptr() if n else 0
        full, q = divmod(pairs, nk.GROUP)
        work = max(full * (nk.GROUP // 4), q)
        nb = 0 if n == 0 else max(1, min(-(-work // nk.NT), MULTI_BLOCKS))
        d.first_block, d.nblocks = block, nb
        block += nb
    if block == 0:
        return
    raw = torch.frombuffer(bytearray(bytes(descs)), dtype=torch.uint8)
    if outs[0].is_cuda:
        raw = raw.pin_memory().to(outs[0].device, non_blocking=True)
    p = c.params(0, 4, 24, 0 if std == 1.0 else nk.F_AFFINE)
    p.fp[:] = _normal_consts(False, 0.0, float(std))
    p.p, p.n = raw.data_ptr(), len(outs)
    c.lch.launch(c.device, "ember_aes_secure_noise", block, p, c.stream_handle)
