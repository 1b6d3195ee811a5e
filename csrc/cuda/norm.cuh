// RMSNorm's reduction, shared by every kernel that normalizes a row or consumes a norm's
// deferred int8 copy (k_ops.cu, k_matvec.cu). The tree depends on the row length alone:
// the sum of squares of each aligned 32-element group (double, one warp butterfly),
// then lane l adds the groups l, l + 32, l + 64, ... in order, then one more butterfly.
// A block of any size and a matvec reading the groups' sums get the same bits from it.
#pragma once
#include <cstdint>

#include "cuda/kernels.h"

namespace minfer::cuda {

// A thread per element up to 1024: the norm is one block on the decode critical path.
__host__ __device__ inline int rms_threads(int64_t d) { return d >= 1024 ? 1024 : (int)((d + 31) / 32 * 32); }

constexpr int64_t kRmsMaxGroups = kRmsMaxRow / 32;  // the groups' sums live in shared memory

// The sum of squares of one 32-element group, v being this lane's element (0 past the
// row's end); every lane of the warp gets it.
__device__ __forceinline__ double group_ss(float v) {
    double s = __dmul_rn((double)v, (double)v);
    for (int o = 16; o > 0; o >>= 1) s = __dadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    return s;
}

// 1 / sqrt(mean + eps) from a lane's in-order sum of its groups' sums; every lane gets it.
__device__ __forceinline__ float rms_scale(double lane_sum, int64_t d, float eps) {
    for (int o = 16; o > 0; o >>= 1) lane_sum = __dadd_rn(lane_sum, __shfl_xor_sync(0xffffffffu, lane_sum, o));
    return (float)(1.0 / sqrt(lane_sum / (double)d + (double)eps));
}

// The scale of a row whose group sums are ss[0 .. ng), by one warp.
__device__ __forceinline__ float rms_scale_of(const double* ss, int64_t ng, int64_t d, float eps, int lane) {
    double s = 0.0;
    for (int64_t g = lane; g < ng; g += 32) s = __dadd_rn(s, ss[g]);
    return rms_scale(s, d, eps);
}

// 1 / sqrt(mean(x^2) + eps) of row xr (d <= kRmsMaxRow), by the whole block; every
// thread gets it. x is read through L2 (__ldcg): a fused launch's other blocks may have
// written it.
__device__ __forceinline__ float rms_inv(const float* __restrict__ xr, int64_t d, float eps) {
    __shared__ double red[kRmsMaxGroups];
    __shared__ float sc;
    const int lane = threadIdx.x % 32, nw = blockDim.x / 32;
    const int64_t ng = (d + 31) / 32;
    for (int64_t g = threadIdx.x / 32; g < ng; g += nw) {
        const int64_t i = g * 32 + lane;
        const double s = group_ss(i < d ? __ldcg(xr + i) : 0.0f);
        if (lane == 0) red[g] = s;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const float r = rms_scale_of(red, ng, d, eps, lane);
        if (lane == 0) sc = r;
    }
    __syncthreads();
    return sc;
}

// The same scale by one warp (every lane gets it): group g's sum of squares, then lane l
// adds groups l, l + 32, ... in order, as rms_inv's block does.
__device__ __forceinline__ float warp_rms_inv(const float* __restrict__ xr, int64_t d, float eps, int lane) {
    const int64_t ng = (d + 31) / 32;
    double s = 0.0;
    for (int64_t g = 0; g < ng; ++g) {
        const int64_t i = g * 32 + lane;
        const double ss = group_ss(i < d ? __ldcg(xr + i) : 0.0f);
        if ((g & 31) == lane) s = __dadd_rn(s, ss);
    }
    return rms_scale(s, d, eps);
}

__device__ __forceinline__ float rms_elem(const float* __restrict__ xr, const float* __restrict__ w, int64_t i,
                                          float scale) {
    const float v = __fmul_rn(__ldcg(xr + i), scale);
    return w ? __fmul_rn(v, w[i]) : v;
}

}  // namespace minfer::cuda
