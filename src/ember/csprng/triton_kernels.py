"""Triton kernels for ember's native distributions: cipher blocks computed and transformed in registers.

One kernel, specialised at compile time on the cipher (AES-128 with T-tables, or ChaCha20), the
distribution and the word width, computes the counter blocks of a draw and writes the values of
docs/csprng-stream.md straight into the output tensor; the keystream never goes to global memory.
A program's blocks are one [lanes, words per block] tile: one contiguous, coalesced store.
normal/log_normal, whose pairs take words half a group apart, have their own kernel,
:func:`normal_fill_kernel`: a lane computes the cipher blocks of both words of its pairs and does
Box-Muller in registers (one launch, no buffer of words).
Rejected integer positions (Lemire) are appended to a list on the device, which the host sorts
there; :func:`refill_kernel` (one program) then refills them round by round from the draw's
``reject`` stream, so the host never waits for the count.

This module imports triton; import it only through :mod:`ember.csprng.cuda_backend`. The host side
(round keys, tables, parameters) lives there too. When triton's interpreter is active at import
(``TRITON_INTERPRET=1``), the transcendental functions are ``tl.log``/``tl.sin``/... (NumPy in the
interpreter; ``tan`` calls ``np.tan`` directly); compiled, they are CUDA libdevice's accurate versions.

Float32 outputs evaluate ``log``, ``exp``, ``sin``, ``cos`` and ``tan`` in float64 and round the
result to float32 (every other step is float32 arithmetic, as in docs/csprng-stream.md): a float32
function correctly rounded except in about one case in 2^28. So the compiled kernel and the
interpreter agree with each other, and their distance from the CPU path is NumPy's float32 error,
which the tests measure under the interpreter (docs/csprng-stream.md, "CUDA").

:func:`crypt_kernel` is AES-128 over data blocks (ECB encrypt/decrypt, torchcsprng's CTR), for
``ember.csprng.crypt`` on CUDA tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

# fmt: off
# (dense kernel code: long argument lists stay packed, one call per line)
INTERPRETED = bool(knobs.runtime.interpret)

# op and cipher codes (the constexpr OP and CIPHER; kernels may only read constexpr globals)
UNIFORM = tl.constexpr(0)
# 1 and 2 were normal and log_normal, which normal_fill_kernel computes now
EXPONENTIAL = tl.constexpr(3)
CAUCHY = tl.constexpr(4)
GEOMETRIC = tl.constexpr(5)
INTEGER = tl.constexpr(6)
BERNOULLI = tl.constexpr(7)
AES128 = tl.constexpr(0)
CHACHA20 = tl.constexpr(1)
ECB_ENCRYPT = tl.constexpr(0)
ECB_DECRYPT = tl.constexpr(1)
CTR = tl.constexpr(2)
# table layout (int32): T0..T3 (4 x 256), S-box (256), round keys (44); for decryption the inverse
# tables, the inverse S-box and the equivalent-inverse-cipher round keys in the same places
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

    try:
        import numpy as _np
        from triton.runtime.interpreter import TensorHandle as _TensorHandle

        def _tan(x):
            # the interpreter has no tan; the kernel body is plain Python here, so call NumPy's
            return tl.tensor(_TensorHandle(_np.tan(x.handle.data), x.handle.dtype.scalar), x.type)
    except ImportError:  # a triton without this interpreter internal: tan as sin / cos
        @triton.jit
        def _tan(x):
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
def _rkd(tab_ptr, i):
    """Round-key word ``i`` for a run-time ``i`` (inside the rounds loop)."""
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
def _aes_encrypt(tab_ptr, s0, s1, s2, s3):
    """AES-128 of the block whose big-endian columns are s0..s3; output as little-endian words."""
    s0 = s0 ^ _rk(tab_ptr, 0)
    s1 = s1 ^ _rk(tab_ptr, 1)
    s2 = s2 ^ _rk(tab_ptr, 2)
    s3 = s3 ^ _rk(tab_ptr, 3)
    # a loop, not tl.static_range: unrolled, the 360 chained table loads made Triton's coalescing
    # pass take 20 s per kernel; the loop compiles in under a second with the same work per block
    for r in range(1, 10):
        t0 = _aes_round(tab_ptr, s0, s1, s2, s3, _rkd(tab_ptr, 4 * r))
        t1 = _aes_round(tab_ptr, s1, s2, s3, s0, _rkd(tab_ptr, 4 * r + 1))
        t2 = _aes_round(tab_ptr, s2, s3, s0, s1, _rkd(tab_ptr, 4 * r + 2))
        t3 = _aes_round(tab_ptr, s3, s0, s1, s2, _rkd(tab_ptr, 4 * r + 3))
        s0, s1, s2, s3 = t0, t1, t2, t3
    o0 = _aes_last(tab_ptr, s0, s1, s2, s3, _rk(tab_ptr, 40))
    o1 = _aes_last(tab_ptr, s1, s2, s3, s0, _rk(tab_ptr, 41))
    o2 = _aes_last(tab_ptr, s2, s3, s0, s1, _rk(tab_ptr, 42))
    o3 = _aes_last(tab_ptr, s3, s0, s1, s2, _rk(tab_ptr, 43))
    return o0, o1, o2, o3


@triton.jit
def _aes_decrypt(tab_ptr, s0, s1, s2, s3):
    """Inverse AES-128 (equivalent inverse cipher, FIPS-197 5.3.5) with the decryption table."""
    s0 = s0 ^ _rk(tab_ptr, 0)
    s1 = s1 ^ _rk(tab_ptr, 1)
    s2 = s2 ^ _rk(tab_ptr, 2)
    s3 = s3 ^ _rk(tab_ptr, 3)
    for r in range(1, 10):  # a loop, as in _aes_encrypt
        t0 = _aes_round(tab_ptr, s0, s3, s2, s1, _rkd(tab_ptr, 4 * r))
        t1 = _aes_round(tab_ptr, s1, s0, s3, s2, _rkd(tab_ptr, 4 * r + 1))
        t2 = _aes_round(tab_ptr, s2, s1, s0, s3, _rkd(tab_ptr, 4 * r + 2))
        t3 = _aes_round(tab_ptr, s3, s2, s1, s0, _rkd(tab_ptr, 4 * r + 3))
        s0, s1, s2, s3 = t0, t1, t2, t3
    o0 = _aes_last(tab_ptr, s0, s3, s2, s1, _rk(tab_ptr, 40))
    o1 = _aes_last(tab_ptr, s1, s0, s3, s2, _rk(tab_ptr, 41))
    o2 = _aes_last(tab_ptr, s2, s1, s0, s3, _rk(tab_ptr, 42))
    o3 = _aes_last(tab_ptr, s3, s2, s1, s0, _rk(tab_ptr, 43))
    return o0, o1, o2, o3


@triton.jit
def _aes_block(tab_ptr, i0, i1, i2, i3):
    """AES-128_K(BE128(i)) as four little-endian uint32 words (i0 the lowest counter word)."""
    # big-endian state columns: column 0 holds the most significant counter word
    return _aes_encrypt(tab_ptr, i3, i2, i1, i0)


@triton.jit
def _bswap(x):
    """Byte-reverse uint32 words (little-endian data word <-> big-endian AES column)."""
    return (x << 24) | ((x & 0xFF00) << 8) | ((x >> 8) & 0xFF00) | (x >> 24)


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
def _sqrt(x, F64: tl.constexpr):
    # correctly rounded in both precisions (float64 sqrt is sqrt.rn.f64 on CUDA)
    if F64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def _log_t(x, F64: tl.constexpr):
    """log in the compute type: float64 as is; float32 through float64, rounded once."""
    if F64:
        y = _log(x)
    else:
        y = _log(x.to(tl.float64)).to(tl.float32)
    return y


@triton.jit
def _exp_t(x, F64: tl.constexpr):
    if F64:
        y = _exp(x)
    else:
        y = _exp(x.to(tl.float64)).to(tl.float32)
    return y


@triton.jit
def _sin_t(x, F64: tl.constexpr):
    if F64:
        y = _sin(x)
    else:
        y = _sin(x.to(tl.float64)).to(tl.float32)
    return y


@triton.jit
def _cos_t(x, F64: tl.constexpr):
    if F64:
        y = _cos(x)
    else:
        y = _cos(x.to(tl.float64)).to(tl.float32)
    return y


@triton.jit
def _tan_t(x, F64: tl.constexpr):
    if F64:
        y = _tan(x)
    else:
        y = _tan(x.to(tl.float64)).to(tl.float32)
    return y


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
def _lemire(w, r, thresh, WB: tl.constexpr):
    """(floor(w * r / 2**m), whether ``w`` is rejected: (w * r) mod 2**m < thresh), m = 8 * WB."""
    if WB == 4:
        prod = w.to(tl.uint64) * r
        x = prod >> 32
        low = prod & 0xFFFFFFFF
    else:
        x = _mul64_hi(w, r)
        low = w * r
    return x, low < thresh


@triton.jit
def _one(out_ptr, fa, fb, fc, fd, ia, ib, ic, p_ptr, cnt_ptr, pos_ptr, cap, n, e, w, ok,
         OP: tl.constexpr, WB: tl.constexpr, MBITS: tl.constexpr, F64: tl.constexpr,
         FLAG: tl.constexpr, FLAG2: tl.constexpr, VIA_F32: tl.constexpr):
    """Value of element ``e`` from its word ``w`` (uint16-in-uint32, uint32 or uint64)."""
    if OP == UNIFORM:
        # FLAG: add the shift (a != 0); FLAG2: clamp below b
        x = _to_float(_mask(w, MBITS), F64) * _fparam(fa, F64)
        if FLAG:
            x = x + _fparam(fb, F64)
        if VIA_F32:
            y = _bf16_round(x)
        elif F64:
            y = x
        else:
            y = x.to(out_ptr.dtype.element_ty).to(tl.float32)  # exact round trip
        if FLAG2:
            hi = _fparam(fc, F64)  # the largest output value below b (exact in T)
            y = tl.where(y > hi, hi, y)
        _store_value(out_ptr, e, y, ok & (e < n), VIA_F32)
    elif OP == EXPONENTIAL:
        u = (_to_float(_mask(w, MBITS), F64) + 1.0) * _fparam(fa, F64)
        lg = _log_t(u, F64)  # at most -eps/2 of the compute type, as torch (stream layout 4)
        if F64:
            lg = tl.minimum(lg, -1.1102230246251565e-16)
        else:
            lg = tl.minimum(lg, -5.9604644775390625e-08)
        _store(out_ptr, e, lg * _fparam(fb, F64), ok, n, VIA_F32)
    elif OP == CAUCHY:
        u = (_to_float(_mask(w, MBITS), F64) + 0.5) * _fparam(fa, F64)
        t = _tan_t((u - 0.5) * _fparam(fb, F64), F64)
        _store(out_ptr, e, t * _fparam(fc, F64) + _fparam(fd, F64), ok, n, VIA_F32)
    elif OP == GEOMETRIC:
        u = ((w & ((1 << 52) - 1)).to(tl.float64) + 0.5) * (2.0 ** -52)
        g = tl.ceil(_log(u) / _fparam(fa, True))  # float64 division is IEEE (div.rn.f64)
        if FLAG:  # int64 output: 2**63 has no int64 (nor has 2**63 - 1 a float64): cap by hand
            gi = tl.minimum(g, 9223372036854774784.0).to(tl.int64)  # 2**63 - 1024 converts
            gi = tl.where(g >= 9223372036854775808.0, 9223372036854775807, gi)
            _store(out_ptr, e, gi, ok, n, VIA_F32)
        else:
            g = tl.minimum(g, _fparam(fb, True))
            _store(out_ptr, e, g, ok, n, VIA_F32)
    elif OP == INTEGER:
        # FLAG: power-of-two range (mask); else Lemire with rejection of low < 2**W mod r
        r = _uparam(ia)
        if FLAG:
            x = w.to(tl.uint64) & r
        else:
            x, bad = _lemire(w, r, _uparam(ib), WB)
            bad = bad & ok & (e < n)
            # one atomic per program reserves its slots (e, w: the [lanes, words] tile of the
            # program); the order in the list does not matter, the host sorts it
            b = bad.to(tl.int32)
            rows = tl.reduce(b, 1, _add)
            first = tl.atomic_add(cnt_ptr, tl.reduce(rows, 0, _add))
            slot = (first + (tl.associative_scan(rows, 0, _add) - rows))[:, None]
            slot = slot + (tl.associative_scan(b, 1, _add) - b)
            tl.store(pos_ptr + slot, e, mask=bad & (slot < cap))
        v = (x + _uparam(ic)).to(tl.int64, bitcast=True)
        _store(out_ptr, e, v, ok, n, VIA_F32)
    elif OP == BERNOULLI:
        # FLAG: per-element p (float64 tensor)
        if FLAG:
            p = tl.load(p_ptr + e, mask=ok & (e < n), other=0.0)
            ones = p >= 1.0
            thr = (tl.where(ones, 0.0, p) * 18446744073709551616.0).to(tl.uint64)
            v = (w < thr) | ones
        else:
            v = w < _uparam(ia)
        _store(out_ptr, e, v.to(tl.int8), ok, n, VIA_F32)


@triton.jit
def _fparam(bits, F64: tl.constexpr):
    """A float parameter passed as the int64 bit pattern of a float64 (Python floats would be
    typed float32); float32 parameters are float32 values, so the conversion is exact."""
    v = bits.to(tl.uint64).to(tl.float64, bitcast=True)  # a value cast: as well for the
    # interpreter's int32/uint32 scalars as for the int64 of compiled kernels
    if not F64:
        v = v.to(tl.float32)
    return v


@triton.jit
def _uparam(bits):
    """An unsigned 64-bit parameter passed as a signed int64 scalar."""
    return bits.to(tl.uint64)


@triton.jit
def _cat(x, y):
    """Rows of x and y interleaved column by column: [B, k] and [B, k] -> [B, 2k]
    (column 2i from x, 2i + 1 from y); vectors [B] give [B, 2]."""
    z = tl.join(x, y)
    return tl.reshape(z, (z.shape[0], z.numel // z.shape[0]))


@triton.jit
def _row4(a, b, c, d):
    """Four [B] vectors as the columns of a [B, 4] tensor, in order."""
    return _cat(_cat(a, c), _cat(b, d))


@triton.jit
def _row16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """Sixteen [B] vectors as the columns of a [B, 16] tensor, in order."""
    return _cat(_cat(_row4(x0, x4, x8, x12), _row4(x2, x6, x10, x14)),
                _cat(_row4(x1, x5, x9, x13), _row4(x3, x7, x11, x15)))


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _block_words(tab_ptr, c0, c1, c2, c3, blk, CIPHER: tl.constexpr, WB: tl.constexpr):
    """The words of cipher block ``c + blk`` (``blk`` a [B] vector below 2**32) as a [B, k]
    tensor: k = 4 (AES) or 16 (ChaCha20) uint32 words, or half as many uint64 words (WB == 8)."""
    i0, i1, i2, i3 = _add128(c0.to(tl.uint32), c1.to(tl.uint32), c2.to(tl.uint32),
                             c3.to(tl.uint32), blk.to(tl.uint32))
    if CIPHER == AES128:
        w0, w1, w2, w3 = _aes_block(tab_ptr, i0, i1, i2, i3)
        if WB == 8:
            words = _cat(_u64(w0, w1), _u64(w2, w3))
        else:
            words = _row4(w0, w1, w2, w3)
    else:
        (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14,
         x15) = _chacha_block(tab_ptr, i0, i1, i2, i3)
        if WB == 8:
            words = _cat(_row4(_u64(x0, x1), _u64(x4, x5), _u64(x8, x9), _u64(x12, x13)),
                         _row4(_u64(x2, x3), _u64(x6, x7), _u64(x10, x11), _u64(x14, x15)))
        else:
            words = _row16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    return words


@triton.jit
def _box_muller(wa, wb, su, st, std, mean, MBITS: tl.constexpr, F64: tl.constexpr,
                AFFINE: tl.constexpr, LOG: tl.constexpr):
    """The (cosine, sine) values of pairs with radius words ``wa`` and angle words ``wb``."""
    u = _to_float(_mask(wa, MBITS) + 1, F64) * su
    r = _sqrt(_log_t(u, F64) * -2.0, F64)
    t = _to_float(_mask(wb, MBITS), F64) * st
    z0 = r * _cos_t(t, F64)
    z1 = r * _sin_t(t, F64)
    if AFFINE:
        z0 = z0 * std + mean
        z1 = z1 * std + mean
    if LOG:
        z0 = _exp_t(z0, F64)
        z1 = _exp_t(z1, F64)
    return z0, z1


@triton.jit(do_not_specialize=["c0", "c1", "c2", "c3", "skip", "n", "pairs", "full_lanes",
                               "full_programs", "su", "st", "std", "mean"])
def normal_fill_kernel(out_ptr, tab_ptr, c0: tl.int64, c1: tl.int64, c2: tl.int64, c3: tl.int64,
                       skip: tl.int64, n: tl.int64, pairs: tl.int64, full_lanes: tl.int64,
                       full_programs: tl.int64, su: tl.int64, st: tl.int64, std: tl.int64,
                       mean: tl.int64, CIPHER: tl.constexpr, GROUP: tl.constexpr,
                       WB: tl.constexpr, MBITS: tl.constexpr, F64: tl.constexpr,
                       AFFINE: tl.constexpr, LOG: tl.constexpr, BF16: tl.constexpr,
                       BLOCK: tl.constexpr):
    """normal/log_normal: the ``n`` values of a draw whose first cipher block is (c3:c2:c1:c0)
    (ChaCha20: whose first unit is unit ``skip`` of that block), Box-Muller included.

    Pairs come in groups of GROUP (docs/csprng-stream.md): pair ``i`` of a group of ``q`` pairs
    starting at word ``base`` takes words ``base + i`` (radius) and ``base + q + i`` (angle) and
    gives elements ``base + i`` (cosine) and ``base + q + i`` (sine). The first ``full_programs``
    programs cover the full groups, one lane per cipher block of radius words: the angle words of
    a full group lie ``GROUP * WB`` bytes (a whole number of blocks) later, at the same place in
    their block, so a lane computes two blocks and the values of all the radius words in the first.
    The other programs cover the last, shorter group (if any), one lane per pair: its angle words
    are not aligned to blocks, so a lane computes the block of each of its two words.
    ``su``, ``st``, ``std``, ``mean`` are float64 bit patterns (see :func:`_fparam`).
    """
    UPB: tl.constexpr = 1 if CIPHER == AES128 else 4  # 16-byte units per cipher block
    WPB: tl.constexpr = UPB * (16 // WB)  # words per cipher block
    HALF: tl.constexpr = GROUP * WB // (16 * UPB)  # blocks from a radius word to its angle word
    su = _fparam(su, F64)
    st = _fparam(st, F64)
    std = _fparam(std, F64)
    mean = _fparam(mean, F64)
    pid = tl.program_id(0).to(tl.int64)
    lanes: tl.constexpr = HALF if CIPHER == AES128 else HALF + 1  # blocks with a group's radii
    # the two cipher blocks of each lane (radius, angle), computed as one vector of 2 * BLOCK
    if pid < full_programs:
        t = pid * BLOCK + tl.arange(0, BLOCK)
        g = t // lanes
        rblk = (skip + 2 * g * GROUP * WB // 16) // UPB + (t - g * lanes)
        ablk = rblk + HALF
    else:
        base = (pairs // GROUP) * GROUP
        i = (pid - full_programs) * BLOCK + tl.arange(0, BLOCK)
        # word e is word (skip * 16 / WB + e) % WPB of block (skip * 16 / WB + e) // WPB
        p0 = skip * (16 // WB) + 2 * base + i
        rblk = p0 // WPB
        ablk = (p0 + (pairs - base)) // WPB
    both = _block_words(tab_ptr, c0, c1, c2, c3, tl.reshape(tl.join(rblk, ablk), (2 * BLOCK,)),
                        CIPHER, WB)
    ra, an = tl.split(tl.permute(tl.reshape(both, (BLOCK, 2, WPB)), (0, 2, 1)))
    col = tl.arange(0, WPB)[None, :]
    if pid < full_programs:
        t = pid * BLOCK + tl.arange(0, BLOCK)
        g = t // lanes
        e = (rblk * WPB - skip * (16 // WB))[:, None] + col  # word = element index
        lo = (2 * g * GROUP)[:, None]
        ok = (t < full_lanes)[:, None] & (e >= lo) & (e < lo + GROUP)
        z0, z1 = _box_muller(ra, an, su, st, std, mean, MBITS, F64, AFFINE, LOG)
        _store(out_ptr, e, z0, ok, n, BF16)
        _store(out_ptr, e + GROUP, z1, ok, n, BF16)
    else:
        # (names apart from the branch above: Triton types a name across both branches)
        base = (pairs // GROUP) * GROUP
        q = pairs - base
        i = (pid - full_programs) * BLOCK + tl.arange(0, BLOCK)
        e0 = 2 * base + i
        p0 = skip * (16 // WB) + e0
        wa = tl.reduce(tl.where(col == (p0 % WPB)[:, None], ra, 0), 1, _or)
        wb = tl.reduce(tl.where(col == ((p0 + q) % WPB)[:, None], an, 0), 1, _or)
        y0, y1 = _box_muller(wa, wb, su, st, std, mean, MBITS, F64, AFFINE, LOG)
        _store(out_ptr, e0, y0, i < q, n, BF16)
        _store(out_ptr, e0 + q, y1, i < q, n, BF16)


@triton.jit(do_not_specialize=["fa", "fb", "fc", "fd", "ia", "ib", "ic", "c0", "c1", "c2", "c3",
                               "skip", "n", "nlanes", "cap"])
def fill_kernel(out_ptr, tab_ptr, p_ptr, cnt_ptr, pos_ptr, fa: tl.int64, fb: tl.int64,
                fc: tl.int64, fd: tl.int64, ia: tl.int64, ib: tl.int64, ic: tl.int64,
                c0: tl.int64, c1: tl.int64, c2: tl.int64, c3: tl.int64, skip: tl.int64,
                n: tl.int64, nlanes: tl.int64, cap: tl.int64,
                CIPHER: tl.constexpr, OP: tl.constexpr, WB: tl.constexpr, MBITS: tl.constexpr,
                F64: tl.constexpr, FLAG: tl.constexpr, FLAG2: tl.constexpr,
                VIA_F32: tl.constexpr, BLOCK: tl.constexpr):
    """Fill elements ``[0, n)`` of a draw whose first cipher block is (c3:c2:c1:c0).

    Lane ``l`` computes cipher block ``c + l``: AES, draw unit ``l``; ChaCha20, the four units
    ``4l - skip .. 4l + 3 - skip``. The words of a program's blocks form one [BLOCK, words per
    block] tile, row ``l`` holding elements ``l * words - skip * words per unit`` onwards: the
    program's elements are one contiguous range, transformed and stored as one tile (stores of
    consecutive lanes are adjacent, i.e. coalesced, instead of a block's width apart).
    """
    UPB: tl.constexpr = 1 if CIPHER == AES128 else 4  # 16-byte units per cipher block
    WPU: tl.constexpr = 16 // WB  # words per unit
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    words = _block_words(tab_ptr, c0, c1, c2, c3, lane, CIPHER, WB)  # 32-bit words unless WB == 8
    if WB == 2:  # each 32-bit word holds two 16-bit words, the low half first
        words = _cat(words & 0xFFFF, words >> 16)
    e = (lane * (UPB * WPU) - skip * WPU)[:, None] + tl.arange(0, UPB * WPU)[None, :]
    ok = (lane < nlanes)[:, None] & (e >= 0)
    _one(out_ptr, fa, fb, fc, fd, ia, ib, ic, p_ptr, cnt_ptr, pos_ptr, cap, n, e, words, ok,
         OP, WB, MBITS, F64, FLAG, FLAG2, VIA_F32)


@triton.jit(do_not_specialize=["ia", "ib", "ic", "n", "cap"])
def refill_kernel(out_ptr, tab_ptr, cnt_ptr, pos_ptr, ia: tl.int64, ib: tl.int64, ic: tl.int64,
                  n: tl.int64, cap: tl.int64, CIPHER: tl.constexpr, WB: tl.constexpr,
                  VIA_F32: tl.constexpr, BLOCK: tl.constexpr):
    """Refill the rejected elements of a Lemire draw (docs/csprng-stream.md, integers); ONE program.

    ``cnt_ptr[0]`` counts the rejected positions, which are ``pos_ptr[0 .. count)`` in increasing
    order (the fill kernel listed them, the host sorted the list on the device). ``tab_ptr`` is the
    table of the draw's ``reject`` stream (derived key, counter 0). Round after round, pending
    element ``i`` takes word ``i`` of the round, the round starting at the next whole 16-byte unit
    of that stream; accepted values are written, the still rejected positions are compacted in
    order at the front of the list (an exclusive ``tl.cumsum``), until none is left. A count above
    ``cap`` (the list overflowed) sets ``cnt_ptr[1]`` and refills nothing: the host asserts on it.
    ``ia``, ``ib``, ``ic``: r, 2**m mod r and the low end, as in :func:`fill_kernel`.
    """
    UPB: tl.constexpr = 1 if CIPHER == AES128 else 4  # 16-byte units per cipher block
    WPU: tl.constexpr = 16 // WB  # words per unit
    WPB: tl.constexpr = UPB * WPU  # words per cipher block
    count = tl.load(cnt_ptr).to(tl.int64)
    over = count > cap
    tl.store(cnt_ptr + 1, over.to(tl.int32))
    m = tl.where(over, 0, count)  # pending elements
    zero = m * 0
    start = zero  # first unit of this round in the reject stream
    col = tl.arange(0, WPB)[None, :]
    while m > 0:
        kept = zero  # rejected again, compacted in order at the front of the list
        for s in range(0, m, BLOCK):
            i = s + tl.arange(0, BLOCK).to(tl.int64)
            live = i < m
            e = tl.load(pos_ptr + i, mask=live, other=0)
            g = start * WPU + i  # word index in the reject stream
            words = _block_words(tab_ptr, zero, zero, zero, zero, g // WPB, CIPHER, WB)
            w = tl.reduce(tl.where(col == (g % WPB)[:, None], words, 0), 1, _or)
            x, again = _lemire(w, _uparam(ia), _uparam(ib), WB)
            again = again & live
            tl.debug_barrier()  # every lane has read its position before the list is rewritten
            _store(out_ptr, e, (x + _uparam(ic)).to(tl.int64, bitcast=True), live & ~again, n, VIA_F32)
            a = again.to(tl.int32)
            # (tl.cumsum and tl.sum are jit functions of triton's own, decorated when triton was
            # imported, i.e. possibly not for the interpreter: the builtin scan and reduce here)
            tl.store(pos_ptr + kept + (tl.associative_scan(a, 0, _add) - a), e, mask=again)
            kept += tl.reduce(a, 0, _add).to(tl.int64)
            tl.debug_barrier()  # the compacted list is complete before the next round reads it
        start += (m * WB + 15) // 16
        m = kept


# ---------------------------------------------------------------------------- encrypt / decrypt
@triton.jit(do_not_specialize=["nblocks", "f0", "f1"])
def crypt_kernel(in_ptr, out_ptr, tab_ptr, nblocks, f0, f1, MODE: tl.constexpr,
                 BLOCK: tl.constexpr):
    """AES-128 over ``nblocks`` 16-byte blocks of int32 words (little-endian data bytes).

    ECB_ENCRYPT / ECB_DECRYPT transform each input block (the decryption needs the inverse table);
    CTR XORs block ``j`` with AES(LE64(f + j) || 0^64), torchcsprng's counter block, where
    ``f = f1 * 2**32 + f0`` is the first block's index (0 for a whole message).
    """
    lane = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = lane < nblocks
    base = lane * 4
    x0 = tl.load(in_ptr + base, mask=live, other=0).to(tl.uint32, bitcast=True)
    x1 = tl.load(in_ptr + base + 1, mask=live, other=0).to(tl.uint32, bitcast=True)
    x2 = tl.load(in_ptr + base + 2, mask=live, other=0).to(tl.uint32, bitcast=True)
    x3 = tl.load(in_ptr + base + 3, mask=live, other=0).to(tl.uint32, bitcast=True)
    if MODE == CTR:
        zero = x0 * 0
        i0, i1, _, _ = _add128(f0.to(tl.uint32), f1.to(tl.uint32), zero, zero,
                               (lane & 0xFFFFFFFF).to(tl.uint32))
        i1 = i1 + (lane >> 32).to(tl.uint32)
        k0, k1, k2, k3 = _aes_encrypt(tab_ptr, _bswap(i0), _bswap(i1), zero, zero)
        y0, y1, y2, y3 = x0 ^ k0, x1 ^ k1, x2 ^ k2, x3 ^ k3
    elif MODE == ECB_ENCRYPT:
        y0, y1, y2, y3 = _aes_encrypt(tab_ptr, _bswap(x0), _bswap(x1), _bswap(x2), _bswap(x3))
    else:
        y0, y1, y2, y3 = _aes_decrypt(tab_ptr, _bswap(x0), _bswap(x1), _bswap(x2), _bswap(x3))
    tl.store(out_ptr + base, y0.to(tl.int32, bitcast=True), mask=live)
    tl.store(out_ptr + base + 1, y1.to(tl.int32, bitcast=True), mask=live)
    tl.store(out_ptr + base + 2, y2.to(tl.int32, bitcast=True), mask=live)
    tl.store(out_ptr + base + 3, y3.to(tl.int32, bitcast=True), mask=live)
# fmt: on
