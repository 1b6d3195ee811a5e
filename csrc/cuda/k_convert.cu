// The prefill GEMM's operands in f16 (a quantized weight dequantized, f32 activations
// converted), its bias add, and embedding rows gathered from (quantized) tables: element
// conversions by deq32 (cuda/quant.cuh), the formulas the CPU dequantizes with.
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/context.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/quant.cuh"

namespace minfer::cuda {

namespace {

template <int T>
__global__ void k_dequant_f16(const uint8_t* __restrict__ W, size_t row_bytes, int n_chunks, int64_t total,
                              __half* __restrict__ out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int64_t row = i / n_chunks;
    const int c = (int)(i % n_chunks);
    float v[32];
    deq32<T>(W + (size_t)row * row_bytes, c, n_chunks, v);
    store_half32(v, reinterpret_cast<uint4*>(out + row * (int64_t)n_chunks * 32 + c * 32));
}

template <int T>
__global__ void k_get_rows_q(const uint8_t* __restrict__ table, size_t row_bytes, int n_chunks,
                             const int32_t* __restrict__ ids, int64_t n_rows, float* __restrict__ y, int* err) {
    pdl_wait();
    pdl_trigger();
    const int64_t t = blockIdx.x;
    const int32_t id = ids[t];
    float* yr = y + t * (int64_t)n_chunks * 32;
    const bool ok = id >= 0 && id < n_rows;
    if (!ok && threadIdx.x == 0) *err = 1;
    for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) {
        float v[32];
        if (ok) {
            deq32<T>(table + (size_t)id * row_bytes, c, n_chunks, v);
        } else {
#pragma unroll
            for (int j = 0; j < 32; ++j) v[j] = 0.0f;
        }
        float4* o = reinterpret_cast<float4*>(yr + c * 32);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
}

// F32/F16 tables whose rows are not a whole number of 32-element chunks.
__global__ void k_get_rows_plain(int32_t wtype, const uint8_t* __restrict__ table, size_t row_bytes, int64_t d,
                                 const int32_t* __restrict__ ids, int64_t n_rows, float* __restrict__ y, int* err) {
    pdl_wait();
    pdl_trigger();
    const int64_t t = blockIdx.x;
    const int32_t id = ids[t];
    const bool ok = id >= 0 && id < n_rows;
    if (!ok && threadIdx.x == 0) *err = 1;
    const uint8_t* r = table + (size_t)(ok ? id : 0) * row_bytes;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        float v = 0.0f;
        if (ok) v = wtype == T_F32 ? reinterpret_cast<const float*>(r)[i] : h2f(reinterpret_cast<const uint16_t*>(r)[i]);
        y[t * d + i] = v;
    }
}

__global__ void k_f32_to_f16(const float* __restrict__ x, __half* __restrict__ y, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half_rn(x[i]);
}

// The same conversion, 4 elements a thread: one 16-byte load, one 8-byte store.
__global__ void k_f32_to_f16_x4(const float4* __restrict__ x, uint2* __restrict__ y, int64_t n4) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const float4 v = x[i];
    uint2 u;
    __half2* h = reinterpret_cast<__half2*>(&u);
    h[0] = __floats2half2_rn(v.x, v.y);
    h[1] = __floats2half2_rn(v.z, v.w);
    y[i] = u;
}

__global__ void k_add_bias_rows(float* __restrict__ y, const float* __restrict__ bias, int64_t nt, int64_t out_dim) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < nt * out_dim) y[i] += bias[i % out_dim];
}

}  // namespace

void dequant_f16(int32_t wtype, const void* W, size_t row_bytes, int64_t in_dim, int64_t rows, void* out,
                 void* stream) {
    const int n_chunks = (int)(in_dim / 32);
    const int64_t total = rows * n_chunks;
    cudaStream_t st = stream ? (cudaStream_t)stream : lane().stream;
    dispatch_type(wtype, [&] <int T>() {
        k_dequant_f16<T><<<blocks_for(total, 256), 256, 0, st>>>((const uint8_t*)W, row_bytes, n_chunks, total,
                                                                  (__half*)out);
    });
    note_launch();
}

void f32_to_f16(const float* x, void* y, int64_t n) {
    // __floats2half2_rn rounds each half as __float2half_rn does: same bits either way.
    if (n % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)y % 8 == 0) {
        const int64_t n4 = n / 4;
        k_f32_to_f16_x4<<<blocks_for(n4, 256), 256, 0, lane().stream>>>((const float4*)x, (uint2*)y, n4);
    } else {
        k_f32_to_f16<<<blocks_for(n, 256), 256, 0, lane().stream>>>(x, (__half*)y, n);
    }
    note_launch();
}

void add_bias_rows(float* y, const float* bias, int64_t nt, int64_t out_dim) {
    k_add_bias_rows<<<blocks_for(nt * out_dim, 256), 256, 0, lane().stream>>>(y, bias, nt, out_dim);
    note_launch();
}

void get_rows_w(int32_t wtype, const void* table, size_t row_bytes, int64_t d, const int32_t* ids, int64_t n,
                int64_t n_rows, float* y, int* err) {
    if ((wtype == T_F32 || wtype == T_F16) && d % 32 != 0) {
        k_get_rows_plain<<<(unsigned)n, 128, 0, lane().stream>>>(wtype, (const uint8_t*)table, row_bytes, d, ids,
                                                                 n_rows, y, err);
    } else {
        dispatch_type(wtype, [&] <int T>() {
            k_get_rows_q<T><<<(unsigned)n, 128, 0, lane().stream>>>((const uint8_t*)table, row_bytes, (int)(d / 32),
                                                                    ids, n_rows, y, err);
        });
    }
    note_launch();
}

}  // namespace minfer::cuda
