// Quantized dot products and (de)quantization for the CPU backend.
//
// Weights stay in their GGUF block format (mmap'd, never copied). Activations are
// quantized once per matmul input into the integer format that pairs with the
// weight type (ADR-0013): Q8_0 blocks for the 32-element family, Q8_K blocks for
// the K-quants, plain f32 for F32/F16 weights. Dot products then run on integer
// SIMD instructions.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/ggml_types.h"

namespace minfer::cpu {

// Which implementation the dispatchers call. Simd is the widest path compiled into
// this build (AVX-512 > AVX2 > NEON); Scalar is the portable fallback. Both are always
// compiled so tests can pin each against the reference.
enum class KernelPath : int { Scalar = 0, Simd = 1 };
void set_kernel_path(KernelPath p);
KernelPath kernel_path();
const char* simd_path_name();  // "avx512", "avx2", "neon" or "scalar"

bool weight_type_supported(int32_t wtype);

// The activation format paired with a weight type: T_Q8_0, T_Q8_K or T_F32.
int32_t act_type_for(int32_t wtype);
// Bytes of one activation row of n elements in act_type_for(wtype).
size_t act_row_bytes(int32_t wtype, int64_t n);
// x (n floats) -> dst in act_type_for(wtype). n must be a multiple of the weight block.
void quantize_act_row(int32_t wtype, const float* x, void* dst, int64_t n);

// Dot product of one weight row (wtype, n elements) with one activation row that was
// produced by quantize_act_row(wtype, ...).
float vec_dot(int32_t wtype, int64_t n, const void* wrow, const void* arow);

// Tile form used by the matmul: out[a * out_stride + w] = dot(weight row w, act row a)
// for w < nw, a < na. Lets a SIMD path reuse each weight block across several tokens.
void vec_dot_tile(int32_t wtype, int64_t n,
                  const void* w, size_t w_stride, int nw,
                  const void* a, size_t a_stride, int na,
                  float* out, size_t out_stride);

// src (n elements of type) -> f32. Works for every supported weight type and for Q8_K.
void dequantize_row(int32_t type, const void* src, float* dst, int64_t n);

// Reference quantizers for weights (used by tests to build inputs; not on the hot path).
void quantize_row_q8_0_ref(const float* x, block_q8_0* y, int64_t n);
void quantize_row_q8_K_ref(const float* x, block_q8_K* y, int64_t n);

}  // namespace minfer::cpu
