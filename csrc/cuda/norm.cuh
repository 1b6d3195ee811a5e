// RMSNorm of one row, shared by the plain kernel and the one that also writes the int8
// copy the next matvec reads (quant.cuh): both reduce in the same fixed tree with the
// same block size, so they give the same bits.
#pragma once
#include <cstdint>

namespace minfer::cuda {

// A thread per element up to 1024: the norm is one block on the decode critical path.
inline int rms_threads(int64_t d) { return d >= 1024 ? 1024 : (int)((d + 31) / 32 * 32); }

// 1 / sqrt(mean(x^2) + eps) of row xr, in double; every thread of the block gets it.
__device__ __forceinline__ float rms_inv(const float* __restrict__ xr, int64_t d, float eps) {
    __shared__ double red[32];
    __shared__ float sc;
    double ss = 0.0;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) ss += (double)xr[i] * (double)xr[i];
    // Warp butterflies, then the warps' sums in warp order: a fixed tree.
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < (int)blockDim.x / 32; ++w) t += red[w];
        sc = (float)(1.0 / sqrt(t / (double)d + (double)eps));
    }
    __syncthreads();
    return sc;
}

__device__ __forceinline__ float rms_elem(const float* __restrict__ xr, const float* __restrict__ w, int64_t i,
                                          float scale) {
    return w ? xr[i] * scale * w[i] : xr[i] * scale;
}

}  // namespace minfer::cuda
