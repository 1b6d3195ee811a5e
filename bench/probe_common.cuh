// What bench/stream_probe.cu and bench/tail_probe.cu share: the error check, a pool of
// device memory larger than L2 handed out in rotation, and event timing of back-to-back
// launches. Standalone probes: no minfer code.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                              \
    do {                                                                   \
        cudaError_t e_ = (x);                                              \
        if (e_ != cudaSuccess) {                                           \
            std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
            std::exit(1);                                                  \
        }                                                                  \
    } while (0)

// A sink the reads' checksums may go to, so the compiler keeps the loads.
__device__ unsigned g_sink;

struct Pool {
    uint8_t* base;
    size_t size, used = 0;
    // The next region of n bytes, wrapping: consecutive launches read disjoint bytes.
    uint8_t* next(size_t n) {
        n = (n + 4095) / 4096 * 4096;
        if (used + n > size) used = 0;
        uint8_t* p = base + used;
        used += n;
        return p;
    }
};

// Median event time (us) of reps launches, each alone, after three warm-up ones;
// launch(p) reads the region p of the pool.
template <class F>
double time_us(Pool& pool, size_t bytes, F launch, int reps = 41) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> t;
    for (int r = 0; r < reps + 3; ++r) {
        uint8_t* p = pool.next(bytes);
        CK(cudaEventRecord(a));
        launch(p);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (r >= 3) t.push_back(ms * 1000.0f);
    }
    CK(cudaGetLastError());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}
