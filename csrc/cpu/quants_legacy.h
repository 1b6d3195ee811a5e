// Kernels for the 32-element block family (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights against
// Q8_0 activations) and for F32/F16 weights (against f32 activations). Private to the
// dispatcher in quants.cpp; the public surface is quants.h.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/ggml_types.h"

namespace minfer::cpu::legacy {

// "avx512", "avx2", "neon" or "scalar": what simd=true runs in this build.
const char* simd_name();

bool handles(int32_t wtype);  // F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

// Same bytes whichever path runs (round half away from zero, as ggml's reference).
void quantize_row_q8_0(const float* x, block_q8_0* y, int64_t n, bool simd);

// out[a * out_stride + w] = dot(weight row w, activation row a). Each (w, a) result is
// computed by the same instruction sequence whatever nw/na/position in the tile, so a
// row's output does not depend on how the matmul was tiled or threaded.
void vec_dot_tile(int32_t wtype, int64_t n, const void* w, size_t w_stride, int nw,
                  const void* a, size_t a_stride, int na, float* out, size_t out_stride,
                  bool simd);

// F32, F16 and the 32-element family (Q8_0 included) -> f32, exactly as ggml/gguf.
void dequantize_row(int32_t type, const void* src, float* dst, int64_t n);

}  // namespace minfer::cpu::legacy
