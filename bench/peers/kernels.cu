// kernels.cu: the CUDA C++ peers of gpufeed's block-level kernels (issue 40, part 5).
//
// Build:  nvcc -O3 -std=c++17 -arch=native -o kernels bench/peers/kernels.cu   (or -arch=sm_90)
// Run:    ./kernels                                  # full size, JSON to stdout
//         ./kernels --json kernels-cuda-cpp.json     # JSON to a file, progress on stderr
//         ./kernels --bytes 16777216 --hist-bytes 16777216 --gemm 512 --reps 3   # quick check
//
// What is measured (every variant verified against a CPU reference in this program):
//   copy       cudaMemcpyAsync device to device, --bytes (default 1 GiB); GB/s of bytes read + written
//   sum, max   over --bytes of f32: "two_pass" (deterministic: grid-stride float4 loads, warp shuffles,
//              block partials, a second one-block pass) and "atomic_per_block" (the same first pass,
//              then one atomic per block; init included); GB/s of bytes read
//   scan       inclusive scan of --bytes of f32: "lookback_t4096" / "lookback_t8192" (hand-written
//              single-pass decoupled look-back, tiles of 256 threads x 16 or 32 floats; the status
//              array and tile counter are cleared inside the timed region) and "cub" (cub::DeviceScan::
//              InclusiveSum); GB/s of bytes read + written
//   softmax    over rows of --cols (default 4096) f32, --bytes in all: "block_per_row" (one block of
//              256 threads a row, the row in registers, max and sum by block reductions, expf);
//              GB/s of bytes read + written
//   histogram  256 bins over --hist-bytes (default 1 GiB) of bytes: "shared_atomics" (one shared
//              histogram per block, uint4 loads, one global atomic per bin per block, the global
//              histogram cleared inside the timed region), "shared_atomics_per_warp" (the same with one
//              shared histogram per warp) and "cub" (cub::DeviceHistogram::HistogramEven); GB/s of
//              bytes read
//   sgemm      C = A B, f32 row-major, M = N = K = --gemm (default 4096): "tile128_8x8_db" (128x128
//              tiles, 8x8 per thread, BK = 8, double-buffered through registers) and "tile64_4x4"
//              (64x64 tiles, 4x4 per thread, BK = 16); TFLOPS = 2 M N K / s
//   bf16gemm   C = A B, bf16 in, f32 accumulate, bf16 out, row-major: "mma_m16n8k16_s3" / "_s4"
//              (128x128x32 tiles, 8 warps of 64x32, ldmatrix + mma.sync.m16n8k16 through inline PTX,
//              cp.async with 3 or 4 stages); TFLOPS
//
// Timing: the default stream; --warmup untimed runs, then --reps runs, each between two CUDA events
// with a ~0.5 ms spin kernel queued before the first, so the launches of the timed work are queued
// while the GPU is still busy and host launch latency is not counted. Median and min in ms.
//
// Inputs and checks:
//   * f32 memory-bound inputs are small nonzero integers (+-1..+-8, as floats) with a unique maximum
//     9.0 planted at the last element: every partial sum of any order stays an integer far below 2^24,
//     so sum, max and scan are exact in f32 and are checked for equality with the float64 reference
//     (any dropped or repeated element shows). The copy is compared bit for bit.
//   * softmax: sampled rows (about 512, the last included) against a float64 reference,
//     |y - ref| <= 1e-5 * ref + 1e-30.
//   * histogram: every bin exactly, counted on the CPU.
//   * sgemm: A, B uniform in [-1, 1) with 24-bit mantissas; sampled entries (the four corners and
//     --samples random ones) against a float64 reference, |c - ref| <= 32 * 2^-24 * sum_k |a_ik b_kj|
//     (an f32-accumulated result passes with a wide margin; TF32 inputs would not); every entry finite.
//   * bf16gemm: the same with bf16 inputs, plus the bf16 output's rounding: + 2^-8 |ref|.
//   * outputs are filled with NaN bytes (0xFF) before the runs, so an element never written fails.
// Exit status 1 if any check failed (the JSON is written first), 2 on a CUDA error, 64 on bad usage.
//
// Every CUDA call is checked; cudaGetLastError follows the launches.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cub/cub.cuh>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#define CUDA_CHECK(call)                                                       \
    do {                                                                       \
        cudaError_t err_ = (call);                                             \
        if (err_ != cudaSuccess) {                                             \
            std::fprintf(stderr, "CUDA error %s (%d) at %s:%d: %s\n  in: %s\n", \
                         cudaGetErrorName(err_), static_cast<int>(err_),       \
                         __FILE__, __LINE__, cudaGetErrorString(err_), #call); \
            std::exit(2);                                                      \
        }                                                                      \
    } while (0)

static const unsigned FULL = 0xffffffffu;

// ---------------------------------------------------------------------------
// Small device helpers
// ---------------------------------------------------------------------------

__global__ void spin_kernel(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

__global__ void fill_f32_kernel(float* p, float v) { *p = v; }

struct SumOp {
    __device__ __forceinline__ static float identity() { return 0.0f; }
    __device__ __forceinline__ static float apply(float a, float b) { return a + b; }
};
struct MaxOp {
    __device__ __forceinline__ static float identity() { return -INFINITY; }
    __device__ __forceinline__ static float apply(float a, float b) { return fmaxf(a, b); }
};

template <class Op>
__device__ __forceinline__ float warp_reduce(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

// Block reduction in a fixed order; the result is valid in thread 0 only.
template <class Op, int BLOCK>
__device__ __forceinline__ float block_reduce(float v) {
    __shared__ float warp_part[BLOCK / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce<Op>(v);
    if (lane == 0) warp_part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < BLOCK / 32 ? warp_part[lane] : Op::identity();
        v = warp_reduce<Op>(v);
    }
    return v;
}

// ---------------------------------------------------------------------------
// sum / max
// ---------------------------------------------------------------------------

// First pass: each thread folds a grid-stride range of float4 (four loads in flight a step) into
// four accumulators (one per lane of the float4), then the block folds them; thread 0 writes the
// block's partial (ATOMIC = false) or folds it into out[0] with one atomic (ATOMIC = true).
template <class Op, int BLOCK, bool ATOMIC>
__global__ void __launch_bounds__(BLOCK) reduce_pass1(const float* __restrict__ x, size_t n,
                                                      float* __restrict__ out) {
    float a0 = Op::identity(), a1 = a0, a2 = a0, a3 = a0;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const size_t n4 = n / 4;
    const size_t stride = static_cast<size_t>(gridDim.x) * BLOCK;
    const size_t tid = static_cast<size_t>(blockIdx.x) * BLOCK + threadIdx.x;
    size_t i = tid;
    for (; i + 3 * stride < n4; i += 4 * stride) {
        const float4 p = __ldg(x4 + i);
        const float4 q = __ldg(x4 + i + stride);
        const float4 r = __ldg(x4 + i + 2 * stride);
        const float4 s = __ldg(x4 + i + 3 * stride);
        a0 = Op::apply(a0, p.x); a1 = Op::apply(a1, p.y); a2 = Op::apply(a2, p.z); a3 = Op::apply(a3, p.w);
        a0 = Op::apply(a0, q.x); a1 = Op::apply(a1, q.y); a2 = Op::apply(a2, q.z); a3 = Op::apply(a3, q.w);
        a0 = Op::apply(a0, r.x); a1 = Op::apply(a1, r.y); a2 = Op::apply(a2, r.z); a3 = Op::apply(a3, r.w);
        a0 = Op::apply(a0, s.x); a1 = Op::apply(a1, s.y); a2 = Op::apply(a2, s.z); a3 = Op::apply(a3, s.w);
    }
    for (; i < n4; i += stride) {
        const float4 p = __ldg(x4 + i);
        a0 = Op::apply(a0, p.x); a1 = Op::apply(a1, p.y); a2 = Op::apply(a2, p.z); a3 = Op::apply(a3, p.w);
    }
    if (tid < n - n4 * 4) a0 = Op::apply(a0, x[n4 * 4 + tid]);  // the last n % 4 elements
    float v = Op::apply(Op::apply(a0, a1), Op::apply(a2, a3));
    v = block_reduce<Op, BLOCK>(v);
    if (threadIdx.x == 0) {
        if constexpr (ATOMIC) {
            if constexpr (std::is_same<Op, SumOp>::value) {
                atomicAdd(out, v);
            } else {
                // float max through integer atomics (out starts at -inf): non-negative floats order
                // as signed ints, negative ones in reverse as unsigned ints.
                if (v >= 0.0f) atomicMax(reinterpret_cast<int*>(out), __float_as_int(v));
                else atomicMin(reinterpret_cast<unsigned*>(out), __float_as_uint(v));
            }
        } else {
            out[blockIdx.x] = v;
        }
    }
}

// Second pass: one block folds the m partials in a fixed order.
template <class Op, int BLOCK>
__global__ void __launch_bounds__(BLOCK) reduce_pass2(const float* __restrict__ partials, int m,
                                                      float* __restrict__ out) {
    float v = Op::identity();
    for (int i = threadIdx.x; i < m; i += BLOCK) v = Op::apply(v, partials[i]);
    v = block_reduce<Op, BLOCK>(v);
    if (threadIdx.x == 0) *out = v;
}

// ---------------------------------------------------------------------------
// Inclusive scan: single pass, decoupled look-back
// ---------------------------------------------------------------------------
// Tile status word: flag in the high 32 bits (0 = not ready, 1 = aggregate, 2 = inclusive prefix),
// the float value's bits in the low 32; written and read as one 64-bit word, so no fence is needed
// between value and flag.

static const unsigned long long FLAG_A = 1ull << 32;
static const unsigned long long FLAG_P = 2ull << 32;

__device__ __forceinline__ void store_status(unsigned long long* p, unsigned long long v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long load_status(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// A tile is BLOCK * 4 * J floats; warp w owns a contiguous 128 * J slice, lane l holds float4 number
// j * 32 + l of it (coalesced loads and stores). Tiles are numbered in the order blocks start (an atomic
// counter), so a tile only waits on tiles whose blocks are already running.
template <int BLOCK, int J>
__global__ void __launch_bounds__(BLOCK) scan_lookback(const float* __restrict__ x, float* __restrict__ y,
                                                       size_t n, unsigned long long* __restrict__ status,
                                                       unsigned* __restrict__ tile_counter) {
    constexpr int WARPS = BLOCK / 32;
    constexpr int WARP_ELEMS = 32 * 4 * J;
    constexpr int TILE = BLOCK * 4 * J;
    static_assert(WARPS <= 32, "one warp scans the warp totals");
    __shared__ unsigned s_tile;
    __shared__ float s_warp[WARPS];
    __shared__ float s_prefix;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) s_tile = atomicAdd(tile_counter, 1u);
    __syncthreads();
    const unsigned tile = s_tile;
    const size_t base = static_cast<size_t>(tile) * TILE + static_cast<size_t>(warp) * WARP_ELEMS;
    const bool full = static_cast<size_t>(tile + 1) * TILE <= n;

    float4 v[J];
    if (full) {
        const float4* x4 = reinterpret_cast<const float4*>(x + base);
#pragma unroll
        for (int j = 0; j < J; ++j) v[j] = __ldg(x4 + j * 32 + lane);
    } else {
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const size_t e = base + static_cast<size_t>(j * 32 + lane) * 4;
            v[j].x = e < n ? x[e] : 0.0f;
            v[j].y = e + 1 < n ? x[e + 1] : 0.0f;
            v[j].z = e + 2 < n ? x[e + 2] : 0.0f;
            v[j].w = e + 3 < n ? x[e + 3] : 0.0f;
        }
    }

    // Warp-level inclusive scan of the warp's slice, one 128-float segment (j) at a time.
    float carry = 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        v[j].y += v[j].x;
        v[j].z += v[j].y;
        v[j].w += v[j].z;
        float inc = v[j].w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float u = __shfl_up_sync(FULL, inc, o);
            if (lane >= o) inc += u;
        }
        float exc = __shfl_up_sync(FULL, inc, 1);
        if (lane == 0) exc = 0.0f;
        const float add = carry + exc;
        v[j].x += add;
        v[j].y += add;
        v[j].z += add;
        v[j].w += add;
        carry += __shfl_sync(FULL, inc, 31);
    }
    if (lane == 0) s_warp[warp] = carry;  // the warp's total
    __syncthreads();

    if (warp == 0) {
        const float wt = lane < WARPS ? s_warp[lane] : 0.0f;
        float inc = wt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float u = __shfl_up_sync(FULL, inc, o);
            if (lane >= o) inc += u;
        }
        float exc = __shfl_up_sync(FULL, inc, 1);
        if (lane == 0) exc = 0.0f;
        const float aggregate = __shfl_sync(FULL, inc, 31);
        if (lane < WARPS) s_warp[lane] = exc;  // each lane rewrites only its own entry

        float exclusive = 0.0f;
        if (tile == 0) {
            if (lane == 0) store_status(status, FLAG_P | __float_as_uint(aggregate));
        } else {
            if (lane == 0) store_status(status + tile, FLAG_A | __float_as_uint(aggregate));
            // Look back 32 predecessors at a time: lane k looks at tile - 1 - k (minus 32 per round).
            int pred = static_cast<int>(tile) - 1 - lane;
            while (true) {
                unsigned long long s;
                do {
                    s = pred >= 0 ? load_status(status + pred) : FLAG_P;  // before tile 0: prefix 0
                } while (__any_sync(FULL, (s >> 32) == 0));
                const unsigned pmask = __ballot_sync(FULL, (s >> 32) == 2);
                const int first_p = pmask ? __ffs(pmask) - 1 : 32;
                float val = __uint_as_float(static_cast<unsigned>(s & 0xffffffffull));
                if (lane > first_p) val = 0.0f;
                val = warp_reduce<SumOp>(val);
                exclusive += val;
                if (pmask) break;
                pred -= 32;
            }
            if (lane == 0) store_status(status + tile, FLAG_P | __float_as_uint(exclusive + aggregate));
        }
        if (lane == 0) s_prefix = exclusive;
    }
    __syncthreads();

    const float off = s_prefix + s_warp[warp];
    if (full) {
        float4* y4 = reinterpret_cast<float4*>(y + base);
#pragma unroll
        for (int j = 0; j < J; ++j) {
            float4 o = v[j];
            o.x += off;
            o.y += off;
            o.z += off;
            o.w += off;
            y4[j * 32 + lane] = o;
        }
    } else {
#pragma unroll
        for (int j = 0; j < J; ++j) {
            const size_t e = base + static_cast<size_t>(j * 32 + lane) * 4;
            if (e < n) y[e] = v[j].x + off;
            if (e + 1 < n) y[e + 1] = v[j].y + off;
            if (e + 2 < n) y[e + 2] = v[j].z + off;
            if (e + 3 < n) y[e + 3] = v[j].w + off;
        }
    }
}

// ---------------------------------------------------------------------------
// Softmax over rows: one block a row, the row in registers
// ---------------------------------------------------------------------------

template <int BLOCK, int J>  // rows of up to BLOCK * 4 * J floats, cols % 4 == 0
__global__ void __launch_bounds__(BLOCK) softmax_rows(const float* __restrict__ x, float* __restrict__ y,
                                                      int cols) {
    __shared__ float s_bcast;
    const size_t row = blockIdx.x;
    const float4* xr = reinterpret_cast<const float4*>(x + row * cols);
    float4* yr = reinterpret_cast<float4*>(y + row * cols);
    const int c4 = cols / 4;
    float4 v[J];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int idx = j * BLOCK + threadIdx.x;
        if (idx < c4) {
            v[j] = __ldg(xr + idx);
            m = fmaxf(m, fmaxf(fmaxf(v[j].x, v[j].y), fmaxf(v[j].z, v[j].w)));
        } else {
            v[j] = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
        }
    }
    m = block_reduce<MaxOp, BLOCK>(m);
    if (threadIdx.x == 0) s_bcast = m;
    __syncthreads();
    m = s_bcast;
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        v[j].x = expf(v[j].x - m);
        v[j].y = expf(v[j].y - m);
        v[j].z = expf(v[j].z - m);
        v[j].w = expf(v[j].w - m);
        s += (v[j].x + v[j].y) + (v[j].z + v[j].w);
    }
    s = block_reduce<SumOp, BLOCK>(s);
    __syncthreads();  // every thread has read s_bcast (the max) before thread 0 rewrites it
    if (threadIdx.x == 0) s_bcast = s;
    __syncthreads();
    s = s_bcast;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int idx = j * BLOCK + threadIdx.x;
        if (idx < c4) {
            float4 o;
            o.x = v[j].x / s;
            o.y = v[j].y / s;
            o.z = v[j].z / s;
            o.w = v[j].w / s;
            yr[idx] = o;
        }
    }
}

// ---------------------------------------------------------------------------
// 256-bin histogram of bytes: shared-memory atomics, one global atomic per bin per block
// ---------------------------------------------------------------------------

__device__ __forceinline__ void count_word(unsigned* h, unsigned w) {
    atomicAdd(h + (w & 0xffu), 1u);
    atomicAdd(h + ((w >> 8) & 0xffu), 1u);
    atomicAdd(h + ((w >> 16) & 0xffu), 1u);
    atomicAdd(h + (w >> 24), 1u);
}

template <int BLOCK, int R>  // R shared histograms per block (1: one per block; BLOCK / 32: one per warp)
__global__ void __launch_bounds__(BLOCK) hist256(const unsigned char* __restrict__ data, size_t n,
                                                 unsigned* __restrict__ hist) {
    __shared__ unsigned sh[R * 256];
    for (int i = threadIdx.x; i < R * 256; i += BLOCK) sh[i] = 0;
    __syncthreads();
    unsigned* my = sh + ((threadIdx.x >> 5) % R) * 256;
    const uint4* d4 = reinterpret_cast<const uint4*>(data);
    const size_t n16 = n / 16;
    const size_t stride = static_cast<size_t>(gridDim.x) * BLOCK;
    const size_t tid = static_cast<size_t>(blockIdx.x) * BLOCK + threadIdx.x;
    size_t i = tid;
    for (; i + stride < n16; i += 2 * stride) {
        const uint4 p = __ldg(d4 + i);
        const uint4 q = __ldg(d4 + i + stride);
        count_word(my, p.x); count_word(my, p.y); count_word(my, p.z); count_word(my, p.w);
        count_word(my, q.x); count_word(my, q.y); count_word(my, q.z); count_word(my, q.w);
    }
    for (; i < n16; i += stride) {
        const uint4 p = __ldg(d4 + i);
        count_word(my, p.x); count_word(my, p.y); count_word(my, p.z); count_word(my, p.w);
    }
    if (tid < n - n16 * 16) atomicAdd(my + data[n16 * 16 + tid], 1u);  // the last n % 16 bytes
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += BLOCK) {
        unsigned s = 0;
#pragma unroll
        for (int r = 0; r < R; ++r) s += sh[r * 256 + b];
        atomicAdd(hist + b, s);
    }
}

// ---------------------------------------------------------------------------
// SGEMM, f32, row-major: C[M x N] = A[M x K] B[K x N]
// ---------------------------------------------------------------------------

// 64x64 tiles, BK = 16, 256 threads, 4x4 per thread; M, N multiples of 64, K of 16.
__global__ void __launch_bounds__(256) sgemm_64x64(const float* __restrict__ A, const float* __restrict__ B,
                                                   float* __restrict__ C, int M, int N, int K) {
    constexpr int BM = 64, BN = 64, BK = 16;
    __shared__ __align__(16) float As[BK][BM];  // A tile, transposed
    __shared__ __align__(16) float Bs[BK][BN];
    const int t = threadIdx.x, tx = t & 15, ty = t >> 4;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int a_row = t >> 2, a_col = (t & 3) * 4;   // 64 rows x 16 cols: 4 float4 a row
    const int b_row = t >> 4, b_col = (t & 15) * 4;  // 16 rows x 64 cols: 16 float4 a row
    const float* Ap = A + static_cast<size_t>(m0 + a_row) * K + a_col;
    const float* Bp = B + static_cast<size_t>(b_row) * N + n0 + b_col;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += BK) {
        const float4 a = *reinterpret_cast<const float4*>(Ap + k0);
        const float4 b = *reinterpret_cast<const float4*>(Bp + static_cast<size_t>(k0) * N);
        As[a_col + 0][a_row] = a.x;
        As[a_col + 1][a_row] = a.y;
        As[a_col + 2][a_row] = a.z;
        As[a_col + 3][a_row] = a.w;
        *reinterpret_cast<float4*>(&Bs[b_row][b_col]) = b;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 av = *reinterpret_cast<const float4*>(&As[k][ty * 4]);
            const float4 bv = *reinterpret_cast<const float4*>(&Bs[k][tx * 4]);
            const float ar[4] = {av.x, av.y, av.z, av.w};
            const float br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float4 o = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        *reinterpret_cast<float4*>(C + static_cast<size_t>(m0 + ty * 4 + i) * N + n0 + tx * 4) = o;
    }
}

// 128x128 tiles, BK = 8, 256 threads, 8x8 per thread (rows ty*4+{0..3} and 64+ty*4+{0..3}, the same
// for columns, so the shared reads are conflict-free float4s), the next k-tile loaded into registers
// while the current one is computed from the other shared buffer: one barrier per k-tile.
// M, N multiples of 128, K of 8.
__global__ void __launch_bounds__(256) sgemm_128x128(const float* __restrict__ A, const float* __restrict__ B,
                                                     float* __restrict__ C, int M, int N, int K) {
    constexpr int BM = 128, BN = 128, BK = 8;
    __shared__ __align__(16) float As[2][BK][BM];  // A tiles, transposed
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int t = threadIdx.x, tx = t & 15, ty = t >> 4;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int a_row = t >> 1, a_col = (t & 1) * 4;   // 128 rows x 8 cols: 2 float4 a row
    const int b_row = t >> 5, b_col = (t & 31) * 4;  // 8 rows x 128 cols: 32 float4 a row
    const float* Ap = A + static_cast<size_t>(m0 + a_row) * K + a_col;
    const float* Bp = B + static_cast<size_t>(b_row) * N + n0 + b_col;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;

    float4 a_ld = *reinterpret_cast<const float4*>(Ap);
    float4 b_ld = *reinterpret_cast<const float4*>(Bp);
    As[0][a_col + 0][a_row] = a_ld.x;
    As[0][a_col + 1][a_row] = a_ld.y;
    As[0][a_col + 2][a_row] = a_ld.z;
    As[0][a_col + 3][a_row] = a_ld.w;
    *reinterpret_cast<float4*>(&Bs[0][b_row][b_col]) = b_ld;
    __syncthreads();

    const int KT = K / BK;
    for (int kt = 0; kt < KT; ++kt) {
        const int cur = kt & 1;
        if (kt + 1 < KT) {
            a_ld = *reinterpret_cast<const float4*>(Ap + (kt + 1) * BK);
            b_ld = *reinterpret_cast<const float4*>(Bp + static_cast<size_t>(kt + 1) * BK * N);
        }
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float4 a0 = *reinterpret_cast<const float4*>(&As[cur][k][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&As[cur][k][64 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&Bs[cur][k][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&Bs[cur][k][64 + tx * 4]);
            const float ar[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float br[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
        }
        if (kt + 1 < KT) {
            const int nxt = cur ^ 1;
            As[nxt][a_col + 0][a_row] = a_ld.x;
            As[nxt][a_col + 1][a_row] = a_ld.y;
            As[nxt][a_col + 2][a_row] = a_ld.z;
            As[nxt][a_col + 3][a_row] = a_ld.w;
            *reinterpret_cast<float4*>(&Bs[nxt][b_row][b_col]) = b_ld;
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int row = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
        float* c = C + static_cast<size_t>(row) * N + n0;
        *reinterpret_cast<float4*>(c + tx * 4) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        *reinterpret_cast<float4*>(c + 64 + tx * 4) = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
    }
}

// ---------------------------------------------------------------------------
// bf16 GEMM on the tensor cores: mma.sync.m16n8k16 (f32 accumulate), ldmatrix, cp.async
// ---------------------------------------------------------------------------

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

constexpr int BG_BM = 128, BG_BN = 128, BG_BK = 32;
constexpr int BG_AS = BG_BK + 8;  // A row stride in shared (bf16): 80 bytes, ldmatrix rows conflict-free
constexpr int BG_BS = BG_BN + 8;  // B row stride in shared (bf16): 272 bytes
constexpr int BG_A_STAGE = BG_BM * BG_AS;
constexpr int BG_B_STAGE = BG_BK * BG_BS;

template <int STAGES>
constexpr size_t bf16_gemm_smem() {
    return static_cast<size_t>(STAGES) * (BG_A_STAGE + BG_B_STAGE) * sizeof(__nv_bfloat16);
}

// 256 threads = 8 warps as 2 (M) x 4 (N), each warp 64x32 of C: 4 x 4 mma tiles of 16x8.
// M, N multiples of 128, K of 32.
template <int STAGES>
__global__ void __launch_bounds__(256) bf16_gemm_mma(const __nv_bfloat16* __restrict__ A,
                                                     const __nv_bfloat16* __restrict__ B,
                                                     __nv_bfloat16* __restrict__ C, int M, int N, int K) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    __nv_bfloat16* Bs = As + STAGES * BG_A_STAGE;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int wm = warp >> 2, wn = warp & 3;
    const int m0 = blockIdx.y * BG_BM, n0 = blockIdx.x * BG_BN;
    const int KT = K / BG_BK;

    auto load_stage = [&](int stage, int kt) {
        const int k0 = kt * BG_BK;
        __nv_bfloat16* as = As + stage * BG_A_STAGE;
        __nv_bfloat16* bs = Bs + stage * BG_B_STAGE;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int c = t + i * 256;                   // 512 chunks of 16 bytes per operand
            const int ar = c >> 2, ac = (c & 3) * 8;     // A: 128 rows x 4 chunks
            cp_async16(as + ar * BG_AS + ac, A + static_cast<size_t>(m0 + ar) * K + k0 + ac);
            const int br = c >> 4, bc = (c & 15) * 8;    // B: 32 rows x 16 chunks
            cp_async16(bs + br * BG_BS + bc, B + static_cast<size_t>(k0 + br) * N + n0 + bc);
        }
    };

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();  // k-tile kt has landed (this thread's copies)
        __syncthreads();              // ... everyone's; and everyone is done with k-tile kt - 1
        {
            const int nk = kt + STAGES - 1;
            if (nk < KT) load_stage(nk % STAGES, nk);  // into the stage k-tile kt - 1 used
            cp_async_commit();                          // always, so the group count stays in step
        }
        const __nv_bfloat16* as = As + (kt % STAGES) * BG_A_STAGE;
        const __nv_bfloat16* bs = Bs + (kt % STAGES) * BG_B_STAGE;
#pragma unroll
        for (int kk = 0; kk < BG_BK; kk += 16) {
            unsigned af[4][4], bfr[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                const int r = wm * 64 + mi * 16 + (lane & 15);
                const int c = kk + (lane >> 4) * 8;
                ldmatrix_x4(af[mi], smem_u32(as + r * BG_AS + c));
            }
#pragma unroll
            for (int np = 0; np < 2; ++np) {
                const int r = kk + (lane & 15);
                const int c = wn * 32 + np * 16 + (lane >> 4) * 8;
                unsigned r4[4];
                ldmatrix_x4_trans(r4, smem_u32(bs + r * BG_BS + c));
                bfr[np * 2][0] = r4[0];
                bfr[np * 2][1] = r4[1];
                bfr[np * 2 + 1][0] = r4[2];
                bfr[np * 2 + 1][1] = r4[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) mma_bf16_16816(acc[mi][ni], af[mi], bfr[ni]);
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int row = m0 + wm * 64 + mi * 16 + (lane >> 2);
            const int col = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
            *reinterpret_cast<__nv_bfloat162*>(C + static_cast<size_t>(row) * N + col) =
                __floats2bfloat162_rn(acc[mi][ni][0], acc[mi][ni][1]);
            *reinterpret_cast<__nv_bfloat162*>(C + static_cast<size_t>(row + 8) * N + col) =
                __floats2bfloat162_rn(acc[mi][ni][2], acc[mi][ni][3]);
        }
    }
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------

struct Args {
    size_t bytes = size_t(1) << 30;
    size_t hist_bytes = size_t(1) << 30;
    int cols = 4096;
    int gemm_m = 4096, gemm_n = 4096, gemm_k = 4096;
    int reps = 30;
    int gemm_reps = 10;
    int warmup = 3;
    int samples = 1024;
    long long spin_cycles = 1000000;
    std::string ops = "copy,sum,max,scan,softmax,histogram,sgemm,bf16gemm";
    const char* json = nullptr;
};

static bool want(const Args& a, const char* op) {
    const std::string ops = "," + a.ops + ",";
    return ops.find(std::string(",") + op + ",") != std::string::npos;
}

struct Timing {
    double median_ms = 0, min_ms = 0;
    int reps = 0;
};

static long long g_spin_cycles = 1000000;

// f enqueues the work on the default stream.
template <class F>
static Timing time_op(F&& f, int warmup, int reps) {
    for (int i = 0; i < warmup; ++i) f();
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<double> ms;
    for (int r = 0; r < reps; ++r) {
        spin_kernel<<<1, 1>>>(g_spin_cycles);
        CUDA_CHECK(cudaEventRecord(e0, 0));
        f();
        CUDA_CHECK(cudaEventRecord(e1, 0));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float t = 0;
        CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
    }
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    Timing out;
    out.reps = reps;
    if (!ms.empty()) {
        std::sort(ms.begin(), ms.end());
        const size_t h = ms.size() / 2;
        out.median_ms = ms.size() % 2 ? ms[h] : 0.5 * (ms[h - 1] + ms[h]);
        out.min_ms = ms.front();
    }
    return out;
}

struct Result {
    std::string op, variant, unit, note;
    size_t n = 0;  // elements (bytes for the histogram)
    int m = 0, nn = 0, k = 0;
    double bytes = 0, flops = 0, value = 0;
    Timing t;
    bool verified = false;
    double max_err = 0, tol = 0;
    int grid = 0, block = 0;
    size_t smem = 0;
};

static std::vector<Result> g_results;
static bool g_all_ok = true;

static void report(Result r) {
    const double s = r.t.median_ms * 1e-3;
    if (r.unit == "TFLOPS") r.value = s > 0 ? r.flops / s / 1e12 : 0;
    else r.value = s > 0 ? r.bytes / s / 1e9 : 0;
    if (!r.verified) g_all_ok = false;
    std::fprintf(stderr, "%-10s %-24s %9.3f ms (min %9.3f)  %9.1f %-6s  %s  err %.3g tol %.3g%s%s\n",
                 r.op.c_str(), r.variant.c_str(), r.t.median_ms, r.t.min_ms, r.value, r.unit.c_str(),
                 r.verified ? "verified" : "CHECK FAILED", r.max_err, r.tol, r.note.empty() ? "" : "  ",
                 r.note.c_str());
    g_results.push_back(r);
}

// Deterministic host data (splitmix64 of the index).
static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
static inline float int_value(uint64_t i) {  // +-1..+-8
    const uint64_t h = splitmix64(i ^ 0x1234567ull);
    const float mag = static_cast<float>(1 + (h & 7));
    return (h >> 3) & 1 ? -mag : mag;
}
static inline float unit_value(uint64_t i, uint64_t seed) {  // uniform in [-1, 1), 24-bit mantissa
    const uint64_t h = splitmix64(i * 0x2545F4914F6CDD1Dull + seed);
    return static_cast<float>(static_cast<double>(h >> 40) * (2.0 / 16777216.0) - 1.0);
}
static inline uint16_t f32_to_bf16_bits(float f) {  // round to nearest even (no NaNs here)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}
static inline float bf16_bits_to_f32(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

static int blocks_for(const void* kernel, int block, size_t smem) {
    int dev = 0, sms = 0, per_sm = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block, smem));
    return sms * std::max(per_sm, 1);
}

// ---- f32 memory-bound ops ------------------------------------------------------------------

template <class Op>
static void run_reduce(const Args& a, const char* op, const float* d_x, size_t n, double ref) {
    constexpr int BLOCK = 256;
    float* d_out = nullptr;
    float* d_part = nullptr;
    const int grid = blocks_for(reinterpret_cast<const void*>(reduce_pass1<Op, BLOCK, false>), BLOCK, 0);
    CUDA_CHECK(cudaMalloc(&d_out, sizeof(float)));
    CUDA_CHECK(cudaMalloc(&d_part, sizeof(float) * grid));
    const bool is_sum = std::is_same<Op, SumOp>::value;
    for (int variant = 0; variant < 2; ++variant) {
        Result r;
        r.op = op;
        r.unit = "GB/s";
        r.n = n;
        r.bytes = 4.0 * n;
        r.block = BLOCK;
        CUDA_CHECK(cudaMemset(d_out, 0xff, sizeof(float)));
        if (variant == 0) {
            r.variant = "two_pass";
            r.grid = grid;
            r.note = "second pass: one block of 1024 over the partials";
            r.t = time_op([&] {
                reduce_pass1<Op, BLOCK, false><<<grid, BLOCK>>>(d_x, n, d_part);
                reduce_pass2<Op, 1024><<<1, 1024>>>(d_part, grid, d_out);
            }, a.warmup, a.reps);
        } else {
            r.variant = "atomic_per_block";
            const int g = blocks_for(reinterpret_cast<const void*>(reduce_pass1<Op, BLOCK, true>), BLOCK, 0);
            r.grid = g;
            r.note = is_sum ? "cudaMemsetAsync of the result included" : "the -inf init kernel included";
            r.t = time_op([&] {
                if (is_sum) CUDA_CHECK(cudaMemsetAsync(d_out, 0, sizeof(float), 0));
                else fill_f32_kernel<<<1, 1>>>(d_out, -INFINITY);
                reduce_pass1<Op, BLOCK, true><<<g, BLOCK>>>(d_x, n, d_out);
            }, a.warmup, a.reps);
        }
        float got = 0;
        CUDA_CHECK(cudaMemcpy(&got, d_out, sizeof(float), cudaMemcpyDeviceToHost));
        r.max_err = std::fabs(static_cast<double>(got) - ref);
        r.tol = 0;  // integer-valued input: exact
        r.verified = r.max_err <= r.tol;  // NaN fails
        report(r);
    }
    CUDA_CHECK(cudaFree(d_part));
    CUDA_CHECK(cudaFree(d_out));
}

static void check_scan(Result& r, const float* d_y, const std::vector<float>& hx, std::vector<float>& hy) {
    CUDA_CHECK(cudaMemcpy(hy.data(), d_y, hy.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double run = 0, worst = 0;
    for (size_t i = 0; i < hx.size(); ++i) {
        run += hx[i];
        const double e = std::fabs(static_cast<double>(hy[i]) - run);
        if (!(e <= worst)) worst = e;  // NaN sticks
    }
    r.max_err = worst;
    r.tol = 0;  // integer-valued input: exact
    r.verified = worst <= r.tol;
}

template <int J>
static void run_scan_lookback(const Args& a, const float* d_x, float* d_y, size_t n, const std::vector<float>& hx,
                              std::vector<float>& hy) {
    constexpr int BLOCK = 256;
    constexpr int TILE = BLOCK * 4 * J;
    const size_t tiles = (n + TILE - 1) / TILE;
    unsigned long long* d_status = nullptr;
    unsigned* d_counter = nullptr;
    CUDA_CHECK(cudaMalloc(&d_status, sizeof(unsigned long long) * std::max<size_t>(tiles, 1)));
    CUDA_CHECK(cudaMalloc(&d_counter, sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(d_y, 0xff, n * sizeof(float)));
    Result r;
    r.op = "scan";
    r.variant = "lookback_t" + std::to_string(TILE);
    r.unit = "GB/s";
    r.n = n;
    r.bytes = 8.0 * n;
    r.grid = static_cast<int>(tiles);
    r.block = BLOCK;
    r.note = "status clear (cudaMemsetAsync) included";
    r.t = time_op([&] {
        CUDA_CHECK(cudaMemsetAsync(d_status, 0, sizeof(unsigned long long) * tiles, 0));
        CUDA_CHECK(cudaMemsetAsync(d_counter, 0, sizeof(unsigned), 0));
        scan_lookback<BLOCK, J><<<static_cast<unsigned>(tiles), BLOCK>>>(d_x, d_y, n, d_status, d_counter);
    }, a.warmup, a.reps);
    check_scan(r, d_y, hx, hy);
    report(r);
    CUDA_CHECK(cudaFree(d_counter));
    CUDA_CHECK(cudaFree(d_status));
}

static void run_scan_cub(const Args& a, const float* d_x, float* d_y, size_t n, const std::vector<float>& hx,
                         std::vector<float>& hy) {
    Result r;
    r.op = "scan";
    r.variant = "cub";
    r.unit = "GB/s";
    r.n = n;
    r.bytes = 8.0 * n;
    if (n > static_cast<size_t>(INT32_MAX)) {
        r.note = "skipped: n over INT32_MAX";
        std::fprintf(stderr, "scan cub: %s\n", r.note.c_str());
        return;
    }
    const int ni = static_cast<int>(n);
    size_t temp_bytes = 0;
    CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, temp_bytes, d_x, d_y, ni));
    void* d_temp = nullptr;
    CUDA_CHECK(cudaMalloc(&d_temp, std::max<size_t>(temp_bytes, 1)));
    CUDA_CHECK(cudaMemset(d_y, 0xff, n * sizeof(float)));
    r.note = "CUB " + std::to_string(CUB_VERSION) + ", temp " + std::to_string(temp_bytes) + " B allocated once";
    r.t = time_op([&] { CUDA_CHECK(cub::DeviceScan::InclusiveSum(d_temp, temp_bytes, d_x, d_y, ni)); },
                  a.warmup, a.reps);
    check_scan(r, d_y, hx, hy);
    report(r);
    CUDA_CHECK(cudaFree(d_temp));
}

static void run_softmax(const Args& a, const float* d_x, float* d_y, size_t n, const std::vector<float>& hx,
                        std::vector<float>& hy) {
    constexpr int BLOCK = 256;
    const int cols = a.cols;
    Result r;
    r.op = "softmax";
    r.variant = "block_per_row";
    r.unit = "GB/s";
    if (cols <= 0 || cols % 4 != 0 || cols > BLOCK * 4 * 8 || n / cols == 0) {
        std::fprintf(stderr, "softmax: cols must be a positive multiple of 4, at most %d, and at most n\n",
                     BLOCK * 4 * 8);
        std::exit(64);
    }
    const size_t rows = n / cols;
    if (rows > 0x7fffffffull) {
        std::fprintf(stderr, "softmax: too many rows\n");
        std::exit(64);
    }
    const size_t ne = rows * cols;
    r.n = ne;
    r.bytes = 8.0 * ne;
    r.grid = static_cast<int>(rows);
    r.block = BLOCK;
    r.note = "rows " + std::to_string(rows) + " x cols " + std::to_string(cols);
    CUDA_CHECK(cudaMemset(d_y, 0xff, ne * sizeof(float)));
    const bool small = cols <= BLOCK * 4 * 4;
    r.t = time_op([&] {
        if (small) softmax_rows<BLOCK, 4><<<static_cast<unsigned>(rows), BLOCK>>>(d_x, d_y, cols);
        else softmax_rows<BLOCK, 8><<<static_cast<unsigned>(rows), BLOCK>>>(d_x, d_y, cols);
    }, a.warmup, a.reps);
    CUDA_CHECK(cudaMemcpy(hy.data(), d_y, ne * sizeof(float), cudaMemcpyDeviceToHost));
    const size_t step = std::max<size_t>(rows / 512, 1);
    std::vector<size_t> check_rows;
    for (size_t row = 0; row < rows; row += step) check_rows.push_back(row);
    if (check_rows.back() != rows - 1) check_rows.push_back(rows - 1);
    double worst_excess = -1e300, worst = 0, worst_tol = 0;
    bool ok = true;
    const size_t checked = check_rows.size();
    for (const size_t row : check_rows) {
        const float* xr = hx.data() + row * cols;
        const float* yr = hy.data() + row * cols;
        double m = -INFINITY;
        for (int c = 0; c < cols; ++c) m = std::max(m, static_cast<double>(xr[c]));
        double s = 0;
        for (int c = 0; c < cols; ++c) s += std::exp(static_cast<double>(xr[c]) - m);
        for (int c = 0; c < cols; ++c) {
            const double ref = std::exp(static_cast<double>(xr[c]) - m) / s;
            const double e = std::fabs(static_cast<double>(yr[c]) - ref);
            const double tol = 1e-5 * ref + 1e-30;
            if (!(e <= tol)) ok = false;
            if (!(e - tol <= worst_excess)) {
                worst_excess = e - tol;
                worst = e;
                worst_tol = tol;
            }
        }
    }
    r.max_err = worst;
    r.tol = worst_tol;
    r.verified = ok;
    r.note += ", " + std::to_string(checked) + " rows checked (err/tol: the entry nearest its bound)";
    report(r);
}

// ---- histogram -------------------------------------------------------------------------------

static void run_histogram(const Args& a) {
    const size_t n = a.hist_bytes;
    std::fprintf(stderr, "histogram: generating %zu bytes\n", n);
    std::vector<unsigned char> hb(n);
    for (size_t i = 0; i + 8 <= n; i += 8) {
        const uint64_t h = splitmix64(i / 8 + 0xABCDEFull);
        std::memcpy(hb.data() + i, &h, 8);
    }
    for (size_t i = n - n % 8; i < n; ++i) hb[i] = static_cast<unsigned char>(splitmix64(i) >> 56);
    std::vector<uint64_t> ref(256, 0);
    {
        std::vector<uint64_t> c4(4 * 256, 0);
        size_t i = 0;
        for (; i + 4 <= n; i += 4) {
            ++c4[hb[i]];
            ++c4[256 + hb[i + 1]];
            ++c4[512 + hb[i + 2]];
            ++c4[768 + hb[i + 3]];
        }
        for (; i < n; ++i) ++c4[hb[i]];
        for (int b = 0; b < 256; ++b) ref[b] = c4[b] + c4[256 + b] + c4[512 + b] + c4[768 + b];
    }
    unsigned char* d_b = nullptr;
    unsigned* d_h = nullptr;
    CUDA_CHECK(cudaMalloc(&d_b, std::max<size_t>(n, 16)));
    CUDA_CHECK(cudaMalloc(&d_h, 256 * sizeof(unsigned)));
    CUDA_CHECK(cudaMemcpy(d_b, hb.data(), n, cudaMemcpyHostToDevice));
    std::vector<unsigned> got(256);
    auto check = [&](Result& r) {
        CUDA_CHECK(cudaMemcpy(got.data(), d_h, 256 * sizeof(unsigned), cudaMemcpyDeviceToHost));
        double worst = 0;
        for (int b = 0; b < 256; ++b)
            worst = std::max(worst, std::fabs(static_cast<double>(got[b]) - static_cast<double>(ref[b])));
        r.max_err = worst;
        r.tol = 0;
        r.verified = worst == 0;
    };
    constexpr int BLOCK = 256;
    for (int variant = 0; variant < 2; ++variant) {
        Result r;
        r.op = "histogram";
        r.unit = "GB/s";
        r.n = n;
        r.bytes = static_cast<double>(n);
        r.block = BLOCK;
        CUDA_CHECK(cudaMemset(d_h, 0xff, 256 * sizeof(unsigned)));
        if (variant == 0) {
            r.variant = "shared_atomics";
            const int grid = blocks_for(reinterpret_cast<const void*>(hist256<BLOCK, 1>), BLOCK, 0);
            r.grid = grid;
            r.note = "one shared histogram per block; global clear (cudaMemsetAsync) included";
            r.t = time_op([&] {
                CUDA_CHECK(cudaMemsetAsync(d_h, 0, 256 * sizeof(unsigned), 0));
                hist256<BLOCK, 1><<<grid, BLOCK>>>(d_b, n, d_h);
            }, a.warmup, a.reps);
        } else {
            r.variant = "shared_atomics_per_warp";
            const int grid = blocks_for(reinterpret_cast<const void*>(hist256<BLOCK, BLOCK / 32>), BLOCK, 0);
            r.grid = grid;
            r.note = "one shared histogram per warp; global clear (cudaMemsetAsync) included";
            r.t = time_op([&] {
                CUDA_CHECK(cudaMemsetAsync(d_h, 0, 256 * sizeof(unsigned), 0));
                hist256<BLOCK, BLOCK / 32><<<grid, BLOCK>>>(d_b, n, d_h);
            }, a.warmup, a.reps);
        }
        check(r);
        report(r);
    }
    {
        Result r;
        r.op = "histogram";
        r.variant = "cub";
        r.unit = "GB/s";
        r.n = n;
        r.bytes = static_cast<double>(n);
        if (n > static_cast<size_t>(INT32_MAX)) {
            std::fprintf(stderr, "histogram cub: skipped, n over INT32_MAX\n");
        } else {
            const int ni = static_cast<int>(n);
            const unsigned char* samples = d_b;
            size_t temp_bytes = 0;
            CUDA_CHECK(cub::DeviceHistogram::HistogramEven(nullptr, temp_bytes, samples, d_h, 257, 0, 256, ni));
            void* d_temp = nullptr;
            CUDA_CHECK(cudaMalloc(&d_temp, std::max<size_t>(temp_bytes, 1)));
            CUDA_CHECK(cudaMemset(d_h, 0xff, 256 * sizeof(unsigned)));
            r.note = "cub::DeviceHistogram::HistogramEven, 257 levels over [0, 256), temp allocated once";
            r.t = time_op([&] {
                CUDA_CHECK(cub::DeviceHistogram::HistogramEven(d_temp, temp_bytes, samples, d_h, 257, 0, 256, ni));
            }, a.warmup, a.reps);
            check(r);
            report(r);
            CUDA_CHECK(cudaFree(d_temp));
        }
    }
    CUDA_CHECK(cudaFree(d_h));
    CUDA_CHECK(cudaFree(d_b));
}

// ---- GEMMs -----------------------------------------------------------------------------------

// Sampled entries (the four corners, then random ones) of C against a float64 reference.
// get(i, j) reads the device result from the host copy, a(i, k) and b(k, j) the inputs.
template <class GetC, class GetA, class GetB>
static void check_gemm(Result& r, int M, int N, int K, int samples, double out_rel, GetC getc, GetA geta,
                       GetB getb) {
    std::mt19937_64 rng(42);
    std::vector<std::pair<int, int>> pts = {{0, 0}, {0, N - 1}, {M - 1, 0}, {M - 1, N - 1}};
    for (int s = 0; s < samples; ++s)
        pts.push_back({static_cast<int>(rng() % M), static_cast<int>(rng() % N)});
    bool ok = true;
    double worst_excess = -1e300, worst = 0, worst_tol = 0;
    const double u = std::ldexp(1.0, -24);
    for (auto [i, j] : pts) {
        double ref = 0, mag = 0;
        for (int k = 0; k < K; ++k) {
            const double p = static_cast<double>(geta(i, k)) * static_cast<double>(getb(k, j));
            ref += p;
            mag += std::fabs(p);
        }
        const double e = std::fabs(static_cast<double>(getc(i, j)) - ref);
        const double tol = 32 * u * mag + out_rel * std::fabs(ref);
        if (!(e <= tol)) ok = false;
        if (!(e - tol <= worst_excess)) {
            worst_excess = e - tol;
            worst = e;
            worst_tol = tol;
        }
    }
    r.max_err = worst;
    r.tol = worst_tol;
    r.verified = ok && r.verified;  // r.verified carries the all-finite check
    r.note += ", " + std::to_string(pts.size()) + " entries checked (err/tol: the entry nearest its bound)";
}

static void run_sgemm(const Args& a) {
    const int M = a.gemm_m, N = a.gemm_n, K = a.gemm_k;
    if (M % 128 || N % 128 || K % 16 || M <= 0 || N <= 0 || K <= 0) {
        std::fprintf(stderr, "sgemm: M and N must be multiples of 128, K of 16\n");
        std::exit(64);
    }
    std::vector<float> ha(static_cast<size_t>(M) * K), hb(static_cast<size_t>(K) * N), hc(static_cast<size_t>(M) * N);
    for (size_t i = 0; i < ha.size(); ++i) ha[i] = unit_value(i, 1);
    for (size_t i = 0; i < hb.size(); ++i) hb[i] = unit_value(i, 2);
    float *d_a, *d_b, *d_c;
    CUDA_CHECK(cudaMalloc(&d_a, ha.size() * 4));
    CUDA_CHECK(cudaMalloc(&d_b, hb.size() * 4));
    CUDA_CHECK(cudaMalloc(&d_c, hc.size() * 4));
    CUDA_CHECK(cudaMemcpy(d_a, ha.data(), ha.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_b, hb.data(), hb.size() * 4, cudaMemcpyHostToDevice));
    for (int variant = 0; variant < 2; ++variant) {
        Result r;
        r.op = "sgemm";
        r.unit = "TFLOPS";
        r.m = M;
        r.nn = N;
        r.k = K;
        r.flops = 2.0 * M * N * K;
        r.block = 256;
        CUDA_CHECK(cudaMemset(d_c, 0xff, hc.size() * 4));
        if (variant == 0) {
            r.variant = "tile128_8x8_db";
            const dim3 grid(N / 128, M / 128);
            r.grid = static_cast<int>(grid.x * grid.y);
            r.smem = 2 * 2 * 8 * 128 * 4;
            r.note = "128x128 tiles, BK 8, 8x8 per thread, double-buffered";
            r.t = time_op([&] { sgemm_128x128<<<grid, 256>>>(d_a, d_b, d_c, M, N, K); }, a.warmup, a.gemm_reps);
        } else {
            r.variant = "tile64_4x4";
            const dim3 grid(N / 64, M / 64);
            r.grid = static_cast<int>(grid.x * grid.y);
            r.smem = 2 * 16 * 64 * 4;
            r.note = "64x64 tiles, BK 16, 4x4 per thread";
            r.t = time_op([&] { sgemm_64x64<<<grid, 256>>>(d_a, d_b, d_c, M, N, K); }, a.warmup, a.gemm_reps);
        }
        CUDA_CHECK(cudaMemcpy(hc.data(), d_c, hc.size() * 4, cudaMemcpyDeviceToHost));
        r.verified = std::all_of(hc.begin(), hc.end(), [](float v) { return std::isfinite(v); });
        if (!r.verified) r.note += ", NOT all entries finite";
        check_gemm(r, M, N, K, a.samples, 0.0, [&](int i, int j) { return hc[static_cast<size_t>(i) * N + j]; },
                   [&](int i, int k) { return ha[static_cast<size_t>(i) * K + k]; },
                   [&](int k, int j) { return hb[static_cast<size_t>(k) * N + j]; });
        report(r);
    }
    CUDA_CHECK(cudaFree(d_a));
    CUDA_CHECK(cudaFree(d_b));
    CUDA_CHECK(cudaFree(d_c));
}

template <int STAGES>
static void run_bf16_variant(const Args& a, const __nv_bfloat16* d_a, const __nv_bfloat16* d_b, __nv_bfloat16* d_c,
                             const std::vector<uint16_t>& ha, const std::vector<uint16_t>& hb,
                             std::vector<uint16_t>& hc) {
    const int M = a.gemm_m, N = a.gemm_n, K = a.gemm_k;
    const size_t smem = bf16_gemm_smem<STAGES>();
    CUDA_CHECK(cudaFuncSetAttribute(bf16_gemm_mma<STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    Result r;
    r.op = "bf16gemm";
    r.variant = "mma_m16n8k16_s" + std::to_string(STAGES);
    r.unit = "TFLOPS";
    r.m = M;
    r.nn = N;
    r.k = K;
    r.flops = 2.0 * M * N * K;
    r.block = 256;
    r.smem = smem;
    const dim3 grid(N / BG_BN, M / BG_BM);
    r.grid = static_cast<int>(grid.x * grid.y);
    r.note = "128x128x32 tiles, 8 warps of 64x32, ldmatrix + mma.sync, cp.async " + std::to_string(STAGES) +
             " stages, bf16 out";
    CUDA_CHECK(cudaMemset(d_c, 0xff, hc.size() * 2));
    r.t = time_op([&] { bf16_gemm_mma<STAGES><<<grid, 256, smem>>>(d_a, d_b, d_c, M, N, K); }, a.warmup,
                  a.gemm_reps);
    CUDA_CHECK(cudaMemcpy(hc.data(), d_c, hc.size() * 2, cudaMemcpyDeviceToHost));
    r.verified = std::all_of(hc.begin(), hc.end(), [](uint16_t v) { return std::isfinite(bf16_bits_to_f32(v)); });
    if (!r.verified) r.note += ", NOT all entries finite";
    check_gemm(r, M, N, K, a.samples, std::ldexp(1.0, -8),
               [&](int i, int j) { return bf16_bits_to_f32(hc[static_cast<size_t>(i) * N + j]); },
               [&](int i, int k) { return bf16_bits_to_f32(ha[static_cast<size_t>(i) * K + k]); },
               [&](int k, int j) { return bf16_bits_to_f32(hb[static_cast<size_t>(k) * N + j]); });
    report(r);
}

static void run_bf16gemm(const Args& a) {
    const int M = a.gemm_m, N = a.gemm_n, K = a.gemm_k;
    if (M % 128 || N % 128 || K % 32 || M <= 0 || N <= 0 || K <= 0) {
        std::fprintf(stderr, "bf16gemm: M and N must be multiples of 128, K of 32\n");
        std::exit(64);
    }
    std::vector<uint16_t> ha(static_cast<size_t>(M) * K), hb(static_cast<size_t>(K) * N), hc(static_cast<size_t>(M) * N);
    for (size_t i = 0; i < ha.size(); ++i) ha[i] = f32_to_bf16_bits(unit_value(i, 3));
    for (size_t i = 0; i < hb.size(); ++i) hb[i] = f32_to_bf16_bits(unit_value(i, 4));
    __nv_bfloat16 *d_a, *d_b, *d_c;
    CUDA_CHECK(cudaMalloc(&d_a, ha.size() * 2));
    CUDA_CHECK(cudaMalloc(&d_b, hb.size() * 2));
    CUDA_CHECK(cudaMalloc(&d_c, hc.size() * 2));
    CUDA_CHECK(cudaMemcpy(d_a, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_b, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
    run_bf16_variant<3>(a, d_a, d_b, d_c, ha, hb, hc);
    run_bf16_variant<4>(a, d_a, d_b, d_c, ha, hb, hc);
    CUDA_CHECK(cudaFree(d_a));
    CUDA_CHECK(cudaFree(d_b));
    CUDA_CHECK(cudaFree(d_c));
}

// ---- JSON ------------------------------------------------------------------------------------

static std::string jstr(const std::string& s) {
    std::string o = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') {
            o += '\\';
            o += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            o += buf;
        } else {
            o += c;
        }
    }
    return o + "\"";
}
static std::string jnum(double v) {
    if (!std::isfinite(v)) return "null";
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.9g", v);
    return buf;
}

static void write_json(const Args& a, const cudaDeviceProp& p, int driver, int runtime) {
    std::string s = "{\n";
    s += "  \"peer\": \"cuda-cpp-kernels\",\n";
    s += "  \"gpu\": " + jstr(p.name) + ",\n";
    s += "  \"cc\": " + jstr(std::to_string(p.major) + "." + std::to_string(p.minor)) + ",\n";
    s += "  \"sm_count\": " + std::to_string(p.multiProcessorCount) + ",\n";
    s += "  \"cuda_driver_api\": " + std::to_string(driver) + ",\n";
    s += "  \"cuda_runtime\": " + std::to_string(runtime) + ",\n";
    s += "  \"cub_version\": " + std::to_string(CUB_VERSION) + ",\n";
    s += "  \"timing\": \"CUDA events on the default stream, a spin kernel queued before each start event; "
         "median and min of reps after warmup\",\n";
    s += "  \"args\": {\"bytes\": " + std::to_string(a.bytes) + ", \"hist_bytes\": " + std::to_string(a.hist_bytes) +
         ", \"cols\": " + std::to_string(a.cols) + ", \"m\": " + std::to_string(a.gemm_m) +
         ", \"n\": " + std::to_string(a.gemm_n) + ", \"k\": " + std::to_string(a.gemm_k) +
         ", \"reps\": " + std::to_string(a.reps) + ", \"gemm_reps\": " + std::to_string(a.gemm_reps) +
         ", \"warmup\": " + std::to_string(a.warmup) + ", \"ops\": " + jstr(a.ops) + "},\n";
    s += "  \"all_verified\": " + std::string(g_all_ok ? "true" : "false") + ",\n";
    s += "  \"results\": [\n";
    for (size_t i = 0; i < g_results.size(); ++i) {
        const Result& r = g_results[i];
        s += "    {\"op\": " + jstr(r.op) + ", \"variant\": " + jstr(r.variant) + ", \"impl\": \"cuda-cpp\"";
        if (r.unit == "TFLOPS")
            s += ", \"m\": " + std::to_string(r.m) + ", \"n\": " + std::to_string(r.nn) + ", \"k\": " + std::to_string(r.k) +
                 ", \"flops\": " + jnum(r.flops);
        else
            s += ", \"n\": " + std::to_string(r.n) + ", \"bytes\": " + jnum(r.bytes);
        s += ", \"unit\": " + jstr(r.unit) + ", \"value\": " + jnum(r.value) + ", \"median_ms\": " + jnum(r.t.median_ms) +
             ", \"min_ms\": " + jnum(r.t.min_ms) + ", \"reps\": " + std::to_string(r.t.reps) +
             ", \"verified\": " + (r.verified ? "true" : "false") + ", \"max_err\": " + jnum(r.max_err) +
             ", \"tol\": " + jnum(r.tol) + ", \"grid\": " + std::to_string(r.grid) + ", \"block\": " +
             std::to_string(r.block) + ", \"smem\": " + std::to_string(r.smem) + ", \"note\": " + jstr(r.note) + "}";
        s += i + 1 < g_results.size() ? ",\n" : "\n";
    }
    s += "  ]\n}\n";
    if (a.json) {
        FILE* f = std::fopen(a.json, "w");
        if (!f) {
            std::fprintf(stderr, "cannot write %s\n", a.json);
            std::exit(2);
        }
        std::fputs(s.c_str(), f);
        std::fclose(f);
    } else {
        std::fputs(s.c_str(), stdout);
    }
}

// ---- main ------------------------------------------------------------------------------------

static void usage() {
    std::fprintf(stderr,
                 "usage: kernels [--bytes N] [--hist-bytes N] [--cols C] [--gemm N | --mnk M,N,K] [--reps R]\n"
                 "               [--gemm-reps R] [--warmup W] [--samples S] [--ops a,b,...] [--json PATH]\n"
                 "  ops: copy,sum,max,scan,softmax,histogram,sgemm,bf16gemm (default all)\n");
}

static long long parse_ll(const char* s, const char* what) {
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s, &end, 10);
    if (errno || !end || *end || v < 0) {
        std::fprintf(stderr, "bad %s: %s\n", what, s);
        std::exit(64);
    }
    return v;
}

int main(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        auto next = [&]() -> const char* {
            if (i + 1 >= argc) {
                usage();
                std::exit(64);
            }
            return argv[++i];
        };
        if (k == "--bytes") a.bytes = static_cast<size_t>(parse_ll(next(), "--bytes"));
        else if (k == "--hist-bytes") a.hist_bytes = static_cast<size_t>(parse_ll(next(), "--hist-bytes"));
        else if (k == "--cols") a.cols = static_cast<int>(parse_ll(next(), "--cols"));
        else if (k == "--gemm") a.gemm_m = a.gemm_n = a.gemm_k = static_cast<int>(parse_ll(next(), "--gemm"));
        else if (k == "--mnk") {
            const char* s = next();
            if (std::sscanf(s, "%d,%d,%d", &a.gemm_m, &a.gemm_n, &a.gemm_k) != 3) {
                std::fprintf(stderr, "bad --mnk: %s\n", s);
                return 64;
            }
        } else if (k == "--reps") a.reps = static_cast<int>(parse_ll(next(), "--reps"));
        else if (k == "--gemm-reps") a.gemm_reps = static_cast<int>(parse_ll(next(), "--gemm-reps"));
        else if (k == "--warmup") a.warmup = static_cast<int>(parse_ll(next(), "--warmup"));
        else if (k == "--samples") a.samples = static_cast<int>(parse_ll(next(), "--samples"));
        else if (k == "--spin-cycles") a.spin_cycles = parse_ll(next(), "--spin-cycles");
        else if (k == "--ops") a.ops = next();
        else if (k == "--json") a.json = next();
        else if (k == "-h" || k == "--help") {
            usage();
            return 0;
        } else {
            usage();
            return 64;
        }
    }
    if (a.reps < 1 || a.gemm_reps < 1) {
        std::fprintf(stderr, "reps must be at least 1\n");
        return 64;
    }
    g_spin_cycles = a.spin_cycles;

    int dev = 0;
    CUDA_CHECK(cudaSetDevice(dev));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    int driver = 0, runtime = 0;
    CUDA_CHECK(cudaDriverGetVersion(&driver));
    CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    std::fprintf(stderr, "%s, cc %d.%d, %d SMs, driver API %d, runtime %d, CUB %d\n", prop.name, prop.major,
                 prop.minor, prop.multiProcessorCount, driver, runtime, CUB_VERSION);

    const bool f32_ops = want(a, "copy") || want(a, "sum") || want(a, "max") || want(a, "scan") || want(a, "softmax");
    if (f32_ops) {
        const size_t n = a.bytes / 4;
        if (n < 1) {
            std::fprintf(stderr, "--bytes must be at least 4\n");
            return 64;
        }
        std::fprintf(stderr, "f32 ops: generating %zu floats\n", n);
        std::vector<float> hx(n);
        for (size_t i = 0; i < n; ++i) hx[i] = int_value(i);
        hx[n - 1] = 9.0f;  // the unique maximum, at the tail
        double ref_sum = 0;
        for (size_t i = 0; i < n; ++i) ref_sum += hx[i];
        const double ref_max = 9.0;
        std::vector<float> hy(n);
        float *d_x, *d_y;
        CUDA_CHECK(cudaMalloc(&d_x, n * 4));
        CUDA_CHECK(cudaMalloc(&d_y, n * 4));
        CUDA_CHECK(cudaMemcpy(d_x, hx.data(), n * 4, cudaMemcpyHostToDevice));

        if (want(a, "copy")) {
            Result r;
            r.op = "copy";
            r.variant = "memcpy_d2d";
            r.unit = "GB/s";
            r.n = n;
            r.bytes = 8.0 * n;
            r.note = "cudaMemcpyAsync device to device; bytes read + written";
            CUDA_CHECK(cudaMemset(d_y, 0xff, n * 4));
            r.t = time_op([&] { CUDA_CHECK(cudaMemcpyAsync(d_y, d_x, n * 4, cudaMemcpyDeviceToDevice, 0)); },
                          a.warmup, a.reps);
            CUDA_CHECK(cudaMemcpy(hy.data(), d_y, n * 4, cudaMemcpyDeviceToHost));
            r.verified = std::memcmp(hy.data(), hx.data(), n * 4) == 0;
            r.max_err = r.verified ? 0 : 1;
            report(r);
        }
        if (want(a, "sum")) run_reduce<SumOp>(a, "sum", d_x, n, ref_sum);
        if (want(a, "max")) run_reduce<MaxOp>(a, "max", d_x, n, ref_max);
        if (want(a, "scan")) {
            run_scan_lookback<4>(a, d_x, d_y, n, hx, hy);
            run_scan_lookback<8>(a, d_x, d_y, n, hx, hy);
            run_scan_cub(a, d_x, d_y, n, hx, hy);
        }
        if (want(a, "softmax")) run_softmax(a, d_x, d_y, n, hx, hy);
        CUDA_CHECK(cudaFree(d_x));
        CUDA_CHECK(cudaFree(d_y));
    }
    if (want(a, "histogram")) run_histogram(a);
    if (want(a, "sgemm")) run_sgemm(a);
    if (want(a, "bf16gemm")) run_bf16gemm(a);

    write_json(a, prop, driver, runtime);
    if (!g_all_ok) std::fprintf(stderr, "SOME CHECKS FAILED\n");
    return g_all_ok ? 0 : 1;
}
