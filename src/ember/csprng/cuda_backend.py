"""Device backend: ember's native distributions on CUDA tensors, computed by Triton kernels.

Importing this module registers :func:`cuda_fill` for ``"cuda"`` tensors with the torch adapter;
it never imports triton itself (that happens on the first CUDA fill). Each fill reserves exactly the
blocks the CPU sampler (:class:`~ember.csprng.distributions.NativeSampler`) would reserve, so the
stream position and the values match the CPU path (bit for bit for integers, bernoulli and uniform;
to within the stated ulp bounds where ``log``/``sin``/``cos``/``tan``/``exp`` are involved, see
docs/csprng-stream.md, "CUDA"). ``randperm``, ``multinomial`` and ``poisson`` stay on the CPU path.

:func:`triton_fill_` runs the same kernels on CPU tensors under Triton's interpreter, for tests.
:func:`aes_crypt_` is AES-128 ECB/CTR over tensor data for ``ember.csprng.crypt`` on CUDA tensors.
The AES-128 key schedules and T-tables (encryption and decryption) are computed here on the host.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache
from types import ModuleType
from typing import Any

import numpy as np
import torch

from . import distributions, spec
from .distributions import NativeSampler, blocks_for, default_range
from .stream import BlockStream, derive_key

SUPPORTED_METHODS = tuple(d.method for d in spec.DISTRIBUTIONS if d.triton)
MAX_LANES = 1 << 30  # cipher blocks per launch; larger fills take the CPU path
_FLOAT_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


# ---------------------------------------------------------------------------- AES-128 host side
def _xtime(b: int) -> int:
    b <<= 1
    return (b ^ 0x11B) if b & 0x100 else b


def _gf_mul(a: int, b: int) -> int:
    r = 0
    while b:
        if b & 1:
            r ^= a
        a = _xtime(a)
        b >>= 1
    return r


@lru_cache(maxsize=1)
def aes_sbox() -> tuple[int, ...]:
    """The AES S-box (FIPS-197 5.1.1): multiplicative inverse in GF(2^8), then the affine map."""
    box = []
    for x in range(256):
        inv = 0
        if x:
            inv = 1
            for _ in range(254):  # x^254 = x^-1 in GF(2^8)
                inv = _gf_mul(inv, x)
        b = inv
        s = b
        for k in range(1, 5):
            s ^= ((b << k) | (b >> (8 - k))) & 0xFF
        box.append(s ^ 0x63)
    return tuple(box)


def aes_round_keys(key: bytes) -> list[int]:
    """The 44 big-endian round-key words w[0..43] of AES-128 (FIPS-197 5.2)."""
    if len(key) != 16:
        raise ValueError(f"expected a 16-byte key, got {len(key)} bytes")
    sbox = aes_sbox()
    w = [int.from_bytes(key[4 * i : 4 * i + 4], "big") for i in range(4)]
    rcon = 1
    for i in range(4, 44):
        t = w[i - 1]
        if i % 4 == 0:
            t = ((t << 8) | (t >> 24)) & 0xFFFFFFFF
            t = int.from_bytes(bytes(sbox[b] for b in t.to_bytes(4, "big")), "big")
            t ^= rcon << 24
            rcon = _xtime(rcon)
        w.append(w[i - 4] ^ t)
    return w


@lru_cache(maxsize=1)
def aes_tables() -> np.ndarray:
    """T0..T3 (encryption T-tables, big-endian columns) followed by the S-box, as uint32."""
    sbox = aes_sbox()
    t0 = [(_gf_mul(s, 2) << 24) | (s << 16) | (s << 8) | _gf_mul(s, 3) for s in sbox]
    tabs = [t0] + [[((v >> r) | (v << (32 - r))) & 0xFFFFFFFF for v in t0] for r in (8, 16, 24)]
    return np.array([v for t in tabs for v in t] + list(sbox), dtype=np.uint32)


@lru_cache(maxsize=1)
def aes_inverse_sbox() -> tuple[int, ...]:
    inv = [0] * 256
    for x, y in enumerate(aes_sbox()):
        inv[y] = x
    return tuple(inv)


def _inv_mix_column(w: int) -> int:
    """InvMixColumns of one big-endian column word (FIPS-197 5.3.3)."""
    b = w.to_bytes(4, "big")
    rows = [(14, 11, 13, 9), (9, 14, 11, 13), (13, 9, 14, 11), (11, 13, 9, 14)]
    out = bytes(
        _gf_mul(b[0], r[0]) ^ _gf_mul(b[1], r[1]) ^ _gf_mul(b[2], r[2]) ^ _gf_mul(b[3], r[3]) for r in rows
    )
    return int.from_bytes(out, "big")


@lru_cache(maxsize=1)
def aes_inverse_tables() -> np.ndarray:
    """Td0..Td3 (decryption T-tables, big-endian columns) followed by the inverse S-box."""
    inv = aes_inverse_sbox()
    t0 = [
        (_gf_mul(s, 14) << 24) | (_gf_mul(s, 9) << 16) | (_gf_mul(s, 13) << 8) | _gf_mul(s, 11) for s in inv
    ]
    tabs = [t0] + [[((v >> r) | (v << (32 - r))) & 0xFFFFFFFF for v in t0] for r in (8, 16, 24)]
    return np.array([v for t in tabs for v in t] + list(inv), dtype=np.uint32)


def aes_decrypt_table(key: bytes) -> np.ndarray:
    """The int32 table of :func:`~ember.csprng.triton_kernels.crypt_kernel`'s ECB decryption.

    Round keys of the equivalent inverse cipher: the encryption round keys in reverse round order,
    InvMixColumns applied to rounds 1..9, the last round's words byte-swapped (little-endian).
    """
    rk = aes_round_keys(key)
    dk: list[int] = []
    for r in range(11):
        words = rk[4 * (10 - r) : 4 * (10 - r) + 4]
        dk += [_inv_mix_column(w) for w in words] if 0 < r < 10 else words
    dk = dk[:40] + [_bswap32(v) for v in dk[40:]]
    return np.concatenate([aes_inverse_tables(), np.array(dk, dtype=np.uint32)]).view(np.int32)


def _bswap32(v: int) -> int:
    return int.from_bytes(v.to_bytes(4, "big"), "little")


def cipher_table(cipher: str, key: bytes) -> np.ndarray:
    """The int32 table a kernel reads for ``cipher`` under ember key ``key``."""
    if cipher == "aes128":
        rk = aes_round_keys(key)
        rk = rk[:40] + [_bswap32(v) for v in rk[40:]]  # the last round writes little-endian words
        words = np.concatenate([aes_tables(), np.array(rk, dtype=np.uint32)])
    elif cipher == "chacha20":
        from .chacha import chacha_key

        words = np.frombuffer(chacha_key(key), dtype="<u4").astype(np.uint32)
    else:
        raise ValueError(f"no kernel for cipher {cipher!r}")
    return words.view(np.int32)


# ---------------------------------------------------------------------------- kernels
_KERNELS: dict[bool, ModuleType] = {}
_KERNELS_LOCK = threading.Lock()


def kernels(interpret: bool) -> ModuleType:
    """The triton_kernels module, compiled (``interpret=False``) or under Triton's interpreter."""
    with _KERNELS_LOCK:
        mod = _KERNELS.get(interpret)
        if mod is not None:
            return mod
        from . import triton_kernels

        if interpret == triton_kernels.INTERPRETED:
            mod = triton_kernels
        else:  # a second copy of the module, decorated in the other mode
            name = f"{__package__}._triton_kernels_{'interpreted' if interpret else 'compiled'}"
            spec = importlib.util.spec_from_file_location(name, triton_kernels.__file__)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load a second copy of {triton_kernels.__file__}")
            loader = spec.loader
            mod = importlib.util.module_from_spec(spec)
            old = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
            try:
                sys.modules[name] = mod
                loader.exec_module(mod)
            finally:
                if old is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = old
        _KERNELS[interpret] = mod
        return mod


@lru_cache(maxsize=32)
def _device_table(cipher: str, key: bytes, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(cipher_table(cipher, key)).to(device)


@lru_cache(maxsize=256)
def _rounded(x: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(x, dtype=dtype))


def _below(b: float, dtype: torch.dtype) -> float:
    t = torch.tensor(b, dtype=dtype)
    return float(torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype)))


def _compile_options(interpret: bool) -> dict[str, Any]:
    """Launch options: compiled kernels keep float multiplies and adds apart (no FMA), as the
    documented arithmetic requires; the interpreter takes no compile options."""
    return {} if interpret else {"enable_fp_fusion": False}


def _i64(v: int) -> int:
    v %= 1 << 64
    return v - (1 << 64) if v >= 1 << 63 else v


class _Launch:
    """Everything one kernel launch needs besides the cipher position."""

    def __init__(
        self,
        op: int,
        wb: int,
        mbits: int,
        f64: bool,
        fp: list[float],
        ip: list[int],
        flag: bool = False,
        flag2: bool = False,
        p: torch.Tensor | None = None,
    ) -> None:
        self.op, self.wb, self.mbits, self.f64 = op, wb, mbits, f64
        self.fp, self.ip, self.flag, self.flag2, self.p = fp, ip, flag, flag2, p
        self.bf16 = False


def launch(
    out: torch.Tensor,
    table: torch.Tensor,
    cipher: str,
    start: int,
    nunits: int,
    spec: _Launch,
    interpret: bool,
    rejects: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Run the fill kernel over draw units ``[0, nunits)`` starting at stream block ``start``."""
    k = kernels(interpret)
    # parameters travel as kernel scalars (float64 bit patterns, int64): no copy to the device
    fp = [_f64_bits(v) for v in spec.fp] + [0] * (4 - len(spec.fp))
    ip = [_i64(v) for v in spec.ip] + [0] * (3 - len(spec.ip))
    p = spec.p if spec.p is not None else table  # unused pointers: any device tensor
    cnt, pos = rejects if rejects is not None else (table, table)
    cap = pos.numel() if rejects is not None else 0
    if cipher == "aes128":
        first, skip, lanes, cid, block = start, 0, nunits, k.AES128, 256
    else:
        first, skip = divmod(start, 4)
        lanes, cid, block = -(-(skip + nunits) // 4), k.CHACHA20, 128
    c = [(first >> (32 * j)) & 0xFFFFFFFF for j in range(4)]
    grid = (-(-lanes // block),)
    extra = _compile_options(interpret)
    k.fill_kernel[grid](
        out,
        table,
        p,
        cnt,
        pos,
        *fp,
        *ip,
        *c,
        skip,
        out.numel(),
        lanes,
        cap,
        CIPHER=_code(cid),
        OP=_code(spec.op),
        WB=spec.wb,
        MBITS=spec.mbits,
        F64=spec.f64,
        FLAG=spec.flag,
        FLAG2=spec.flag2,
        VIA_F32=spec.bf16,
        BLOCK=block,
        **extra,
    )


def _code(c: Any) -> int:
    return int(getattr(c, "value", c))


# ---------------------------------------------------------------------------- fills
def triton_fill_(
    sampler: Any, tensor: torch.Tensor, method: str, params: tuple, interpret: bool | None = None
) -> bool:
    """Fill ``tensor`` like ``getattr(sampler, method)(tensor, *params)`` with the Triton kernels.

    Returns False (having done nothing) when the kernels do not handle this case: another sampler
    kind or cipher, an unsupported method, or a fill of more than ``MAX_LANES`` blocks.
    ``interpret`` defaults to True for CPU tensors (Triton's interpreter) and False otherwise.
    """
    if not isinstance(sampler, NativeSampler) or method not in SUPPORTED_METHODS:
        return False
    stream: BlockStream = sampler.stream
    if stream.cipher_name not in ("aes128", "chacha20") or tensor.is_complex():
        return False
    if interpret is None:
        interpret = tensor.device.type == "cpu"
    if method == "bernoulli_" and isinstance(params[0] if params else None, torch.Tensor):
        p = _bernoulli_p(tensor, params[0])
    else:
        p = None
        if not _default_args(method, params) or tensor.dtype not in _FLOAT_BITS:
            # the CPU sampler validates the arguments (same errors) and reserves nothing for 0
            # elements; default arguments on a float dtype need no check
            getattr(sampler, method)(torch.empty(0, dtype=tensor.dtype), *params)
    n = tensor.numel()
    if blocks_for(n * 8) > MAX_LANES:
        return False
    dst = (
        tensor
        if tensor.is_contiguous()
        else torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    )
    _FILLS[method](_Fill(stream, dst.view(-1), tuple(params), p, kernels(interpret)))
    if dst is not tensor:
        tensor.copy_(dst)
    return True


class _Fill:
    """One fill: the stream, the flat output, the call's parameters and the kernels to use."""

    def __init__(self, stream: BlockStream, flat: torch.Tensor, params: tuple, p: Any, k: ModuleType) -> None:
        self.stream, self.flat, self.params, self.p, self.k = stream, flat, params, p, k
        self.dtype = flat.dtype
        self.n = flat.numel()
        # what the kernel writes: bool as uint8, bfloat16 as int16 (the kernel rounds it)
        self.out = flat.view(
            {torch.bool: torch.uint8, torch.bfloat16: torch.int16}.get(flat.dtype, flat.dtype)
        )

    def arg(self, defaults: tuple) -> tuple:
        return tuple(self.params) + defaults[len(self.params) :]

    def run(
        self,
        start: int,
        nbytes: int,
        spec: _Launch,
        rejects: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        """Launch the fill kernel over the draw's ``nbytes`` into the output (or into ``out``)."""
        table = _device_table(self.stream.cipher_name, self.stream.key, self.out.device)
        spec.bf16 = self.dtype == torch.bfloat16 and out is None
        launch(
            self.out if out is None else out,
            table,
            self.stream.cipher_name,
            start,
            blocks_for(nbytes),
            spec,
            self.k.INTERPRETED,
            rejects,
        )


def _compute(dtype: torch.dtype) -> tuple[type, int, int]:
    """(compute type, word bytes, mantissa bits) of the transcendental transforms."""
    return (np.float64, 8, 53) if dtype == torch.float64 else (np.float32, 4, 24)


def _uniform(f: _Fill) -> None:
    a, b = (float(v) for v in f.arg((0.0, 1.0)))
    bits = _FLOAT_BITS[f.dtype]
    wb = {53: 8, 24: 4}.get(bits, 2)
    cd = np.float64 if f.dtype == torch.float64 else np.float32
    start = f.stream.reserve(blocks_for(f.n * wb))
    if f.n == 0:
        return
    lo = _rounded(a, f.dtype)
    if lo == _rounded(b, f.dtype) and not (a == 0.0 and b == 1.0):
        f.flat.fill_(lo)  # a and b are one value of the dtype: torch gives a (layout 4)
        return
    scale, shift = cd((b - a) * 2.0**-bits), cd(a)
    clamp = not (a == 0.0 and b == 1.0)
    spec = _Launch(
        f.k.UNIFORM,
        wb,
        bits,
        cd is np.float64,
        [float(scale), float(shift), _below(b, f.dtype) if clamp else 0.0],
        [],
        flag=bool(shift != 0),
        flag2=clamp,
    )
    f.run(start, f.n * wb, spec)
    if clamp and bits < 24:  # a float32 value >= a can round below a's own 16-bit rounding
        f.flat.clamp_(min=lo)


def _normal_family(log: bool):
    def fill(f: _Fill) -> None:
        mean, std = (float(v) for v in f.arg((1.0, 2.0) if log else (0.0, 1.0)))
        cd, wb, bits = _compute(f.dtype)
        pairs = (f.n + 1) // 2
        start = f.stream.reserve(blocks_for(pairs * 2 * wb))
        if f.n == 0:
            return
        k = f.k
        cipher = f.stream.cipher_name
        group = distributions.NORMAL_GROUP
        if cipher == "aes128":
            first, skip, cid, upb = start, 0, k.AES128, 1
        else:
            (first, skip), cid, upb = divmod(start, 4), k.CHACHA20, 4
        half = group * wb // (16 * upb)  # blocks from a radius word to its angle word
        assert half * 16 * upb == group * wb, "a group's halves must be whole cipher blocks"
        # one lane per block of radius words in the full groups, then one per pair of the last
        full_lanes = (pairs // group) * (half + (upb > 1))
        if k.INTERPRETED:  # the interpreter pays per program and per lane: as few of both as fit
            block = min(1024, 1 << max(4, (max(full_lanes, pairs % group) - 1).bit_length()))
        else:
            block = 256 if upb == 1 else 64
        full_programs = -(-full_lanes // block)
        grid = (full_programs + -(-(pairs % group) // block),)
        k.normal_fill_kernel[grid](
            f.out,
            _device_table(cipher, f.stream.key, f.out.device),
            *((first >> (32 * j)) & 0xFFFFFFFF for j in range(4)),
            skip,
            f.n,
            pairs,
            full_lanes,
            full_programs,
            _f64_bits(cd(2.0**-bits)),
            _f64_bits(cd(2.0 * math.pi * 2.0**-bits)),
            _f64_bits(cd(std)),
            _f64_bits(cd(mean)),
            CIPHER=_code(cid),
            GROUP=group,
            WB=wb,
            MBITS=bits,
            F64=cd is np.float64,
            AFFINE=not (mean == 0.0 and std == 1.0),
            LOG=log,
            BF16=f.dtype == torch.bfloat16,
            BLOCK=block,
            **_compile_options(k.INTERPRETED),
        )

    return fill


def _f64_bits(x: float) -> int:
    """The bit pattern of float64 ``x`` as a signed int64 (how kernels take float parameters)."""
    return int(np.array(float(x), dtype=np.float64).view(np.int64))


def _exponential(f: _Fill) -> None:
    (lambd,) = (float(v) for v in f.arg((1.0,)))
    cd, wb, bits = _compute(f.dtype)
    start = f.stream.reserve(blocks_for(f.n * wb))
    if f.n:
        spec = _Launch(
            f.k.EXPONENTIAL, wb, bits, cd is np.float64, [float(cd(2.0**-bits)), float(cd(-1.0 / lambd))], []
        )
        f.run(start, f.n * wb, spec)


def _cauchy(f: _Fill) -> None:
    median, sigma = (float(v) for v in f.arg((0.0, 1.0)))
    cd, wb, bits = _compute(f.dtype)
    bits -= 1  # k + 1/2 must stay exact: one bit fewer
    start = f.stream.reserve(blocks_for(f.n * wb))
    if f.n:
        spec = _Launch(
            f.k.CAUCHY,
            wb,
            bits,
            cd is np.float64,
            [float(cd(2.0**-bits)), float(cd(math.pi)), float(cd(sigma)), float(cd(median))],
            [],
        )
        f.run(start, f.n * wb, spec)


def _geometric(f: _Fill) -> None:
    prob = float(f.params[0])
    start = f.stream.reserve(blocks_for(f.n * 8))
    if f.n == 0:
        return
    if prob == 1.0:
        f.flat.fill_(1)
        return
    # the cap: the dtype's maximum for integers; int64's (2**63 - 1) is applied as an integer
    limit = math.inf if f.dtype.is_floating_point else float(torch.iinfo(f.dtype).max)
    f.run(
        start,
        f.n * 8,
        _Launch(f.k.GEOMETRIC, 8, 52, True, [math.log1p(-prob), limit], [], flag=f.dtype == torch.int64),
    )


def _random(f: _Fill) -> None:
    f.params = default_range(f.dtype)
    _random_range(f)


def _random_range(f: _Fill) -> None:
    low, high = int(f.params[0]), int(f.params[1])
    r = high - low
    wb = 8 if r > 1 << 32 else 4
    start = f.stream.reserve(blocks_for(f.n * wb))
    if f.n == 0:
        return
    if r & (r - 1) == 0:
        f.run(start, f.n * wb, _Launch(f.k.INTEGER, wb, 0, False, [], [_i64(r - 1), 0, _i64(low)], flag=True))
        return
    thresh = (1 << (8 * wb)) % r
    spec = _Launch(f.k.INTEGER, wb, 0, False, [], [_i64(r), _i64(thresh), _i64(low)])
    # rejected positions are listed, sorted and refilled on the device: nothing is read back
    cap = min(f.n, _reject_capacity(f.n, thresh, wb))
    dev = f.out.device
    cnt = torch.zeros(2, dtype=torch.int32, device=dev)  # [count, overflow flag]
    # unused slots hold the largest int64: they sort last
    pos = torch.full((cap,), (1 << 63) - 1, dtype=torch.int64, device=dev)
    f.run(start, f.n * wb, spec, (cnt, pos))
    _refill(f, start, spec, cnt, torch.sort(pos).values)
    # more rejections than room (beyond 8 standard deviations): fail loudly, never silently (on a
    # GPU a device-side assert that does not wait; on a CPU tensor it raises here)
    torch._assert_async(cnt[1] == 0, "ember.csprng: integer rejection list overflow")


def _reject_capacity(n: int, thresh: int, wb: int) -> int:
    """Room for rejected positions: the expected count plus 8 standard deviations and 64 (a fill
    that finds more fails, see :func:`_random_range`)."""
    expected = n * thresh / 2.0 ** (8 * wb)
    return int(expected + 8 * math.sqrt(expected) + 64)


def _refill(f: _Fill, start: int, spec: _Launch, cnt: torch.Tensor, pos: torch.Tensor) -> None:
    """Replace the rejected positions (``pos``, sorted; ``cnt[0]`` of them), in increasing order,
    from the draw's ``reject`` stream: one program of ``refill_kernel``, which reads the count on
    the device and sets ``cnt[1]`` when it exceeds ``pos``'s room."""
    k = f.k
    block = _refill_block(f.stream.cipher_name, k.INTERPRETED)
    k.refill_kernel[(1,)](
        f.out,
        _refill_table(f.stream, start, f.out.device),
        cnt,
        pos,
        *(_i64(v) for v in spec.ip),
        f.n,
        pos.numel(),
        CIPHER=_code(k.AES128 if f.stream.cipher_name == "aes128" else k.CHACHA20),
        WB=spec.wb,
        VIA_F32=f.dtype == torch.bfloat16,
        BLOCK=block,
        **_compile_options(k.INTERPRETED),
        **({} if k.INTERPRETED else {"num_warps": 8 if block >= 256 else 4}),
    )


def _refill_block(cipher: str, interpret: bool) -> int:
    """Lanes of the refill program (the pending list is walked in chunks of this many)."""
    if interpret:  # the interpreter's cost is per chunk and per lane: a middle size is fastest
        return 256
    return 1024 if cipher == "aes128" else 256


def _refill_table(stream: BlockStream, start: int, device: torch.device) -> torch.Tensor:
    """The cipher table of the ``reject`` stream of the draw that started at ``start`` (its key is
    derived per draw, so it is not cached). Built on the host; for a GPU copied from pinned memory
    without waiting (ordered on the current stream before the refill kernel; torch keeps the pinned
    buffer until the copy has run)."""
    table = torch.from_numpy(cipher_table(stream.cipher_name, derive_key(stream.key, "reject", start)))
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    return table


def _bernoulli(f: _Fill) -> None:
    start = f.stream.reserve(blocks_for(f.n * 8))
    if f.n == 0:
        return
    if f.p is not None:
        spec = _Launch(f.k.BERNOULLI, 8, 0, False, [], [], flag=True, p=f.p)
    else:
        (prob,) = (float(v) for v in f.arg((0.5,)))
        if prob in (0.0, 1.0):
            f.flat.fill_(prob == 1.0)
            return
        spec = _Launch(f.k.BERNOULLI, 8, 0, False, [], [_i64(math.floor(math.ldexp(prob, 64)))])
    f.run(start, f.n * 8, spec)


def _bernoulli_p(out: torch.Tensor, p: torch.Tensor, *, wait: bool = True) -> torch.Tensor:
    """``p`` as a contiguous float64 tensor of the output's shape on its device (validated).
    With ``wait=False`` the range of a CUDA ``p`` is checked on the device
    (``torch._assert_async``, as torch's own CUDA kernel asserts), without waiting for it."""
    if p.is_complex() or not (p.is_floating_point() or p.dtype == torch.bool):
        raise TypeError(f"bernoulli_: p must be a floating-point tensor, got {p.dtype}")
    try:
        pt = p.detach().to(out.device, torch.float64).expand(out.shape).contiguous().view(-1)
    except RuntimeError as exc:
        raise ValueError(
            f"bernoulli_: p of shape {tuple(p.shape)} does not broadcast "
            f"to the output shape {tuple(out.shape)}"
        ) from exc
    in_range = ((pt >= 0.0) & (pt <= 1.0)).all()
    if pt.is_cuda and not wait:
        torch._assert_async(in_range, "bernoulli_: expected all probabilities in [0, 1]")
    elif not bool(in_range):
        raise ValueError("bernoulli_: expected all probabilities in [0, 1]")
    return pt


# the Triton fill of each record with triton=True (ember.csprng.spec)
_IMPLEMENTS: dict[str, Callable[[_Fill], None]] = {
    "uniform_": _uniform,
    "normal_": _normal_family(log=False),
    "log_normal_": _normal_family(log=True),
    "exponential_": _exponential,
    "cauchy_": _cauchy,
    "geometric_": _geometric,
    "random_": _random,
    "random_range_": _random_range,
    "bernoulli_": _bernoulli,
}


def _fill_table(records: Sequence[spec.Distribution]) -> dict[str, Callable[[_Fill], None]]:
    """method -> Triton fill, for each of ``records`` with ``triton=True``; raises
    :class:`~ember.csprng.spec.RecordMismatch` naming a record whose fill this module lacks."""
    return spec.dispatch_table("ember.csprng.cuda_backend (Triton)",
                               {d.method: d for d in records if d.triton}, _IMPLEMENTS)


_FILLS = _fill_table(spec.DISTRIBUTIONS)


# ---------------------------------------------------------------------------- encrypt / decrypt
@lru_cache(maxsize=32)
def _crypt_table(key: bytes, decrypt: bool, device: torch.device) -> torch.Tensor:
    table = aes_decrypt_table(key) if decrypt else cipher_table("aes128", key)
    return torch.from_numpy(table).to(device)


def aes_crypt_(
    src: torch.Tensor,
    dst: torch.Tensor,
    key: bytes,
    mode: str,
    inverse: bool,
    interpret: bool,
    first_block: int = 0,
) -> None:
    """AES-128 over whole 16-byte blocks, on ``src``'s device: ``dst = E(src)`` (int32 words).

    ``mode`` is ``"ecb"`` (``inverse`` selects the decryption) or ``"ctr"`` (torchcsprng's counter
    block ``LE64(first_block + j) || 0^64`` for block ``j``; encryption and decryption are the same
    XOR). ``src`` and ``dst`` are contiguous int32 tensors of ``4 * nblocks`` words, which may be
    the same tensor. ``interpret`` runs Triton's interpreter (CPU tensors, for tests).
    """
    if src.dtype != torch.int32 or dst.dtype != torch.int32 or src.shape != dst.shape:
        raise ValueError("aes_crypt_: src and dst must be int32 tensors of the same shape")
    if src.device != dst.device or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("aes_crypt_: src and dst must be contiguous and on one device")
    if src.numel() % 4:
        raise ValueError("aes_crypt_: expected whole 16-byte blocks")
    nblocks = src.numel() // 4
    if nblocks == 0:
        return
    if not (first_block >= 0 and first_block + nblocks <= 1 << 64):
        raise ValueError("aes_crypt_: CTR block indices must stay below 2**64")
    k = kernels(interpret)
    decrypt = mode == "ecb" and inverse
    table = _crypt_table(key, decrypt, src.device)
    code = {"ecb": k.ECB_DECRYPT if decrypt else k.ECB_ENCRYPT, "ctr": k.CTR}[mode]
    block = 256
    extra = _compile_options(interpret)
    k.crypt_kernel[(-(-nblocks // block),)](
        src,
        dst,
        table,
        nblocks,
        first_block & 0xFFFFFFFF,
        first_block >> 32,
        MODE=_code(code),
        BLOCK=block,
        **extra,
    )


# ---------------------------------------------------------------------------- registration
def triton_available() -> bool:
    """Whether triton can be imported here."""
    return importlib.util.find_spec("triton") is not None


class CaptureError(RuntimeError):
    """A draw while a CUDA graph is being captured: a replay would repeat the same numbers."""


# sampler methods as a torch user calls them, for messages
_OP_NAMES = {d.method: d.op_name for d in spec.DISTRIBUTIONS}


def refuse_capture(op: str = "a draw") -> None:
    """Raise :class:`CaptureError`, naming ``op`` (a function or a sampler method), when the
    current CUDA stream is capturing a graph.

    The stream position is kept on the host: a captured draw would be replayed with the same
    counter, i.e. the same values, on every replay of the graph.
    """
    try:
        capturing = torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a torch built without CUDA
        capturing = False
    if capturing:
        raise CaptureError(
            f"ember.csprng: {_OP_NAMES.get(op, op)} cannot run while a CUDA graph is being "
            "captured (every replay would repeat the same random numbers); draw outside the "
            "captured region, e.g. into a static tensor before each replay")


def fast_path() -> str:
    """Which CUDA path fills: ``"nvrtc"`` (the CUDA C kernels), ``"triton"`` or ``"cpu"``.

    ``EMBER_CSPRNG_CUDA`` (``nvrtc``/``triton``/``cpu``) forces one; by default the first that is
    available in that order.
    """
    forced = os.environ.get("EMBER_CSPRNG_CUDA", "").lower()
    if forced in ("nvrtc", "triton", "cpu"):
        return forced
    if _FAST_BROKEN:
        return "triton" if triton_available() else "cpu"
    from . import nvrtc_kernels

    if nvrtc_kernels.available():
        return "nvrtc"
    return "triton" if triton_available() else "cpu"


_FAST_BROKEN: list[str] = []


def nvrtc_broken(exc: Exception, stacklevel: int) -> None:
    """An NVRTC kernel failed to compile or load (nothing was reserved yet).

    Forced (``EMBER_CSPRNG_CUDA=nvrtc``): raise, since a forced path that quietly ran another
    would mislead the test or benchmark that forced it. Otherwise: mark the path broken and warn
    once; the Triton path (else the CPU path) fills from now on.
    """
    if os.environ.get("EMBER_CSPRNG_CUDA", "").lower() == "nvrtc":
        raise RuntimeError(
            f"ember.csprng: EMBER_CSPRNG_CUDA=nvrtc forces the NVRTC path, which is unavailable "
            f"here ({exc}); unset EMBER_CSPRNG_CUDA or set it to triton or cpu") from exc
    _FAST_BROKEN.append(str(exc))
    import warnings

    fallback = "Triton" if triton_available() else "the CPU path"
    warnings.warn(f"ember.csprng: the NVRTC path is unavailable ({exc}); using {fallback}",
                  RuntimeWarning, stacklevel=stacklevel + 1)


def cuda_fill(sampler: Any, tensor: torch.Tensor, method: str, params: tuple) -> bool:
    """The ``"cuda"`` device backend: NVRTC kernels, else Triton kernels, else False (CPU path)."""
    refuse_capture(method)
    path = fast_path()
    if path == "nvrtc":
        from . import cuda_fast

        if cuda_fast.supports(sampler, tensor, method) and not tensor.is_complex():
            try:
                _fast_fill(sampler, tensor, method, params)
                return True
            except _LoadError as exc:
                nvrtc_broken(exc, stacklevel=3)
                path = fast_path()
    if path == "cpu" or not triton_available():
        return False
    return triton_fill_(sampler, tensor, method, params, interpret=False)


# the NVRTC methods' default arguments (with none given too), which need no check
_DEFAULTS = {d.method: ((), d.defaults) for d in spec.DISTRIBUTIONS
             if d.nvrtc and d.params and None not in d.defaults}


def _default_args(method: str, params: tuple) -> bool:
    """Whether ``params`` are ``method``'s default arguments (plain numbers: a tensor or NumPy
    argument is never taken for one, so it gets the CPU sampler's checks and errors)."""
    return all(type(p) in (int, float) for p in params) and params in _DEFAULTS.get(method, ())


class _LoadError(RuntimeError):
    pass


def _fast_fill(sampler: Any, tensor: torch.Tensor, method: str, params: tuple) -> None:
    from . import cuda_fast

    if tensor.is_cuda:
        try:  # compile and load before anything is reserved: a failure leaves the stream as it was
            cuda_fast.launcher().functions(tensor.device.index or 0,
                                           cuda_fast.kernel_names(sampler.stream.cipher_name, method))
        except Exception as exc:  # no cuda-bindings, no NVRTC for this GPU, no driver
            raise _LoadError(str(exc)) from exc
    if method == "bernoulli_" and params and isinstance(params[0], torch.Tensor):
        params = (_bernoulli_p(tensor, params[0], wait=False),)
    elif not _default_args(method, params):
        # the CPU sampler validates the arguments (same errors) and reserves nothing for 0 elements;
        # the default arguments need no check (the adapter has checked the dtype)
        getattr(sampler, method)(torch.empty(0, dtype=tensor.dtype), *params)
    if tensor.is_contiguous():
        cuda_fast.fast_fill_(sampler, tensor, method, params)
        return
    dst = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    cuda_fast.fast_fill_(sampler, dst, method, params)
    tensor.copy_(dst)


def register() -> None:
    from .torch_adapter import register_device_backend

    register_device_backend("cuda", cuda_fill)


register()
