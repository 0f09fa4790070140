// cuda_pipeline.cu: CUDA C++ reference peer for the pipelined
// host-to-device copy -> kernel -> device-to-host copy benchmark.
//
// Build:  nvcc -O3 -arch=sm_90 -o cuda_pipeline cuda_pipeline.cu
// Run:    ./cuda_pipeline --sizes 10000000,100000000 --kernel scale
//             --chunks 4,8,16,32 --streams 2,4 --reps 20 --json cuda-cpp.json
//         ./cuda_pipeline --sizes 100000000 --kernel intensity --k 1,64,1024 ...
//
// Workload (the same one the PyTorch peer and our Rust implementation run):
//   * n float32 inputs, uniform in [-1, 1), never zero, in pinned host memory;
//     the output goes to a second pinned host buffer.
//   * pipelined mode: the n elements are cut into `chunks` contiguous chunks
//     (chunk = ceil(n / chunks), the last one shorter); chunk i goes to stream
//     i % streams, where it gets cudaMemcpyAsync H2D into one device buffer of
//     n floats (at the chunk's offset), the kernel in place on that chunk, and
//     cudaMemcpyAsync D2H into the output buffer at the same offset. All of it
//     is enqueued up front, then cudaDeviceSynchronize.
//   * engines layout (also mode "pipelined", "layout": "engines" in the JSON):
//     one stream per engine, the copy-in, compute and copy-out streams linked
//     by an event per chunk (H2D of chunk i on the copy-in stream, then the
//     compute stream waits for it and runs the kernel, then the copy-out
//     stream waits for that and copies out), each chunk in its own part of the
//     n-float device buffer (no reuse, so no waits for free scratch): the
//     layout our `Plan::auto` picks, written by hand. Chunk counts: --engines.
//   * sync mode: whole array, one stream: H2D, sync, kernel, sync, D2H, sync.
//   * kernels: scale (x *= 1.5f) and intensity (x = fmaf(x, 0.9999f, 1e-4f),
//     k times, a dependent chain).
//   * every (chunks, streams) combination is timed; the best (lowest median)
//     one per (n, kernel, k, mode) is marked "best": true in the JSON.
//   * timing: 3 warm-up runs, then --reps timed runs, each the host wall time
//     (std::chrono::steady_clock) from just before the first enqueue to just
//     after the final synchronize. Median and min are reported in ms.
//   * every configuration's output is checked against a CPU reference: exact
//     for scale; for intensity |out - ref| <= 1e-5 * max(1, |ref|) (the CPU
//     reference uses a correctly rounded fma, so it is expected to be exact;
//     the largest error seen is printed). Exit status 1 if any check fails.
//
// Streams, pinned buffers and the device buffer are created outside the timed
// region. Every CUDA call is checked; every launch is followed by
// cudaGetLastError. Launch configuration: 4 blocks per SM, 256 threads.

#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <thread>
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

static const float SCALE_S = 1.5f;
static const float INTENSITY_MUL = 0.9999f;
static const float INTENSITY_ADD = 1.0e-4f;
static const int THREADS = 256;
static const int BLOCKS_PER_SM = 4;
static const int WARMUP = 3;
static const double INTENSITY_TOL = 1.0e-5;

// ---------------------------------------------------------------------------
// Device side
// ---------------------------------------------------------------------------

struct ScaleOp {
    float s;
    __device__ __forceinline__ float operator()(float v) const { return __fmul_rn(v, s); }
    __device__ __forceinline__ float4 apply4(float4 v) const {
        v.x = __fmul_rn(v.x, s);
        v.y = __fmul_rn(v.y, s);
        v.z = __fmul_rn(v.z, s);
        v.w = __fmul_rn(v.w, s);
        return v;
    }
};

// k is a runtime value, so the dependent chain cannot be folded.
struct IntensityOp {
    unsigned k;
    float m;
    float a;
    __device__ __forceinline__ float operator()(float v) const {
        for (unsigned i = 0; i < k; ++i) v = __fmaf_rn(v, m, a);
        return v;
    }
    // Four independent chains per thread (instruction-level parallelism).
    __device__ __forceinline__ float4 apply4(float4 v) const {
        for (unsigned i = 0; i < k; ++i) {
            v.x = __fmaf_rn(v.x, m, a);
            v.y = __fmaf_rn(v.y, m, a);
            v.z = __fmaf_rn(v.z, m, a);
            v.w = __fmaf_rn(v.w, m, a);
        }
        return v;
    }
};

// In-place map over x[0..n): scalar head up to the first 16-byte boundary,
// float4 body, scalar tail; grid-stride loops.
template <class Op>
__global__ void __launch_bounds__(256) map_inplace(float* __restrict__ x, size_t n, Op op) {
    const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;

    const size_t mis = (reinterpret_cast<uintptr_t>(x) / sizeof(float)) % 4;
    size_t head = mis ? 4 - mis : 0;
    if (head > n) head = n;
    if (tid < head) x[tid] = op(x[tid]);

    float4* __restrict__ body = reinterpret_cast<float4*>(x + head);
    const size_t nv = (n - head) / 4;
    for (size_t i = tid; i < nv; i += stride) body[i] = op.apply4(body[i]);

    for (size_t i = head + nv * 4 + tid; i < n; i += stride) x[i] = op(x[i]);
}

template <class Op>
static void launch_map(const Op& op, float* x, size_t n, int blocks, cudaStream_t s) {
    map_inplace<Op><<<blocks, THREADS, 0, s>>>(x, n, op);
    CUDA_CHECK(cudaGetLastError());
}

// ---------------------------------------------------------------------------
// Host helpers
// ---------------------------------------------------------------------------

static unsigned host_threads() {
    unsigned t = std::thread::hardware_concurrency();
    if (t == 0) t = 1;
    return std::min(t, 64u);
}

// f(lo, hi, thread_index) over [0, n), split into contiguous ranges.
template <class F>
static void parallel_for(size_t n, F f) {
    unsigned nt = host_threads();
    if (n < (size_t(1) << 16)) nt = 1;
    const size_t per = (n + nt - 1) / nt;
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < nt; ++t) {
        const size_t lo = t * per;
        if (lo >= n) break;
        const size_t hi = std::min(n, lo + per);
        pool.emplace_back(f, lo, hi, t);
    }
    for (auto& th : pool) th.join();
}

static inline uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Uniform in [-1, 1) on a 2^-23 grid, never zero (a zero becomes 0.5f).
static void fill_input(float* x, size_t n, uint64_t seed) {
    parallel_for(n, [=](size_t lo, size_t hi, unsigned) {
        for (size_t i = lo; i < hi; ++i) {
            const uint64_t r = splitmix64(seed + i);
            const int32_t m = static_cast<int32_t>(r >> 40) - (1 << 23);  // [-2^23, 2^23)
            const float v = static_cast<float>(m) * (1.0f / 8388608.0f);
            x[i] = (v == 0.0f) ? 0.5f : v;
        }
    });
}

static void fill_nan(float* x, size_t n) {
    const float q = std::nanf("");
    parallel_for(n, [=](size_t lo, size_t hi, unsigned) {
        for (size_t i = lo; i < hi; ++i) x[i] = q;
    });
}

#if defined(__x86_64__)
// Runtime check for AVX + FMA3 (and OS support for the YMM state).
static bool cpu_has_avx_fma() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "0"(1u), "2"(0u));
    const bool fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    if (!(fma && osxsave && avx)) return false;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 6u) == 6u;
}

// 64 floats at x: k steps of x = fma(x, *m, *a), 8 independent YMM chains.
// vfmadd213ps is a correctly rounded single-precision fma, like fmaf and
// the GPU's fma.rn.f32, so the result is bit-identical to the kernel's.
// Inline assembly so that no -mfma compiler flag is needed.
static void fma_chain64_avx(float* x, unsigned k, const float* m, const float* a) {
    __asm__ volatile(
        "vbroadcastss (%[m]), %%ymm8\n\t"
        "vbroadcastss (%[a]), %%ymm9\n\t"
        "vmovups   0(%[x]), %%ymm0\n\t"
        "vmovups  32(%[x]), %%ymm1\n\t"
        "vmovups  64(%[x]), %%ymm2\n\t"
        "vmovups  96(%[x]), %%ymm3\n\t"
        "vmovups 128(%[x]), %%ymm4\n\t"
        "vmovups 160(%[x]), %%ymm5\n\t"
        "vmovups 192(%[x]), %%ymm6\n\t"
        "vmovups 224(%[x]), %%ymm7\n\t"
        "test %[k], %[k]\n\t"
        "jz 2f\n\t"
        "1:\n\t"
        "vfmadd213ps %%ymm9, %%ymm8, %%ymm0\n\t"
        "vfmadd213ps %%ymm9, %%ymm8, %%ymm1\n\t"
        "vfmadd213ps %%ymm9, %%ymm8, %%ymm2\n\t"
        "vfmadd213ps %%ymm9, %%ymm8, %%ymm3\n\t"
        "vfmadd213ps %%ymm9, %%ymm8, %%ymm4\n\t"
        "vfmadd213ps %%ymm9, %%ymm8, %%ymm5\n\t"
        "vfmadd213ps %%ymm9, %%ymm8, %%ymm6\n\t"
        "vfmadd213ps %%ymm9, %%ymm8, %%ymm7\n\t"
        "dec %[k]\n\t"
        "jnz 1b\n\t"
        "2:\n\t"
        "vmovups %%ymm0,   0(%[x])\n\t"
        "vmovups %%ymm1,  32(%[x])\n\t"
        "vmovups %%ymm2,  64(%[x])\n\t"
        "vmovups %%ymm3,  96(%[x])\n\t"
        "vmovups %%ymm4, 128(%[x])\n\t"
        "vmovups %%ymm5, 160(%[x])\n\t"
        "vmovups %%ymm6, 192(%[x])\n\t"
        "vmovups %%ymm7, 224(%[x])\n\t"
        "vzeroupper\n\t"
        : [k] "+r"(k)
        : [x] "r"(x), [m] "r"(m), [a] "r"(a)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "cc", "memory");
}
#endif

// ref[i] = kernel(in[i]) on the CPU.
static void reference_scale(const float* in, float* ref, size_t n) {
    parallel_for(n, [=](size_t lo, size_t hi, unsigned) {
        for (size_t i = lo; i < hi; ++i) ref[i] = in[i] * SCALE_S;
    });
}

static void reference_intensity(const float* in, float* ref, size_t n, unsigned k) {
    bool use_avx = false;
#if defined(__x86_64__)
    use_avx = cpu_has_avx_fma();
#endif
    parallel_for(n, [=](size_t lo, size_t hi, unsigned) {
        std::memcpy(ref + lo, in + lo, (hi - lo) * sizeof(float));
        size_t i = lo;
#if defined(__x86_64__)
        if (use_avx) {
            const float m = INTENSITY_MUL, a = INTENSITY_ADD;
            for (; i + 64 <= hi; i += 64) fma_chain64_avx(ref + i, k, &m, &a);
        }
#endif
        for (; i < hi; ++i) {
            float v = ref[i];
            for (unsigned j = 0; j < k; ++j) v = std::fmaf(v, INTENSITY_MUL, INTENSITY_ADD);
            ref[i] = v;
        }
    });
}

struct Check {
    bool ok;
    size_t bad;
    size_t first_bad;
    double max_abs_err;
};

// exact: out == ref everywhere; otherwise |out-ref| <= tol * max(1, |ref|).
// NaN (a never-written element: the output is NaN-poisoned before each
// configuration) always fails.
static Check verify(const float* out, const float* ref, size_t n, bool exact, double tol) {
    const unsigned nt = host_threads();
    std::vector<size_t> bad(nt, 0), first(nt, SIZE_MAX);
    std::vector<double> maxerr(nt, 0.0);
    parallel_for(n, [&](size_t lo, size_t hi, unsigned t) {
        size_t b = 0, f = SIZE_MAX;
        double me = 0.0;
        for (size_t i = lo; i < hi; ++i) {
            const double o = out[i], r = ref[i];
            const double e = std::fabs(o - r);
            bool good;
            if (exact) {
                good = (out[i] == ref[i]);
            } else {
                good = (e <= tol * std::max(1.0, std::fabs(r)));
            }
            if (!(e <= me)) me = std::isnan(e) ? INFINITY : e;  // NaN (unwritten) -> inf
            if (!good) {
                if (b == 0) f = i;
                ++b;
            }
        }
        bad[t] = b;
        first[t] = f;
        maxerr[t] = me;
    });
    Check c{true, 0, SIZE_MAX, 0.0};
    for (unsigned t = 0; t < nt; ++t) {
        c.bad += bad[t];
        c.first_bad = std::min(c.first_bad, first[t]);
        if (!(maxerr[t] <= c.max_abs_err)) c.max_abs_err = maxerr[t];
    }
    c.ok = (c.bad == 0);
    return c;
}

static double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t m = v.size() / 2;
    return (v.size() % 2) ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

static double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// ---------------------------------------------------------------------------
// Benchmark
// ---------------------------------------------------------------------------

struct Result {
    size_t n;
    std::string kernel;
    long k;  // -1: null
    std::string mode;
    std::string layout;  // "round-robin" or "engines" (pipelined), "" (sync)
    int chunks;
    int streams;
    double median_ms;
    double min_ms;
    int reps;
    bool verified;
    bool best;
    double max_abs_err;
};

struct Buffers {
    float* h_in;
    float* h_out;
    float* d;
    size_t n;
};

template <class Op>
static double run_pipelined(const Op& op, const Buffers& b, int chunks, int nstreams,
                            const std::vector<cudaStream_t>& streams, int blocks) {
    const size_t chunk = (b.n + chunks - 1) / chunks;
    const double t0 = now_ms();
    for (int i = 0; i < chunks; ++i) {
        const size_t lo = static_cast<size_t>(i) * chunk;
        if (lo >= b.n) break;
        const size_t len = std::min(chunk, b.n - lo);
        cudaStream_t s = streams[i % nstreams];
        CUDA_CHECK(cudaMemcpyAsync(b.d + lo, b.h_in + lo, len * sizeof(float),
                                   cudaMemcpyHostToDevice, s));
        launch_map(op, b.d + lo, len, blocks, s);
        CUDA_CHECK(cudaMemcpyAsync(b.h_out + lo, b.d + lo, len * sizeof(float),
                                   cudaMemcpyDeviceToHost, s));
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    return now_ms() - t0;
}

// The three streams and the per-chunk events of the engines layout.
struct Engines {
    cudaStream_t in, comp, out;
    std::vector<cudaEvent_t> copied, computed;
};

template <class Op>
static double run_engines(const Op& op, const Buffers& b, int chunks, const Engines& e,
                          int blocks) {
    const size_t chunk = (b.n + chunks - 1) / chunks;
    const double t0 = now_ms();
    for (int i = 0; i < chunks; ++i) {
        const size_t lo = static_cast<size_t>(i) * chunk;
        if (lo >= b.n) break;
        const size_t len = std::min(chunk, b.n - lo);
        CUDA_CHECK(cudaMemcpyAsync(b.d + lo, b.h_in + lo, len * sizeof(float),
                                   cudaMemcpyHostToDevice, e.in));
        CUDA_CHECK(cudaEventRecord(e.copied[i], e.in));
        CUDA_CHECK(cudaStreamWaitEvent(e.comp, e.copied[i], 0));
        launch_map(op, b.d + lo, len, blocks, e.comp);
        CUDA_CHECK(cudaEventRecord(e.computed[i], e.comp));
        CUDA_CHECK(cudaStreamWaitEvent(e.out, e.computed[i], 0));
        CUDA_CHECK(cudaMemcpyAsync(b.h_out + lo, b.d + lo, len * sizeof(float),
                                   cudaMemcpyDeviceToHost, e.out));
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    return now_ms() - t0;
}

template <class Op>
static double run_sync(const Op& op, const Buffers& b, cudaStream_t s, int blocks) {
    const double t0 = now_ms();
    CUDA_CHECK(cudaMemcpyAsync(b.d, b.h_in, b.n * sizeof(float), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaDeviceSynchronize());
    launch_map(op, b.d, b.n, blocks, s);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpyAsync(b.h_out, b.d, b.n * sizeof(float), cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaDeviceSynchronize());
    return now_ms() - t0;
}

static void print_row(const Result& r, const Check& c) {
    const double gbs = 2.0 * r.n * sizeof(float) / (r.median_ms * 1e-3) / 1e9;
    char kbuf[24];
    if (r.k < 0) std::snprintf(kbuf, sizeof kbuf, "-");
    else std::snprintf(kbuf, sizeof kbuf, "%ld", r.k);
    std::printf("%11zu  %-9s %5s  %-9s %6d %7d  %10.3f %10.3f %8.1f  %-5s %.3g",
                r.n, r.kernel.c_str(), kbuf, r.layout == "engines" ? "engines" : r.mode.c_str(),
                r.chunks, r.streams,
                r.median_ms, r.min_ms, gbs, r.verified ? "true" : "FALSE", r.max_abs_err);
    if (!c.ok) std::printf("  (%zu bad, first at %zu)", c.bad, c.first_bad);
    std::printf("\n");
    std::fflush(stdout);
}

static void print_header() {
    std::printf("%11s  %-9s %5s  %-9s %6s %7s  %10s %10s %8s  %-5s %s\n", "n", "kernel", "k",
                "mode", "chunks", "streams", "median_ms", "min_ms", "GB/s", "ok", "max_abs_err");
}

template <class Op>
static bool bench_kernel(const Op& op, const std::string& name, long k, const Buffers& b,
                         const float* ref, bool exact, const std::vector<int>& chunk_list,
                         const std::vector<int>& stream_list,
                         const std::vector<cudaStream_t>& streams,
                         const std::vector<int>& engine_list, const Engines& engines, int blocks,
                         int reps, std::vector<Result>& results) {
    bool all_ok = true;
    auto measure = [&](auto run) {
        for (int i = 0; i < WARMUP; ++i) run();
        std::vector<double> t;
        t.reserve(reps);
        for (int i = 0; i < reps; ++i) t.push_back(run());
        return t;
    };
    auto finish = [&](const std::string& mode, const std::string& layout, int chunks,
                      int nstreams, const std::vector<double>& t) {
        const Check c = verify(b.h_out, ref, b.n, exact, INTENSITY_TOL);
        Result r{b.n, name, k, mode, layout, chunks, nstreams, median_of(t),
                 *std::min_element(t.begin(), t.end()), reps, c.ok, mode == "sync",
                 c.max_abs_err};
        print_row(r, c);
        results.push_back(r);
        all_ok = all_ok && c.ok;
    };
    auto poison = [&]() {
        fill_nan(b.h_out, b.n);
        CUDA_CHECK(cudaMemset(b.d, 0xFF, b.n * sizeof(float)));  // 0xFFFFFFFF is a NaN
        CUDA_CHECK(cudaDeviceSynchronize());
    };

    poison();
    finish("sync", "", 1, 1, measure([&]() { return run_sync(op, b, streams[0], blocks); }));

    for (int c : chunk_list) {
        for (int s : stream_list) {
            poison();
            finish("pipelined", "round-robin", c, s, measure([&]() {
                       return run_pipelined(op, b, c, s, streams, blocks);
                   }));
        }
    }
    for (int c : engine_list) {
        poison();
        finish("pipelined", "engines", c, 3,
               measure([&]() { return run_engines(op, b, c, engines, blocks); }));
    }
    return all_ok;
}

// ---------------------------------------------------------------------------
// Arguments, metadata, JSON
// ---------------------------------------------------------------------------

struct Args {
    std::vector<unsigned long long> sizes{10000000ull, 100000000ull};
    std::string kernel = "scale";
    std::vector<unsigned long long> ks{1, 64, 1024};
    std::vector<unsigned long long> chunks{4, 8, 16, 32};
    std::vector<unsigned long long> streams{2, 4};
    std::vector<unsigned long long> engines{8, 12, 16, 24, 32, 48};
    int reps = 20;
    std::string json;
};

[[noreturn]] static void usage(const char* prog, int code) {
    std::fprintf(code ? stderr : stdout,
                 "usage: %s [--sizes N1,N2,...] [--kernel scale|intensity] [--k K1,K2,...]\n"
                 "          [--chunks C1,C2,...] [--streams S1,S2,...] [--engines C1,C2,...]\n"
                 "          [--reps R] [--json PATH]\n"
                 "defaults: --sizes 10000000,100000000 --kernel scale --k 1,64,1024\n"
                 "          --chunks 4,8,16,32 --streams 2,4 --engines 8,12,16,24,32,48 --reps 20\n",
                 prog);
    std::exit(code);
}

static std::vector<unsigned long long> parse_list(const char* flag, const std::string& s,
                                                  unsigned long long max) {
    std::vector<unsigned long long> out;
    size_t pos = 0;
    while (pos <= s.size()) {
        size_t end = s.find(',', pos);
        if (end == std::string::npos) end = s.size();
        const std::string tok = s.substr(pos, end - pos);
        char* e = nullptr;
        errno = 0;
        const unsigned long long v = std::strtoull(tok.c_str(), &e, 10);
        if (tok.empty() || *e != '\0' || errno != 0 || tok[0] == '-' || v == 0 || v > max) {
            std::fprintf(stderr, "error: %s: bad value '%s' (positive integer <= %llu)\n", flag,
                         tok.c_str(), max);
            std::exit(64);
        }
        out.push_back(v);
        pos = end + 1;
    }
    return out;
}

static Args parse_args(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        if (arg == "-h" || arg == "--help") usage(argv[0], 0);
        std::string val;
        const size_t eq = arg.find('=');
        const bool inline_value = arg.rfind("--", 0) == 0 && eq != std::string::npos;
        if (inline_value) {
            val = arg.substr(eq + 1);
            arg = arg.substr(0, eq);
        }
        static const char* const known[] = {"--sizes", "--kernel", "--k", "--chunks",
                                            "--streams", "--engines", "--reps", "--json"};
        if (std::find(std::begin(known), std::end(known), arg) == std::end(known)) {
            std::fprintf(stderr, "error: unknown argument %s\n", arg.c_str());
            usage(argv[0], 64);
        }
        if (!inline_value) {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "error: %s needs a value\n", arg.c_str());
                usage(argv[0], 64);
            }
            val = argv[++i];
        }
        if (arg == "--sizes") {
            a.sizes = parse_list("--sizes", val, 1ull << 40);
        } else if (arg == "--kernel") {
            if (val != "scale" && val != "intensity") {
                std::fprintf(stderr, "error: --kernel must be scale or intensity\n");
                std::exit(64);
            }
            a.kernel = val;
        } else if (arg == "--k") {
            a.ks = parse_list("--k", val, 1ull << 31);
        } else if (arg == "--chunks") {
            a.chunks = parse_list("--chunks", val, 1ull << 20);
        } else if (arg == "--streams") {
            a.streams = parse_list("--streams", val, 1024);
        } else if (arg == "--engines") {
            a.engines = parse_list("--engines", val, 1ull << 20);
        } else if (arg == "--reps") {
            a.reps = static_cast<int>(parse_list("--reps", val, 1000000)[0]);
        } else {  // --json
            a.json = val;
        }
    }
    return a;
}

static bool is_version_token(const std::string& t) {
    if (t.empty() || !std::isdigit(static_cast<unsigned char>(t[0]))) return false;
    bool dot = false;
    for (char ch : t) {
        if (ch == '.') dot = true;
        else if (!std::isdigit(static_cast<unsigned char>(ch))) return false;
    }
    return dot;
}

// First version-like token after "Module" in the first line of
// /proc/driver/nvidia/version, e.g. "NVRM version: NVIDIA UNIX Open Kernel
// Module for x86_64  580.65.06  Release Build ..." -> "580.65.06".
static std::string parse_proc_driver_line(const std::string& s) {
    const size_t mod = s.find("Module");
    size_t pos = (mod == std::string::npos) ? 0 : mod;
    while (pos < s.size()) {
        const size_t b = s.find_first_not_of(" \t\r\n", pos);
        if (b == std::string::npos) break;
        size_t e = s.find_first_of(" \t\r\n", b);
        if (e == std::string::npos) e = s.size();
        const std::string tok = s.substr(b, e - b);
        if (is_version_token(tok)) return tok;
        pos = e;
    }
    return "";
}

// NVIDIA kernel driver version ("580.65.06"), or "" if unknown.
static std::string driver_version() {
    if (FILE* f = std::fopen("/proc/driver/nvidia/version", "r")) {
        char line[1024];
        std::string found;
        if (std::fgets(line, sizeof line, f)) found = parse_proc_driver_line(line);
        std::fclose(f);
        if (!found.empty()) return found;
    }
    if (FILE* p = popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null",
                        "r")) {
        char line[256] = {0};
        std::string s;
        if (std::fgets(line, sizeof line, p)) s = line;
        pclose(p);
        while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' '))
            s.pop_back();
        if (is_version_token(s)) return s;
    }
    return "";
}

static std::string json_str(const std::string& s) {
    std::string o = "\"";
    for (unsigned char ch : s) {
        if (ch == '"') o += "\\\"";
        else if (ch == '\\') o += "\\\\";
        else if (ch < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", ch);
            o += buf;
        } else o += static_cast<char>(ch);
    }
    return o + "\"";
}

static bool write_json(const std::string& path, const std::string& gpu, const std::string& driver,
                       const std::vector<Result>& results) {
    FILE* f = std::fopen(path.c_str(), "w");
    if (!f) {
        std::perror(path.c_str());
        return false;
    }
    std::fprintf(f, "{\"peer\": \"cuda-cpp\", \"gpu\": %s, \"driver\": %s,\n \"results\": [",
                 json_str(gpu).c_str(), driver.empty() ? "null" : json_str(driver).c_str());
    for (size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        char kbuf[24];
        if (r.k < 0) std::snprintf(kbuf, sizeof kbuf, "null");
        else std::snprintf(kbuf, sizeof kbuf, "%ld", r.k);
        std::fprintf(f,
                     "%s\n  {\"n\": %zu, \"kernel\": %s, \"k\": %s, \"mode\": %s, \"layout\": %s, "
                     "\"chunks\": %d, "
                     "\"streams\": %d, \"median_ms\": %.6f, \"min_ms\": %.6f, \"reps\": %d, "
                     "\"verified\": %s, \"best\": %s}",
                     i ? "," : "", r.n, json_str(r.kernel).c_str(), kbuf,
                     json_str(r.mode).c_str(), r.layout.empty() ? "null" : json_str(r.layout).c_str(),
                     r.chunks, r.streams, r.median_ms, r.min_ms, r.reps,
                     r.verified ? "true" : "false", r.best ? "true" : "false");
    }
    std::fprintf(f, "\n]}\n");
    const bool ok = (std::fclose(f) == 0);
    if (!ok) std::perror(path.c_str());
    return ok;
}

// best = lowest median among the verified results (among all if none is
// verified) of each (n, kernel, k, mode).
static void mark_best(std::vector<Result>& results) {
    for (size_t i = 0; i < results.size(); ++i) {
        Result& r = results[i];
        bool any_verified = false;
        for (const Result& o : results)
            if (o.n == r.n && o.kernel == r.kernel && o.k == r.k && o.mode == r.mode && o.verified)
                any_verified = true;
        size_t best = SIZE_MAX;
        for (size_t j = 0; j < results.size(); ++j) {
            const Result& o = results[j];
            if (o.n != r.n || o.kernel != r.kernel || o.k != r.k || o.mode != r.mode) continue;
            if (any_verified && !o.verified) continue;
            if (best == SIZE_MAX || o.median_ms < results[best].median_ms) best = j;
        }
        r.best = (best == i);
    }
}

int main(int argc, char** argv) {
    const Args args = parse_args(argc, argv);

    const int dev = 0;
    CUDA_CHECK(cudaSetDevice(dev));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int blocks = BLOCKS_PER_SM * sms;
    int drv_api = 0, rt_api = 0;
    CUDA_CHECK(cudaDriverGetVersion(&drv_api));
    CUDA_CHECK(cudaRuntimeGetVersion(&rt_api));
    const std::string gpu = prop.name;
    const std::string driver = driver_version();

    std::printf("peer: cuda-cpp\ngpu: %s (%d SMs)\ndriver: %s (CUDA driver API %d, runtime %d)\n",
                gpu.c_str(), sms, driver.empty() ? "unknown" : driver.c_str(), drv_api, rt_api);
    std::printf("launch: %d blocks x %d threads; warm-up %d, reps %d; host threads %u\n", blocks,
                THREADS, WARMUP, args.reps, host_threads());

    unsigned long long max_streams = 1;
    for (auto s : args.streams) max_streams = std::max(max_streams, s);
    std::vector<cudaStream_t> streams(max_streams);
    for (auto& s : streams) CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

    std::vector<int> chunk_list(args.chunks.begin(), args.chunks.end());
    std::vector<int> engine_list(args.engines.begin(), args.engines.end());
    Engines engines;
    CUDA_CHECK(cudaStreamCreateWithFlags(&engines.in, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&engines.comp, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&engines.out, cudaStreamNonBlocking));
    int max_engine_chunks = 0;
    for (int c : engine_list) max_engine_chunks = std::max(max_engine_chunks, c);
    for (int i = 0; i < max_engine_chunks; ++i) {
        cudaEvent_t a, c;
        CUDA_CHECK(cudaEventCreateWithFlags(&a, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&c, cudaEventDisableTiming));
        engines.copied.push_back(a);
        engines.computed.push_back(c);
    }
    std::vector<int> stream_list(args.streams.begin(), args.streams.end());

    std::random_device rd;
    const uint64_t seed = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                          static_cast<uint64_t>(
                              std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("input seed: 0x%016llx\n\n", static_cast<unsigned long long>(seed));
    print_header();

    std::vector<Result> results;
    bool all_ok = true;
    for (unsigned long long n64 : args.sizes) {
        const size_t n = static_cast<size_t>(n64);
        Buffers b{nullptr, nullptr, nullptr, n};
        CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&b.h_in), n * sizeof(float)));
        CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&b.h_out), n * sizeof(float)));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.d), n * sizeof(float)));
        fill_input(b.h_in, n, splitmix64(seed ^ n));
        float* ref = static_cast<float*>(std::malloc(n * sizeof(float)));
        if (!ref) {
            std::fprintf(stderr, "error: out of host memory for the reference\n");
            return 2;
        }

        if (args.kernel == "scale") {
            reference_scale(b.h_in, ref, n);
            all_ok &= bench_kernel(ScaleOp{SCALE_S}, "scale", -1, b, ref, true, chunk_list,
                                   stream_list, streams, engine_list, engines, blocks, args.reps,
                                   results);
        } else {
            for (unsigned long long k : args.ks) {
                reference_intensity(b.h_in, ref, n, static_cast<unsigned>(k));
                all_ok &= bench_kernel(
                    IntensityOp{static_cast<unsigned>(k), INTENSITY_MUL, INTENSITY_ADD},
                    "intensity", static_cast<long>(k), b, ref, false, chunk_list, stream_list,
                    streams, engine_list, engines, blocks, args.reps, results);
            }
        }

        std::free(ref);
        CUDA_CHECK(cudaFree(b.d));
        CUDA_CHECK(cudaFreeHost(b.h_out));
        CUDA_CHECK(cudaFreeHost(b.h_in));
    }

    mark_best(results);
    std::printf("\nbest pipelined configuration per (n, kernel, k):\n");
    for (const Result& r : results) {
        if (!r.best || r.mode != "pipelined") continue;
        double sync_ms = 0.0;
        for (const Result& o : results)
            if (o.mode == "sync" && o.n == r.n && o.kernel == r.kernel && o.k == r.k)
                sync_ms = o.median_ms;
        const std::string kstr = r.k < 0 ? std::string("-") : std::to_string(r.k);
        std::printf("  n=%zu kernel=%s k=%s: chunks=%d streams=%d (%s) median %.3f ms (min %.3f), "
                    "sync %.3f ms, speed-up %.2fx%s\n",
                    r.n, r.kernel.c_str(), kstr.c_str(), r.chunks, r.streams, r.layout.c_str(),
                    r.median_ms, r.min_ms,
                    sync_ms, sync_ms / r.median_ms, r.verified ? "" : "  [NOT VERIFIED]");
    }

    for (auto& s : streams) CUDA_CHECK(cudaStreamDestroy(s));

    if (!args.json.empty()) {
        if (!write_json(args.json, gpu, driver, results)) return 2;
        std::printf("wrote %s\n", args.json.c_str());
    }
    if (!all_ok) {
        std::fprintf(stderr, "error: verification FAILED for at least one configuration\n");
        return 1;
    }
    std::printf("verified: true (all configurations)\n");
    return 0;
}
