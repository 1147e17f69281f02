"""Triton kernels for ember's native distributions: cipher blocks computed and transformed in registers.

One kernel, specialised at compile time on the cipher (AES-128 with T-tables, or ChaCha20), the
distribution and the word width, computes the counter blocks of a draw and writes the values of
docs/csprng-stream.md straight into the output tensor; the keystream never goes to global memory.
Rejected integer positions (Lemire) are appended to a small list that the host resolves.

This module imports triton; import it only through :mod:`ember.csprng.cuda_backend`. The host side
(round keys, tables, parameters) lives there too. When triton's interpreter is active at import
(``TRITON_INTERPRET=1``), the transcendental functions are ``tl.log``/``tl.sin``/... (NumPy in the
interpreter) and ``tan`` is ``sin / cos``; compiled, they are CUDA libdevice's accurate versions.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)

# op and cipher codes (the constexpr OP and CIPHER; kernels may only read constexpr globals)
UNIFORM = tl.constexpr(0)
NORMAL = tl.constexpr(1)
LOG_NORMAL = tl.constexpr(2)
EXPONENTIAL = tl.constexpr(3)
CAUCHY = tl.constexpr(4)
GEOMETRIC = tl.constexpr(5)
INTEGER = tl.constexpr(6)
BERNOULLI = tl.constexpr(7)
AES128 = tl.constexpr(0)
CHACHA20 = tl.constexpr(1)
# table layout (int32): T0..T3 (4 x 256), S-box (256), round keys (44)
SBOX_OFFSET = tl.constexpr(1024)
ROUND_KEY_OFFSET = tl.constexpr(1280)

if INTERPRETED:
    @triton.jit
    def _log(x):
        return tl.log(x)

    @triton.jit
    def _exp(x):
        return tl.exp(x)

    @triton.jit
    def _sin(x):
        return tl.sin(x)

    @triton.jit
    def _cos(x):
        return tl.cos(x)

    @triton.jit
    def _tan(x):
        # the interpreter has no tan; this differs from NumPy's tan by a few ulp (measured in tests)
        return tl.sin(x) / tl.cos(x)
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _log(x):
        return libdevice.log(x)

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _sin(x):
        return libdevice.sin(x)

    @triton.jit
    def _cos(x):
        return libdevice.cos(x)

    @triton.jit
    def _tan(x):
        return libdevice.tan(x)


# ---------------------------------------------------------------------------- ciphers
@triton.jit
def _add128(c0, c1, c2, c3, lane):
    """(c3:c2:c1:c0) + lane as four uint32 words, lowest first (lane < 2**32)."""
    w0 = c0 + lane
    k = (w0 < lane).to(tl.uint32)
    w1 = c1 + k
    k = k & (w1 == 0).to(tl.uint32)
    w2 = c2 + k
    k = k & (w2 == 0).to(tl.uint32)
    w3 = c3 + k
    return w0, w1, w2, w3


@triton.jit
def _t(tab_ptr, which: tl.constexpr, byte):
    return tl.load(tab_ptr + (which * 256 + byte.to(tl.int32))).to(tl.uint32, bitcast=True)


@triton.jit
def _sbox(tab_ptr, byte):
    return tl.load(tab_ptr + (SBOX_OFFSET + byte.to(tl.int32))).to(tl.uint32, bitcast=True)


@triton.jit
def _rk(tab_ptr, i: tl.constexpr):
    return tl.load(tab_ptr + (ROUND_KEY_OFFSET + i)).to(tl.uint32, bitcast=True)


@triton.jit
def _aes_round(tab_ptr, a, b, c, d, rk):
    return (_t(tab_ptr, 0, a >> 24) ^ _t(tab_ptr, 1, (b >> 16) & 255)
            ^ _t(tab_ptr, 2, (c >> 8) & 255) ^ _t(tab_ptr, 3, d & 255) ^ rk)


@triton.jit
def _aes_last(tab_ptr, a, b, c, d, rk_le):
    # output bytes in order, packed little-endian (rk_le is the byte-swapped round key)
    return (_sbox(tab_ptr, a >> 24) | (_sbox(tab_ptr, (b >> 16) & 255) << 8)
            | (_sbox(tab_ptr, (c >> 8) & 255) << 16) | (_sbox(tab_ptr, d & 255) << 24)) ^ rk_le


@triton.jit
def _aes_block(tab_ptr, i0, i1, i2, i3):
    """AES-128_K(BE128(i)) as four little-endian uint32 words (i0 the lowest counter word)."""
    # big-endian state columns: column 0 holds the most significant counter word
    s0 = i3 ^ _rk(tab_ptr, 0)
    s1 = i2 ^ _rk(tab_ptr, 1)
    s2 = i1 ^ _rk(tab_ptr, 2)
    s3 = i0 ^ _rk(tab_ptr, 3)
    for r in tl.static_range(1, 10):
        t0 = _aes_round(tab_ptr, s0, s1, s2, s3, _rk(tab_ptr, 4 * r))
        t1 = _aes_round(tab_ptr, s1, s2, s3, s0, _rk(tab_ptr, 4 * r + 1))
        t2 = _aes_round(tab_ptr, s2, s3, s0, s1, _rk(tab_ptr, 4 * r + 2))
        t3 = _aes_round(tab_ptr, s3, s0, s1, s2, _rk(tab_ptr, 4 * r + 3))
        s0, s1, s2, s3 = t0, t1, t2, t3
    o0 = _aes_last(tab_ptr, s0, s1, s2, s3, _rk(tab_ptr, 40))
    o1 = _aes_last(tab_ptr, s1, s2, s3, s0, _rk(tab_ptr, 41))
    o2 = _aes_last(tab_ptr, s2, s3, s0, s1, _rk(tab_ptr, 42))
    o3 = _aes_last(tab_ptr, s3, s0, s1, s2, _rk(tab_ptr, 43))
    return o0, o1, o2, o3


@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def _qr(a, b, c, d):
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _chacha_block(tab_ptr, q0, q1, q2, q3):
    """The 16 output words of ChaCha20 block q (words 12..15 = q, lowest first)."""
    zero = q0 * 0
    j0 = zero + 0x61707865  # "expand 32-byte k"
    j1 = zero + 0x3320646E
    j2 = zero + 0x79622D32
    j3 = zero + 0x6B206574
    j4 = zero + tl.load(tab_ptr + 0).to(tl.uint32, bitcast=True)
    j5 = zero + tl.load(tab_ptr + 1).to(tl.uint32, bitcast=True)
    j6 = zero + tl.load(tab_ptr + 2).to(tl.uint32, bitcast=True)
    j7 = zero + tl.load(tab_ptr + 3).to(tl.uint32, bitcast=True)
    j8 = zero + tl.load(tab_ptr + 4).to(tl.uint32, bitcast=True)
    j9 = zero + tl.load(tab_ptr + 5).to(tl.uint32, bitcast=True)
    j10 = zero + tl.load(tab_ptr + 6).to(tl.uint32, bitcast=True)
    j11 = zero + tl.load(tab_ptr + 7).to(tl.uint32, bitcast=True)
    x0, x1, x2, x3, x4, x5, x6, x7 = j0, j1, j2, j3, j4, j5, j6, j7
    x8, x9, x10, x11, x12, x13, x14, x15 = j8, j9, j10, j11, q0, q1, q2, q3
    for _ in range(10):
        x0, x4, x8, x12 = _qr(x0, x4, x8, x12)
        x1, x5, x9, x13 = _qr(x1, x5, x9, x13)
        x2, x6, x10, x14 = _qr(x2, x6, x10, x14)
        x3, x7, x11, x15 = _qr(x3, x7, x11, x15)
        x0, x5, x10, x15 = _qr(x0, x5, x10, x15)
        x1, x6, x11, x12 = _qr(x1, x6, x11, x12)
        x2, x7, x8, x13 = _qr(x2, x7, x8, x13)
        x3, x4, x9, x14 = _qr(x3, x4, x9, x14)
    return (x0 + j0, x1 + j1, x2 + j2, x3 + j3, x4 + j4, x5 + j5, x6 + j6, x7 + j7,
            x8 + j8, x9 + j9, x10 + j10, x11 + j11, x12 + q0, x13 + q1, x14 + q2, x15 + q3)


# ---------------------------------------------------------------------------- transforms
@triton.jit
def _param(fp_ptr, i: tl.constexpr, F64: tl.constexpr):
    v = tl.load(fp_ptr + i)
    if not F64:
        v = v.to(tl.float32)
    return v


@triton.jit
def _iparam(ip_ptr, i: tl.constexpr):
    return tl.load(ip_ptr + i).to(tl.uint64, bitcast=True)


@triton.jit
def _sqrt(x, F64: tl.constexpr):
    # correctly rounded in both precisions (float64 sqrt is sqrt.rn.f64 on CUDA)
    if F64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def _u64(lo, hi):
    return lo.to(tl.uint64) | (hi.to(tl.uint64) << 32)


@triton.jit
def _mask(w, MBITS: tl.constexpr):
    return w & ((1 << MBITS) - 1)


@triton.jit
def _to_float(k, F64: tl.constexpr):
    if F64:
        return k.to(tl.float64)
    else:
        return k.to(tl.float32)


@triton.jit
def _bf16_round(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), as a float32 value."""
    # explicit, so that compiled kernels and the interpreter (which truncates) agree
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_value(out_ptr, e, y, mask, BF16: tl.constexpr):
    if BF16:  # the output is viewed as int16; y is float32 already on the bfloat16 grid
        tl.store(out_ptr + e, (y.to(tl.uint32, bitcast=True) >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + e, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store(out_ptr, e, v, ok, n, BF16: tl.constexpr):
    if BF16:  # float64 values round through float32, as torch's copy to bfloat16 does
        v = _bf16_round(v.to(tl.float32))
    _store_value(out_ptr, e, v, ok & (e < n), BF16)


@triton.jit
def _mul64_hi(w, r):
    """High 64 bits of the 128-bit product of uint64 vectors/scalars w and r."""
    wl = w & 0xFFFFFFFF
    wh = w >> 32
    rl = r & 0xFFFFFFFF
    rh = r >> 32
    ll = wl * rl
    lh = wl * rh
    hl = wh * rl
    hh = wh * rh
    mid = (ll >> 32) + (lh & 0xFFFFFFFF) + (hl & 0xFFFFFFFF)
    return hh + (lh >> 32) + (hl >> 32) + (mid >> 32)


@triton.jit
def _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e, w, ok,
         OP: tl.constexpr, WB: tl.constexpr, MBITS: tl.constexpr, F64: tl.constexpr,
         FLAG: tl.constexpr, FLAG2: tl.constexpr, VIA_F32: tl.constexpr):
    """Value of element ``e`` from its word ``w`` (uint16-in-uint32, uint32 or uint64)."""
    if OP == UNIFORM:
        # FLAG: add the shift (a != 0); FLAG2: clamp below b
        x = _to_float(_mask(w, MBITS), F64) * _param(fp_ptr, 0, F64)
        if FLAG:
            x = x + _param(fp_ptr, 1, F64)
        if VIA_F32:
            y = _bf16_round(x)
        elif F64:
            y = x
        else:
            y = x.to(out_ptr.dtype.element_ty).to(tl.float32)  # exact round trip
        if FLAG2:
            hi = _param(fp_ptr, 2, F64)  # the largest output value below b (exact in T)
            y = tl.where(y > hi, hi, y)
        _store_value(out_ptr, e, y, ok & (e < n), VIA_F32)
    elif OP == EXPONENTIAL:
        u = (_to_float(_mask(w, MBITS), F64) + 1.0) * _param(fp_ptr, 0, F64)
        _store(out_ptr, e, _log(u) * _param(fp_ptr, 1, F64), ok, n, VIA_F32)
    elif OP == CAUCHY:
        u = (_to_float(_mask(w, MBITS), F64) + 0.5) * _param(fp_ptr, 0, F64)
        t = _tan((u - 0.5) * _param(fp_ptr, 1, F64))
        _store(out_ptr, e, t * _param(fp_ptr, 2, F64) + _param(fp_ptr, 3, F64), ok, n, VIA_F32)
    elif OP == GEOMETRIC:
        u = ((w & ((1 << 52) - 1)).to(tl.float64) + 0.5) * (2.0 ** -52)
        g = tl.ceil(_log(u) / tl.load(fp_ptr + 0))  # float64 division is IEEE (div.rn.f64)
        g = tl.minimum(g, tl.load(fp_ptr + 1))
        _store(out_ptr, e, g, ok, n, VIA_F32)
    elif OP == INTEGER:
        # FLAG: power-of-two range (mask); else Lemire with rejection of low < 2**W mod r
        r = _iparam(ip_ptr, 0)
        if FLAG:
            x = w.to(tl.uint64) & r
        else:
            if WB == 4:
                prod = w.to(tl.uint64) * r
                x = prod >> 32
                low = prod & 0xFFFFFFFF
            else:
                x = _mul64_hi(w, r)
                low = w * r
            bad = (low < _iparam(ip_ptr, 1)) & ok & (e < n)
            slot = tl.atomic_add(cnt_ptr + (e * 0).to(tl.int32), 1, mask=bad)
            tl.store(pos_ptr + slot, e, mask=bad & (slot < cap))
        v = (x + _iparam(ip_ptr, 2)).to(tl.int64, bitcast=True)
        _store(out_ptr, e, v, ok, n, VIA_F32)
    elif OP == BERNOULLI:
        # FLAG: per-element p (float64 tensor)
        if FLAG:
            p = tl.load(p_ptr + e, mask=ok & (e < n), other=0.0)
            ones = p >= 1.0
            thr = (tl.where(ones, 0.0, p) * 18446744073709551616.0).to(tl.uint64)
            v = (w < thr) | ones
        else:
            v = w < _iparam(ip_ptr, 0)
        _store(out_ptr, e, v.to(tl.int8), ok, n, VIA_F32)


@triton.jit
def _normal_pair(out_ptr, fp_ptr, n, e, wa, wb, ok, MBITS: tl.constexpr, F64: tl.constexpr,
                 AFFINE: tl.constexpr, LOG: tl.constexpr, BF16: tl.constexpr):
    """Elements e, e + 1 (Box-Muller) from words wa (radius) and wb (angle)."""
    u = _to_float(_mask(wa, MBITS) + 1, F64) * _param(fp_ptr, 0, F64)
    r = _sqrt(_log(u) * -2.0, F64)
    t = _to_float(_mask(wb, MBITS), F64) * _param(fp_ptr, 1, F64)
    z0 = r * _cos(t)
    z1 = r * _sin(t)
    if AFFINE:
        z0 = z0 * _param(fp_ptr, 2, F64) + _param(fp_ptr, 3, F64)
        z1 = z1 * _param(fp_ptr, 2, F64) + _param(fp_ptr, 3, F64)
    if LOG:
        z0 = _exp(z0)
        z1 = _exp(z1)
    _store(out_ptr, e, z0, ok, n, BF16)
    _store(out_ptr, e + 1, z1, ok, n, BF16)


@triton.jit
def _emit(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, d, ok, w0, w1, w2, w3,
          OP: tl.constexpr, WB: tl.constexpr, MBITS: tl.constexpr, F64: tl.constexpr,
          FLAG: tl.constexpr, FLAG2: tl.constexpr, VIA_F32: tl.constexpr):
    """All elements of draw unit ``d`` (16 bytes: little-endian words w0..w3)."""
    if OP == NORMAL or OP == LOG_NORMAL:  # noqa: SIM109 (constexpr comparison in a kernel)
        if WB == 4:
            _normal_pair(out_ptr, fp_ptr, n, 4 * d, w0, w1, ok, MBITS, F64, FLAG,
                         OP == LOG_NORMAL, VIA_F32)
            _normal_pair(out_ptr, fp_ptr, n, 4 * d + 2, w2, w3, ok, MBITS, F64, FLAG,
                         OP == LOG_NORMAL, VIA_F32)
        else:
            _normal_pair(out_ptr, fp_ptr, n, 2 * d, _u64(w0, w1), _u64(w2, w3), ok, MBITS, F64,
                         FLAG, OP == LOG_NORMAL, VIA_F32)
    elif WB == 2:
        e = 8 * d
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e, w0 & 0xFFFF, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 1, w0 >> 16, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 2, w1 & 0xFFFF, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 3, w1 >> 16, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 4, w2 & 0xFFFF, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 5, w2 >> 16, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 6, w3 & 0xFFFF, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 7, w3 >> 16, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
    elif WB == 4:
        e = 4 * d
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e, w0, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 1, w1, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 2, w2, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 3, w3, ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
    else:
        e = 2 * d
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e, _u64(w0, w1), ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _one(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, e + 1, _u64(w2, w3), ok,
             OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)


@triton.jit(do_not_specialize=["c0", "c1", "c2", "c3", "skip", "n", "nlanes", "cap"])
def fill_kernel(out_ptr, tab_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr,
                c0, c1, c2, c3, skip, n, nlanes, cap,
                CIPHER: tl.constexpr, OP: tl.constexpr, WB: tl.constexpr, MBITS: tl.constexpr,
                F64: tl.constexpr, FLAG: tl.constexpr, FLAG2: tl.constexpr,
                VIA_F32: tl.constexpr, BLOCK: tl.constexpr):
    """Fill elements ``[0, n)`` of a draw whose first cipher block is (c3:c2:c1:c0).

    AES: lane ``l`` computes block ``c + l`` = draw unit ``l``. ChaCha20: lane ``l`` computes ChaCha
    block ``c + l``, whose four units are draw units ``4l - skip .. 4l + 3 - skip``.
    """
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = lane < nlanes
    i0, i1, i2, i3 = _add128(c0.to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32),
                             c3.to(tl.uint32), lane.to(tl.uint32))
    if CIPHER == AES128:
        w0, w1, w2, w3 = _aes_block(tab_ptr, i0, i1, i2, i3)
        _emit(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, lane, live,
              w0, w1, w2, w3, OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
    else:
        (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14,
         x15) = _chacha_block(tab_ptr, i0, i1, i2, i3)
        d = 4 * lane - skip
        _emit(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, d, live & (d >= 0),
              x0, x1, x2, x3, OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _emit(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, d + 1, live & (d >= -1),
              x4, x5, x6, x7, OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _emit(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, d + 2, live & (d >= -2),
              x8, x9, x10, x11, OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
        _emit(out_ptr, fp_ptr, ip_ptr, p_ptr, cnt_ptr, pos_ptr, cap, n, d + 3, live & (d >= -3),
              x12, x13, x14, x15, OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)
