// The NVRTC kernels (src/ember/csprng/nvrtc_source.cu) compiled as C++ for the CPU, for tests:
// every CUDA thread of a block is a std::thread, __syncthreads a barrier, __shared__ a static
// (blocks run one after the other). Float arithmetic is IEEE (-ffp-contract=off), the float64
// functions are the C library's.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define EMBER_HOST_EMULATION 1
#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(x)
#define __shared__ static

struct Dim3 { unsigned x; };
static thread_local Dim3 threadIdx, blockIdx;
static Dim3 blockDim{256}, gridDim{1};
static std::barrier<>* g_bar = nullptr;
static void __syncthreads() { g_bar->arrive_and_wait(); }
static unsigned __ballot_sync(unsigned, bool flag) {
    static int flags[1024];
    flags[threadIdx.x] = flag;
    __syncthreads();
    unsigned m = 0, w = threadIdx.x & ~31u;
    for (unsigned i = 0; i < 32; ++i) if (flags[w + i]) m |= 1u << i;
    __syncthreads();
    return m;
}
static int __popc(unsigned x) { return __builtin_popcount(x); }
static unsigned __funnelshift_r(unsigned lo, unsigned hi, int s) {
    s &= 31; return s ? (lo >> s) | (hi << (32 - s)) : lo;
}
static unsigned __funnelshift_l(unsigned lo, unsigned hi, int s) {
    s &= 31; return s ? (hi << s) | (lo >> (32 - s)) : hi;
}
static float __uint2float_rn(unsigned x) { return (float)x; }
static double __ull2double_rn(unsigned long long x) { return (double)x; }
static float __ll2float_rn(long long x) { return (float)x; }
static double __ll2double_rn(long long x) { return (double)x; }
static unsigned long long __double2ull_rz(double x) { return (unsigned long long)x; }
static float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static float __fsqrt_rn(float a) { return std::sqrt(a); }
static double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
static double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
static double __dsqrt_rn(double a) { return std::sqrt(a); }
static unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
static float __uint_as_float(unsigned u) { float x; std::memcpy(&x, &u, 4); return x; }
static int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static unsigned short host_f2h(float x) { _Float16 h = (_Float16)x; unsigned short r; std::memcpy(&r, &h, 2); return r; }
static float host_h2f(unsigned short u) { _Float16 h; std::memcpy(&h, &u, 2); return (float)h; }
struct float4 { float x, y, z, w; };
struct double2 { double x, y; };
struct float2 { float x, y; };
static float2 make_float2(float a, float b) { return {a, b}; }
struct longlong2 { long long x, y; };
struct uint4 { unsigned x, y, z, w; };
static float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static double2 make_double2(double a, double b) { return {a, b}; }
static longlong2 make_longlong2(long long a, long long b) { return {a, b}; }
static uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
using std::log; using std::exp; using std::sin; using std::cos; using std::sqrt;

#define EMBER_ALL 1
#include "kernels.inc"  // the .cu source with the T-table filled in (written by the test)

typedef void (*Kernel)(const Params);
#define K(name) {#name, name}
static const std::pair<const char*, Kernel> KERNELS[] = {
    K(ember_aes_uniform), K(ember_aes_exponential), K(ember_aes_integer), K(ember_aes_bernoulli),
    K(ember_chacha_uniform), K(ember_chacha_exponential), K(ember_chacha_integer), K(ember_chacha_bernoulli),
    K(ember_aes_normal), K(ember_chacha_normal), K(ember_aes_refill), K(ember_chacha_refill),
    K(ember_aes_normal_multi), K(ember_chacha_normal_multi), K(ember_aes_secure_noise)};

extern "C" int emu_launch(const char* name, int grid, const Params* P) {
    Kernel fn = nullptr;
    for (auto& k : KERNELS) if (std::string(k.first) == name) fn = k.second;
    if (!fn) return 1;
    gridDim.x = grid;
    for (int b = 0; b < grid; ++b) {
        std::barrier<> bar(NT);
        g_bar = &bar;
        std::vector<std::thread> threads;
        for (int t = 0; t < NT; ++t)
            threads.emplace_back([=] { threadIdx.x = t; blockIdx.x = b; fn(*P); });
        for (auto& th : threads) th.join();
    }
    return 0;
}
extern "C" int emu_params_size() { return (int)sizeof(Params); }
