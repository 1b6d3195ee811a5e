// RMSNorm of one row, shared by the plain kernel, the one that also writes the int8
// copy the next matvec reads (quant.cuh) and the matvec whose last block normalizes
// its own output (k_matvec.cu): all reduce in the same fixed tree, that of a block of
// rms_threads(d) threads, so they give the same bits whatever block runs it.
#pragma once
#include <cstdint>

namespace minfer::cuda {

// A thread per element up to 1024: the norm is one block on the decode critical path.
__host__ __device__ inline int rms_threads(int64_t d) { return d >= 1024 ? 1024 : (int)((d + 31) / 32 * 32); }

// 1 / sqrt(mean(x^2) + eps) of row xr, in double; every thread of the block gets it.
// The tree is that of T threads (a multiple of 32, at most 1024): virtual thread t
// sums elements t, t + T, ... in order, each virtual warp reduces by a butterfly, then
// the virtual warps' sums are added in order. A block of fewer threads runs virtual
// warps w, w + nwarps, ... on its warp w: the same sums, so the same bits. x is read
// through L2 (__ldcg): in the matvec's tail, other blocks wrote it during the launch.
__device__ __forceinline__ float rms_inv(const float* __restrict__ xr, int64_t d, float eps, int T) {
    __shared__ double red[32];
    __shared__ float sc;
    const int lane = threadIdx.x % 32, nw = blockDim.x / 32;
    for (int vw = threadIdx.x / 32; vw < T / 32; vw += nw) {
        double ss = 0.0;
        for (int64_t i = vw * 32 + lane; i < d; i += T) {
            const double v = (double)__ldcg(xr + i);
            ss = __fma_rn(v, v, ss);
        }
        for (int o = 16; o > 0; o >>= 1) ss = __dadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
        if (lane == 0) red[vw] = ss;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < T / 32; ++w) t = __dadd_rn(t, red[w]);
        sc = (float)(1.0 / sqrt(t / (double)d + (double)eps));
    }
    __syncthreads();
    return sc;
}

__device__ __forceinline__ float rms_elem(const float* __restrict__ xr, const float* __restrict__ w, int64_t i,
                                          float scale) {
    const float v = __fmul_rn(__ldcg(xr + i), scale);
    return w ? __fmul_rn(v, w[i]) : v;
}

}  // namespace minfer::cuda
