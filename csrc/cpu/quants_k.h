#pragma once
#include <cstddef>
#include <cstdint>
#include "common/ggml_types.h"
namespace minfer::cpu::kq {
void quantize_row_q8_K(const float* x, block_q8_K* y, int64_t n, bool simd);  // deterministic: SIMD and scalar give identical bytes (tests/test_repack_k.py pins it)
float vec_dot(int32_t wtype, int64_t n, const void* w, const block_q8_K* a, bool simd);  // wtype in {T_Q4_K, T_Q5_K, T_Q6_K}; n multiple of 256
void vec_dot_tile(int32_t wtype, int64_t n, const void* w, size_t w_stride, int nw, const void* a, size_t a_stride, int na, float* out, size_t out_stride, bool simd);
     // out[ia*out_stride + iw] = vec_dot(weight row iw, act row ia); nw <= 16, na <= 4 in practice
void dequantize_row(int32_t type, const void* src, float* dst, int64_t n);   // T_Q4_K, T_Q5_K, T_Q6_K, T_Q8_K
}
