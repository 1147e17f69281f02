// ember.csprng fast CUDA path: AES-128 and ChaCha20 counter-mode keystream fused with the fills.
// Compiled at run time by NVRTC (ember/csprng/nvrtc_kernels.py); the layout of every value is
// docs/csprng-stream.md, the arithmetic that of the Triton kernels (triton_kernels.py): float32
// transcendental functions in float64, rounded once; no FMA (compiled with --fmad=false).
// The host replaces @T0@ with the 256 words of the AES T-table T0.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define NT 256
#define GROUP 16384

// output kinds
#define K_F32 0
#define K_F64 1
#define K_F16 2
#define K_BF16 3
#define K_I64 4
#define K_I32 5
#define K_I16 6
#define K_I8 7
#define K_U8 8

// flags
#define F_SHIFT 1
#define F_CLAMP 2
#define F_POW2 4
#define F_PTENSOR 8
#define F_AFFINE 16
#define F_LOG 32
#define F_ALIGNED 64
#define F_F64 128

#define C_AES 0
#define C_CHACHA 1

struct Params {
    u32 key[44];      // AES: round keys (last round byte-swapped); ChaCha20: the 8 key words
    u32 ctr[4];       // AES: first stream block of the draw; ChaCha20: first ChaCha block (c >> 2)
    i64 n;            // elements
    i64 nunits;       // 16-byte draw units (elementwise ops)
    i64 pairs;        // normal: pairs
    u64 ip[3];
    double fp[4];
    void* out;
    const double* p;
    int* cnt;
    i64* pos;
    int* err;
    int skip;         // ChaCha20: c & 3
    int wb;           // word bytes: 2, 4, 8
    int mbits;
    int kind;
    int flags;
    int cap;
};

__device__ const u32 T0G[256] = {@T0@};

__device__ __forceinline__ u32 ror32(u32 x, int r) { return __funnelshift_r(x, x, r); }
__device__ __forceinline__ u32 rotl32(u32 x, int r) { return __funnelshift_l(x, x, r); }

// ------------------------------------------------------------------------------------------ AES
// T0 replicated in all 32 shared-memory banks: lane l reads copy l, so lookups never conflict.
typedef u32 Tab[256][32];

__device__ __forceinline__ void load_table(Tab& tab) {
    for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) tab[i >> 5][i & 31] = T0G[i >> 5];
    __syncthreads();
}

__device__ __forceinline__ u32 sb(const Tab& tab, int lane, u32 x) { return (tab[x][lane] >> 8) & 255u; }

__device__ __forceinline__ void aes_block(const Params& P, const Tab& tab, u32 i0, u32 i1, u32 i2, u32 i3,
                                          u32* w) {
    const int lane = threadIdx.x & 31;
    // big-endian state columns: column 0 holds the most significant counter word
    u32 s0 = i3 ^ P.key[0], s1 = i2 ^ P.key[1], s2 = i1 ^ P.key[2], s3 = i0 ^ P.key[3];
#pragma unroll
    for (int r = 1; r < 10; ++r) {
        u32 t0 = tab[s0 >> 24][lane] ^ ror32(tab[(s1 >> 16) & 255][lane], 8) ^
                 ror32(tab[(s2 >> 8) & 255][lane], 16) ^ ror32(tab[s3 & 255][lane], 24) ^ P.key[4 * r];
        u32 t1 = tab[s1 >> 24][lane] ^ ror32(tab[(s2 >> 16) & 255][lane], 8) ^
                 ror32(tab[(s3 >> 8) & 255][lane], 16) ^ ror32(tab[s0 & 255][lane], 24) ^ P.key[4 * r + 1];
        u32 t2 = tab[s2 >> 24][lane] ^ ror32(tab[(s3 >> 16) & 255][lane], 8) ^
                 ror32(tab[(s0 >> 8) & 255][lane], 16) ^ ror32(tab[s1 & 255][lane], 24) ^ P.key[4 * r + 2];
        u32 t3 = tab[s3 >> 24][lane] ^ ror32(tab[(s0 >> 16) & 255][lane], 8) ^
                 ror32(tab[(s1 >> 8) & 255][lane], 16) ^ ror32(tab[s2 & 255][lane], 24) ^ P.key[4 * r + 3];
        s0 = t0; s1 = t1; s2 = t2; s3 = t3;
    }
    // last round: output bytes in order, packed little-endian (the round key is byte-swapped)
    w[0] = (sb(tab, lane, s0 >> 24) | (sb(tab, lane, (s1 >> 16) & 255) << 8) |
            (sb(tab, lane, (s2 >> 8) & 255) << 16) | (sb(tab, lane, s3 & 255) << 24)) ^ P.key[40];
    w[1] = (sb(tab, lane, s1 >> 24) | (sb(tab, lane, (s2 >> 16) & 255) << 8) |
            (sb(tab, lane, (s3 >> 8) & 255) << 16) | (sb(tab, lane, s0 & 255) << 24)) ^ P.key[41];
    w[2] = (sb(tab, lane, s2 >> 24) | (sb(tab, lane, (s3 >> 16) & 255) << 8) |
            (sb(tab, lane, (s0 >> 8) & 255) << 16) | (sb(tab, lane, s1 & 255) << 24)) ^ P.key[42];
    w[3] = (sb(tab, lane, s3 >> 24) | (sb(tab, lane, (s0 >> 16) & 255) << 8) |
            (sb(tab, lane, (s1 >> 8) & 255) << 16) | (sb(tab, lane, s2 & 255) << 24)) ^ P.key[43];
}

// (c3:c2:c1:c0) + d, lowest word first
__device__ __forceinline__ void add128(const u32* c, u64 d, u32& i0, u32& i1, u32& i2, u32& i3) {
    u64 lo = ((u64)c[1] << 32) | c[0];
    u64 s = lo + d;
    u64 hi = (((u64)c[3] << 32) | c[2]) + (s < lo ? 1ull : 0ull);
    i0 = (u32)s; i1 = (u32)(s >> 32); i2 = (u32)hi; i3 = (u32)(hi >> 32);
}

__device__ __forceinline__ void aes_unit(const Params& P, const Tab& tab, i64 d, u32* w) {
    u32 i0, i1, i2, i3;
    add128(P.ctr, (u64)d, i0, i1, i2, i3);
    aes_block(P, tab, i0, i1, i2, i3, w);
}

// ------------------------------------------------------------------------------------- ChaCha20
#define QR(a, b, c, d)                         \
    a += b; d = rotl32(d ^ a, 16);             \
    c += d; b = rotl32(b ^ c, 12);             \
    a += b; d = rotl32(d ^ a, 8);              \
    c += d; b = rotl32(b ^ c, 7);

// the 16 output words of ChaCha20 block (first + b)
__device__ __forceinline__ void chacha_block(const Params& P, u64 b, u32* o) {
    u32 q0, q1, q2, q3;
    add128(P.ctr, b, q0, q1, q2, q3);
    u32 j[16] = {0x61707865u, 0x3320646Eu, 0x79622D32u, 0x6B206574u, P.key[0], P.key[1], P.key[2], P.key[3],
                 P.key[4], P.key[5], P.key[6], P.key[7], q0, q1, q2, q3};
    u32 x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) x[i] = j[i];
#pragma unroll 2
    for (int r = 0; r < 10; ++r) {
        QR(x[0], x[4], x[8], x[12]) QR(x[1], x[5], x[9], x[13]) QR(x[2], x[6], x[10], x[14])
        QR(x[3], x[7], x[11], x[15]) QR(x[0], x[5], x[10], x[15]) QR(x[1], x[6], x[11], x[12])
        QR(x[2], x[7], x[8], x[13]) QR(x[3], x[4], x[9], x[14])
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) o[i] = x[i] + j[i];
}

// draw unit d alone (ChaCha20: the whole block is computed; for tails and refills only)
__device__ __forceinline__ void chacha_unit(const Params& P, i64 d, u32* w) {
    u64 s = (u64)P.skip + (u64)d;
    u32 o[16];
    chacha_block(P, s >> 2, o);
    int part = (int)(s & 3);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 v = o[k];
        if (part == 1) v = o[4 + k];
        if (part == 2) v = o[8 + k];
        if (part == 3) v = o[12 + k];
        w[k] = v;
    }
}

template <int C>
__device__ __forceinline__ void unit_at(const Params& P, const Tab* tab, i64 d, u32* w) {
    if (C == C_AES) aes_unit(P, *tab, d, w);
    else chacha_unit(P, d, w);
}

// ------------------------------------------------------------------------------------ stores
#ifdef EMBER_HOST_EMULATION  // the tests compile this file as C++ for the CPU (emulation.cpp)
__device__ __forceinline__ unsigned short f2h(float x) { return host_f2h(x); }
__device__ __forceinline__ float h2f(unsigned short h) { return host_h2f(h); }
#else
__device__ __forceinline__ unsigned short f2h(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ float h2f(unsigned short h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}
#endif
// float32 rounded to the nearest bfloat16 (ties to even), as float32 (no NaN reaches here)
__device__ __forceinline__ float bf16_round(float x) {
    u32 b = __float_as_uint(x);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    return __uint_as_float(b);
}

__device__ __forceinline__ void store_f(const Params& P, i64 e, float v) {
    switch (P.kind) {
    case K_F32: ((float*)P.out)[e] = v; break;
    case K_F16: ((unsigned short*)P.out)[e] = f2h(v); break;
    case K_BF16: ((unsigned short*)P.out)[e] = (unsigned short)(__float_as_uint(bf16_round(v)) >> 16); break;
    default: break;
    }
}

__device__ __forceinline__ void store_d(const Params& P, i64 e, double v) { ((double*)P.out)[e] = v; }

__device__ __forceinline__ void store_i(const Params& P, i64 e, i64 v) {
    switch (P.kind) {
    case K_I64: ((i64*)P.out)[e] = v; break;
    case K_I32: ((int*)P.out)[e] = (int)v; break;
    case K_I16: ((short*)P.out)[e] = (short)v; break;
    case K_I8: ((signed char*)P.out)[e] = (signed char)v; break;
    case K_U8: ((unsigned char*)P.out)[e] = (unsigned char)v; break;
    case K_F32: ((float*)P.out)[e] = __ll2float_rn(v); break;
    case K_F64: ((double*)P.out)[e] = __ll2double_rn(v); break;
    case K_F16: ((unsigned short*)P.out)[e] = f2h(__ll2float_rn(v)); break;
    case K_BF16: ((unsigned short*)P.out)[e] = (unsigned short)(__float_as_uint(bf16_round(__ll2float_rn(v))) >> 16); break;
    default: break;
    }
}

// four float32 values at e .. e+3 (one 16-byte store when the output allows it)
__device__ __forceinline__ void store_f4(const Params& P, i64 e, const float* v) {
    if (P.kind == K_F32 && (P.flags & F_ALIGNED) && e + 4 <= P.n) {
        *(float4*)((float*)P.out + e) = make_float4(v[0], v[1], v[2], v[3]);
        return;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k)
        if (e + k < P.n) store_f(P, e + k, v[k]);
}

__device__ __forceinline__ void store_d2(const Params& P, i64 e, const double* v) {
    if ((P.flags & F_ALIGNED) && e + 2 <= P.n) {
        *(double2*)((double*)P.out + e) = make_double2(v[0], v[1]);
        return;
    }
#pragma unroll
    for (int k = 0; k < 2; ++k)
        if (e + k < P.n) store_d(P, e + k, v[k]);
}

// ------------------------------------------------------------------------------ value of a word
__device__ __forceinline__ u64 word64(const u32* w, int k) { return (u64)w[2 * k] | ((u64)w[2 * k + 1] << 32); }

__device__ __forceinline__ float log_f(float x) { return (float)log((double)x); }
__device__ __forceinline__ float exp_f(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float sin_f(float x) { return (float)sin((double)x); }
__device__ __forceinline__ float cos_f(float x) { return (float)cos((double)x); }

#define OP_UNIFORM 0
#define OP_EXPONENTIAL 3
#define OP_INTEGER 6
#define OP_BERNOULLI 7

__device__ __forceinline__ float uniform_f(const Params& P, u32 k) {
    float x = __uint2float_rn(k & ((1u << P.mbits) - 1u)) * (float)P.fp[0];
    if (P.flags & F_SHIFT) x = __fadd_rn(x, (float)P.fp[1]);
    float y = x;
    if (P.kind == K_F16) y = h2f(f2h(x));
    else if (P.kind == K_BF16) y = bf16_round(x);
    if (P.flags & F_CLAMP) {
        float hi = (float)P.fp[2];
        y = y > hi ? hi : y;
    }
    return y;
}

__device__ __forceinline__ double uniform_d(const Params& P, u64 k) {
    double x = __ull2double_rn(k & ((1ull << 53) - 1ull)) * P.fp[0];
    if (P.flags & F_SHIFT) x = __dadd_rn(x, P.fp[1]);
    if (P.flags & F_CLAMP) x = x > P.fp[2] ? P.fp[2] : x;
    return x;
}

// The transcendental helpers are not inlined (smaller kernels, faster compiles) and take their
// constants by value: a reference to the kernel's Params would make it copied to local memory.
__device__ __noinline__ float exponential_fv(u32 k, u32 mask, float f0, float f1) {
    float u = __fmul_rn(__fadd_rn(__uint2float_rn(k & mask), 1.0f), f0);
    return __fmul_rn(log_f(u), f1);
}

__device__ __noinline__ double exponential_dv(u64 k, double f0, double f1) {
    double u = __dmul_rn(__dadd_rn(__ull2double_rn(k & ((1ull << 53) - 1ull)), 1.0), f0);
    return __dmul_rn(log(u), f1);
}

__device__ __forceinline__ float exponential_f(const Params& P, u32 k) {
    return exponential_fv(k, (1u << P.mbits) - 1u, (float)P.fp[0], (float)P.fp[1]);
}

__device__ __forceinline__ double exponential_d(const Params& P, u64 k) {
    return exponential_dv(k, P.fp[0], P.fp[1]);
}

// Lemire (or a mask for power-of-two ranges); records rejected elements
__device__ __forceinline__ i64 integer_v(const Params& P, u64 w, i64 e, bool live) {
    u64 x;
    if (P.flags & F_POW2) {
        x = w & P.ip[0];
    } else {
        bool bad;
        if (P.wb == 4) {
            u64 prod = w * P.ip[0];
            x = prod >> 32;
            bad = (u32)prod < (u32)P.ip[1];
        } else {
            x = __umul64hi(w, P.ip[0]);
            bad = w * P.ip[0] < P.ip[1];
        }
        if (bad && live) {
            int slot = atomicAdd(P.cnt, 1);
            if (slot < P.cap) P.pos[slot] = e;
        }
    }
    return (i64)(x + P.ip[2]);
}

__device__ __forceinline__ i64 bernoulli_v(const Params& P, u64 w, i64 e) {
    if (P.flags & F_PTENSOR) {
        double p = P.p[e];
        bool ones = p >= 1.0;
        u64 thr = __double2ull_rz((ones ? 0.0 : p) * 18446744073709551616.0);
        return (w < thr || ones) ? 1 : 0;
    }
    return w < P.ip[0] ? 1 : 0;
}

// all elements of draw unit d
template <int OP>
__device__ __forceinline__ void emit(const Params& P, i64 d, const u32* w) {
    if (OP == OP_UNIFORM) {
        if (P.wb == 8) {
            double v[2] = {uniform_d(P, word64(w, 0)), uniform_d(P, word64(w, 1))};
            store_d2(P, 2 * d, v);
        } else if (P.wb == 4) {
            float v[4] = {uniform_f(P, w[0]), uniform_f(P, w[1]), uniform_f(P, w[2]), uniform_f(P, w[3])};
            store_f4(P, 4 * d, v);
        } else {
            i64 e = 8 * d;
#pragma unroll
            for (int k = 0; k < 8; ++k)
                if (e + k < P.n) store_f(P, e + k, uniform_f(P, (w[k >> 1] >> (16 * (k & 1))) & 0xFFFFu));
        }
    } else if (OP == OP_EXPONENTIAL) {
        if (P.wb == 8) {
            double v[2] = {exponential_d(P, word64(w, 0)), exponential_d(P, word64(w, 1))};
            store_d2(P, 2 * d, v);
        } else {
            float v[4] = {exponential_f(P, w[0]), exponential_f(P, w[1]), exponential_f(P, w[2]),
                          exponential_f(P, w[3])};
            store_f4(P, 4 * d, v);
        }
    } else if (OP == OP_INTEGER) {
        if (P.wb == 8) {
            i64 e = 2 * d;
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                i64 v = integer_v(P, word64(w, k), e + k, e + k < P.n);
                if (e + k < P.n) store_i(P, e + k, v);
            }
        } else {
            i64 e = 4 * d;
            if (P.kind == K_I64 && (P.flags & F_ALIGNED) && e + 4 <= P.n) {
                i64 v[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) v[k] = integer_v(P, w[k], e + k, true);
                longlong2* o = (longlong2*)((i64*)P.out + e);
                o[0] = make_longlong2(v[0], v[1]);
                o[1] = make_longlong2(v[2], v[3]);
            } else {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    i64 v = integer_v(P, w[k], e + k, e + k < P.n);
                    if (e + k < P.n) store_i(P, e + k, v);
                }
            }
        }
    } else if (OP == OP_BERNOULLI) {
        i64 e = 2 * d;
#pragma unroll
        for (int k = 0; k < 2; ++k)
            if (e + k < P.n) store_i(P, e + k, bernoulli_v(P, word64(w, k), e + k));
    }
}

// ---------------------------------------------------------------------------- elementwise fills
template <int OP>
__device__ __forceinline__ void fill_aes(const Params& P) {
    __shared__ Tab tab;
    load_table(tab);
    for (i64 d = (i64)blockIdx.x * NT + threadIdx.x; d < P.nunits; d += (i64)gridDim.x * NT) {
        u32 w[4];
        aes_unit(P, tab, d, w);
        emit<OP>(P, d, w);
    }
}

// ChaCha20: each thread computes one 64-byte block into a shared tile, then consecutive threads
// take consecutive 16-byte units, so that the stores of a warp are contiguous
template <int OP>
__device__ __forceinline__ void fill_chacha(const Params& P) {
    __shared__ uint4 tile[4 * NT];
    const i64 tiles = (P.nunits + P.skip + 4 * NT - 1) / (4 * NT);
    for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        u32 o[16];
        chacha_block(P, (u64)(t * NT + threadIdx.x), o);
#pragma unroll
        for (int k = 0; k < 4; ++k) tile[4 * threadIdx.x + k] = make_uint4(o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            int u = k * NT + threadIdx.x;
            i64 d = t * 4 * NT + u - P.skip;
            if (d >= 0 && d < P.nunits) {
                uint4 q = tile[u];
                u32 w[4] = {q.x, q.y, q.z, q.w};
                emit<OP>(P, d, w);
            }
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------- Box-Muller
__device__ __noinline__ float2 pair_fv(u32 kr, u32 ka, u32 mask, float f0, float f1, float f2, float f3,
                                        int flags) {
    float u = __fmul_rn(__uint2float_rn((kr & mask) + 1u), f0);
    float r = __fsqrt_rn(__fmul_rn(log_f(u), -2.0f));
    float t = __fmul_rn(__uint2float_rn(ka & mask), f1);
    float z0 = __fmul_rn(r, cos_f(t));
    float z1 = __fmul_rn(r, sin_f(t));
    if (flags & F_AFFINE) {
        z0 = __fadd_rn(__fmul_rn(z0, f2), f3);
        z1 = __fadd_rn(__fmul_rn(z1, f2), f3);
    }
    if (flags & F_LOG) {
        z0 = exp_f(z0);
        z1 = exp_f(z1);
    }
    return make_float2(z0, z1);
}

__device__ __noinline__ double2 pair_dv(u64 kr, u64 ka, double f0, double f1, double f2, double f3, int flags) {
    const u64 mask = (1ull << 53) - 1ull;
    double u = __dmul_rn(__ull2double_rn((kr & mask) + 1ull), f0);
    double r = __dsqrt_rn(__dmul_rn(log(u), -2.0));
    double t = __dmul_rn(__ull2double_rn(ka & mask), f1);
    double z0 = __dmul_rn(r, cos(t));
    double z1 = __dmul_rn(r, sin(t));
    if (flags & F_AFFINE) {
        z0 = __dadd_rn(__dmul_rn(z0, f2), f3);
        z1 = __dadd_rn(__dmul_rn(z1, f2), f3);
    }
    if (flags & F_LOG) {
        z0 = exp(z0);
        z1 = exp(z1);
    }
    return make_double2(z0, z1);
}

__device__ __forceinline__ void pair_f(const Params& P, u32 kr, u32 ka, float& z0, float& z1) {
    float2 z = pair_fv(kr, ka, (1u << P.mbits) - 1u, (float)P.fp[0], (float)P.fp[1], (float)P.fp[2],
                       (float)P.fp[3], P.flags);
    z0 = z.x;
    z1 = z.y;
}

__device__ __forceinline__ void pair_d(const Params& P, u64 kr, u64 ka, double& z0, double& z1) {
    double2 z = pair_dv(kr, ka, P.fp[0], P.fp[1], P.fp[2], P.fp[3], P.flags);
    z0 = z.x;
    z1 = z.y;
}

// A full group: radius unit d (words d*wpu ..) pairs with angle unit d + off; cosines go to the
// elements of unit d, sines to those of unit d + off.
__device__ __forceinline__ void normal_units(const Params& P, i64 d, i64 off, const u32* wr, const u32* wa) {
    if (P.flags & F_F64) {
        double c[2], s[2];
        pair_d(P, word64(wr, 0), word64(wa, 0), c[0], s[0]);
        pair_d(P, word64(wr, 1), word64(wa, 1), c[1], s[1]);
        store_d2(P, 2 * d, c);
        store_d2(P, 2 * (d + off), s);
    } else {
        float c[4], s[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) pair_f(P, wr[k], wa[k], c[k], s[k]);
        store_f4(P, 4 * d, c);
        store_f4(P, 4 * (d + off), s);
    }
}

// the word with index i of the draw (wb 4 or 8), computing its unit alone
template <int C>
__device__ __forceinline__ u64 word_at(const Params& P, const Tab* tab, i64 i) {
    int wpu = 16 / P.wb;
    u32 w[4];
    unit_at<C>(P, tab, i / wpu, w);
    int k = (int)(i % wpu);
    if (P.wb == 8) return k ? word64(w, 1) : word64(w, 0);
    u32 v = w[0];
    if (k == 1) v = w[1];
    if (k == 2) v = w[2];
    if (k == 3) v = w[3];
    return v;
}

template <int C>
__device__ __forceinline__ void normal_body(const Params& P, const Tab* tab, i64 block, i64 nblocks) {
    const int wpu = 16 / P.wb;
    const i64 full = P.pairs / GROUP;
    const i64 off = GROUP / wpu;  // units per half group
    const i64 stride = nblocks * NT;
    const i64 first = block * NT + threadIdx.x;
    if (C == C_AES) {
        for (i64 t = first; t < full * off; t += stride) {
            i64 d = (t / off) * 2 * off + t % off;
            u32 wr[4], wa[4];
            aes_unit(P, *tab, d, wr);
            aes_unit(P, *tab, d + off, wa);
            normal_units(P, d, off, wr, wa);
        }
    } else {
        // one ChaCha20 block of radius units and the block off/4 later (the same units' angles)
        const i64 nb = off / 4 + 1;
        for (i64 t = first; t < full * nb; t += stride) {
            i64 g = t / nb;
            i64 b = ((i64)P.skip + g * 2 * off) / 4 + t % nb;  // block, relative to the first
            u32 orad[16], oang[16];
            chacha_block(P, (u64)b, orad);
            chacha_block(P, (u64)(b + off / 4), oang);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                i64 d = 4 * b + k - P.skip;
                if (d >= g * 2 * off && d < g * 2 * off + off) normal_units(P, d, off, orad + 4 * k, oang + 4 * k);
            }
        }
    }
    // the last, shorter group: pair i takes words base + i and base + q + i
    const i64 base = 2 * full * GROUP;
    const i64 q = P.pairs - full * GROUP;
    for (i64 i = first; i < q; i += stride) {
        u64 kr = word_at<C>(P, tab, base + i);
        u64 ka = word_at<C>(P, tab, base + q + i);
        i64 e0 = base + i, e1 = base + q + i;
        if (P.flags & F_F64) {
            double z0, z1;
            pair_d(P, kr, ka, z0, z1);
            if (e0 < P.n) store_d(P, e0, z0);
            if (e1 < P.n) store_d(P, e1, z1);
        } else {
            float z0, z1;
            pair_f(P, (u32)kr, (u32)ka, z0, z1);
            if (e0 < P.n) store_f(P, e0, z0);
            if (e1 < P.n) store_f(P, e1, z1);
        }
    }
}

// ----------------------------------------------------------------------- many tensors, one launch
// normal_foreach_: tensor t's draw is described by descs[t]; its blocks are the launch's blocks
// first_block .. first_block + nblocks - 1 (the host lays them out one tensor after another).
struct Desc {
    u32 ctr[4];
    i64 n;
    i64 pairs;
    void* out;
    double fp[4];
    i64 first_block;
    i64 nblocks;
    int skip;
    int kind;
    int flags;
    int wb;
    int mbits;
    int pad;
};

template <int C>
__device__ __forceinline__ void normal_multi(const Params& P, const Tab* tab) {
    const Desc* descs = (const Desc*)P.p;
    i64 lo = 0, hi = P.n - 1;  // P.n: the number of tensors; find the one owning this block
    const i64 b = blockIdx.x;
    while (lo < hi) {
        i64 mid = (lo + hi + 1) / 2;
        if (descs[mid].first_block <= b) lo = mid;
        else hi = mid - 1;
    }
    const Desc& D = descs[lo];
    Params Q = P;
#pragma unroll
    for (int k = 0; k < 4; ++k) { Q.ctr[k] = D.ctr[k]; Q.fp[k] = D.fp[k]; }
    Q.n = D.n; Q.pairs = D.pairs; Q.out = D.out; Q.skip = D.skip; Q.kind = D.kind;
    Q.flags = D.flags; Q.wb = D.wb; Q.mbits = D.mbits;
    normal_body<C>(Q, tab, b - D.first_block, D.nblocks);
}

// ------------------------------------------------------------ Opacus secure noise, one launch
// For each tensor: four float32 normal draws of its size (after a one-value throw-away draw, which
// only reserves blocks), summed in order into zero and halved: ((((0 + z1) + z2) + z3) + z4) / 2,
// Opacus's secure-mode noise. AES-128 only (the four draws' units line up: one block per unit).
struct Desc4 {
    u32 ctr[4][4];
    i64 n;
    i64 pairs;
    void* out;
    i64 first_block;
    i64 nblocks;
};

__device__ __forceinline__ void aes_unit_at(const Params& P, const Tab& tab, const u32* ctr, i64 d, u32* w) {
    u32 i0, i1, i2, i3;
    add128(ctr, (u64)d, i0, i1, i2, i3);
    aes_block(P, tab, i0, i1, i2, i3, w);
}

__device__ __forceinline__ u32 aes_word32_at(const Params& P, const Tab& tab, const u32* ctr, i64 i) {
    u32 w[4];
    aes_unit_at(P, tab, ctr, i / 4, w);
    int k = (int)(i % 4);
    u32 v = w[0];
    if (k == 1) v = w[1];
    if (k == 2) v = w[2];
    if (k == 3) v = w[3];
    return v;
}

__device__ __forceinline__ void secure_noise_body(const Params& P, const Tab& tab) {
    const Desc4* descs = (const Desc4*)P.p;
    i64 lo = 0, hi = P.n - 1;
    const i64 b = blockIdx.x;
    while (lo < hi) {
        i64 mid = (lo + hi + 1) / 2;
        if (descs[mid].first_block <= b) lo = mid;
        else hi = mid - 1;
    }
    const Desc4& D = descs[lo];
    float* out = (float*)D.out;
    const i64 n = D.n;
    const i64 full = D.pairs / GROUP;
    const i64 off = GROUP / 4;
    const i64 stride = D.nblocks * NT;
    const i64 first = (b - D.first_block) * NT + threadIdx.x;
    const bool aligned = ((unsigned long long)out & 15ull) == 0;
    for (i64 t = first; t < full * off; t += stride) {
        i64 d = (t / off) * 2 * off + t % off;
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int draw = 0; draw < 4; ++draw) {
            u32 wr[4], wa[4];
            aes_unit_at(P, tab, D.ctr[draw], d, wr);
            aes_unit_at(P, tab, D.ctr[draw], d + off, wa);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float z0, z1;
                pair_f(P, wr[k], wa[k], z0, z1);
                c[k] = __fadd_rn(c[k], z0);
                s[k] = __fadd_rn(s[k], z1);
            }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            c[k] = __fdiv_rn(c[k], 2.0f);
            s[k] = __fdiv_rn(s[k], 2.0f);
        }
        i64 e0 = 4 * d, e1 = 4 * (d + off);
        if (aligned) {  // full groups are never the tail: all 4 + 4 elements exist
            *(float4*)(out + e0) = make_float4(c[0], c[1], c[2], c[3]);
            *(float4*)(out + e1) = make_float4(s[0], s[1], s[2], s[3]);
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) { out[e0 + k] = c[k]; out[e1 + k] = s[k]; }
        }
    }
    const i64 base = 2 * full * GROUP;
    const i64 q = D.pairs - full * GROUP;
    for (i64 i = first; i < q; i += stride) {
        float c = 0.0f, s = 0.0f;
        for (int draw = 0; draw < 4; ++draw) {
            u32 kr = aes_word32_at(P, tab, D.ctr[draw], base + i);
            u32 ka = aes_word32_at(P, tab, D.ctr[draw], base + q + i);
            float z0, z1;
            pair_f(P, kr, ka, z0, z1);
            c = __fadd_rn(c, z0);
            s = __fadd_rn(s, z1);
        }
        if (base + i < n) out[base + i] = __fdiv_rn(c, 2.0f);
        if (base + q + i < n) out[base + q + i] = __fdiv_rn(s, 2.0f);
    }
}

// ------------------------------------------------------------------------------ integer refills
// Rejected positions (sorted, in P.pos[0 .. *P.cnt)) are replaced in increasing order from the
// draw's refill stream (P's key and counter): one word per pending position per round, each
// round starting at the next whole block. One block of threads, so that the order is kept.
__device__ __forceinline__ int block_scan(bool flag, int& total) {
    __shared__ int warp_sums[NT / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned ballot = __ballot_sync(0xFFFFFFFFu, flag);
    int before = __popc(ballot & ((1u << lane) - 1u));
    if (lane == 0) warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int offset = 0;
    total = 0;
    for (int k = 0; k < NT / 32; ++k) {
        if (k < warp) offset += warp_sums[k];
        total += warp_sums[k];
    }
    __syncthreads();
    return offset + before;
}

template <int C>
__device__ __forceinline__ void refill_body(const Params& P, const Tab* tab) {
    int count = *P.cnt;
    if (count > P.cap) {
        if (threadIdx.x == 0) *P.err = 1;
        return;
    }
    i64 m = count;
    i64 start = 0;  // first unit of this round in the refill stream
    const int wpu = 16 / P.wb;
    while (m > 0) {
        i64 kept = 0;  // rejected again, compacted in order at the front of P.pos
        for (i64 s = 0; s < m; s += NT) {
            i64 i = s + threadIdx.x;
            bool again = false;
            i64 e = 0;
            if (i < m) {
                e = P.pos[i];
                u32 w[4];
                unit_at<C>(P, tab, start + i / wpu, w);
                int k = (int)(i % wpu);
                u64 x;
                if (P.wb == 8) {
                    u64 word = k ? word64(w, 1) : word64(w, 0);
                    x = __umul64hi(word, P.ip[0]);
                    again = word * P.ip[0] < P.ip[1];
                } else {
                    u32 word = w[0];
                    if (k == 1) word = w[1];
                    if (k == 2) word = w[2];
                    if (k == 3) word = w[3];
                    u64 prod = (u64)word * P.ip[0];
                    x = prod >> 32;
                    again = (u32)prod < (u32)P.ip[1];
                }
                if (!again) store_i(P, e, (i64)(x + P.ip[2]));
            }
            int total;
            int rank = block_scan(again, total);
            if (again) P.pos[kept + rank] = e;
            kept += total;
            __syncthreads();
        }
        start += (m * P.wb + 15) / 16;
        m = kept;
    }
}

// ------------------------------------------------------------------------------------- kernels
// Each kernel is compiled on its own (-DEMBER_K_<name>), on first use; EMBER_ALL compiles all.
#define FILL_AES(NAME, OP) \
    extern "C" __global__ void __launch_bounds__(NT) NAME(const Params P) { fill_aes<OP>(P); }
#define FILL_CHACHA(NAME, OP) \
    extern "C" __global__ void __launch_bounds__(NT) NAME(const Params P) { fill_chacha<OP>(P); }

#if defined(EMBER_ALL) || defined(EMBER_K_ember_aes_uniform)
FILL_AES(ember_aes_uniform, OP_UNIFORM)
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_aes_exponential)
FILL_AES(ember_aes_exponential, OP_EXPONENTIAL)
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_aes_integer)
FILL_AES(ember_aes_integer, OP_INTEGER)
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_aes_bernoulli)
FILL_AES(ember_aes_bernoulli, OP_BERNOULLI)
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_chacha_uniform)
FILL_CHACHA(ember_chacha_uniform, OP_UNIFORM)
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_chacha_exponential)
FILL_CHACHA(ember_chacha_exponential, OP_EXPONENTIAL)
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_chacha_integer)
FILL_CHACHA(ember_chacha_integer, OP_INTEGER)
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_chacha_bernoulli)
FILL_CHACHA(ember_chacha_bernoulli, OP_BERNOULLI)
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_aes_normal)
extern "C" __global__ void __launch_bounds__(NT) ember_aes_normal(const Params P) {
    __shared__ Tab tab;
    load_table(tab);
    normal_body<C_AES>(P, &tab, blockIdx.x, gridDim.x);
}
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_chacha_normal)
extern "C" __global__ void __launch_bounds__(NT) ember_chacha_normal(const Params P) {
    normal_body<C_CHACHA>(P, nullptr, blockIdx.x, gridDim.x);
}
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_aes_normal_multi)
extern "C" __global__ void __launch_bounds__(NT) ember_aes_normal_multi(const Params P) {
    __shared__ Tab tab;
    load_table(tab);
    normal_multi<C_AES>(P, &tab);
}
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_chacha_normal_multi)
extern "C" __global__ void __launch_bounds__(NT) ember_chacha_normal_multi(const Params P) {
    normal_multi<C_CHACHA>(P, nullptr);
}
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_aes_secure_noise)
extern "C" __global__ void __launch_bounds__(NT) ember_aes_secure_noise(const Params P) {
    __shared__ Tab tab;
    load_table(tab);
    secure_noise_body(P, tab);
}
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_aes_refill)
extern "C" __global__ void __launch_bounds__(NT) ember_aes_refill(const Params P) {
    __shared__ Tab tab;
    load_table(tab);
    refill_body<C_AES>(P, &tab);
}
#endif
#if defined(EMBER_ALL) || defined(EMBER_K_ember_chacha_refill)
extern "C" __global__ void __launch_bounds__(NT) ember_chacha_refill(const Params P) {
    refill_body<C_CHACHA>(P, nullptr);
}
#endif
