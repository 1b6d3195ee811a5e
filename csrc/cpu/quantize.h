// Weight quantizers for `minfer quantize` (python/minfer/tools/quantize.py): f32 rows ->
// GGUF blocks of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16 or F32, and
// back (the requantize path and tests). Not on the inference hot path.
//
// The block quantizers follow ggml's reference quantizers (quantize_row_*_ref in
// ggml-quants.c, the ones llama-quantize runs without an importance matrix) operation for
// operation, in the same float order and without FMA contraction, so they produce the same
// bytes; tests/test_quantize.py checks that against a build of ggml's own file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/ggml_types.h"

namespace minfer::cpu::qz {

constexpr int32_t T_BF16 = 30;  // GGUF type id of bfloat16 (not a kernel weight type)

// The GGUF type id of a name ("Q4_K", "bf16", ...; any case), or -1.
int32_t type_from_name(const std::string& name);
const char* type_name(int32_t type);
// Whether quantize_rows can produce this type.
bool can_quantize(int32_t type);
// Whether dequantize_rows can read this type (every quantize type, plus Q8_K).
bool can_dequantize(int32_t type);
int type_block(int32_t type);                   // elements per block; 0 if unknown
size_t row_bytes(int32_t type, int64_t n);       // 0 if n is not a whole number of blocks

// nrows rows of n_per_row floats (contiguous) -> nrows * row_bytes(type, n_per_row) bytes.
// Rows are split over n_threads threads; the bytes do not depend on n_threads.
void quantize_rows(int32_t type, const float* src, int64_t nrows, int64_t n_per_row, void* dst, int n_threads);
// The inverse (exactly ggml's dequantization).
void dequantize_rows(int32_t type, const void* src, int64_t nrows, int64_t n_per_row, float* dst, int n_threads);

// One row, single-threaded (tests and the reference comparison).
void quantize_row(int32_t type, const float* x, void* y, int64_t n);

}  // namespace minfer::cpu::qz
