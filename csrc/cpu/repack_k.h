// K-quant weights (Q4_K, Q5_K, Q6_K) in interleaved 16-row groups: the layout and matmul of
// cpu/repack.h for the 256-element super-blocks, against Q8_K activations.
//
// Each (row, token) result is, over super-blocks in order,
//   Q4_K, Q5_K: acc = fma(d * d_a, (float)S, acc);  acc = fma(-(dmin * d_a), (float)M, acc)
//   Q6_K: acc = fma(d * d_a, (float)S, acc)
// with S = sum over sub-blocks of scale * (exact integer sub-block dot) and M = sum of
// min * (activation sub-block sum), both exact in int32. So, as for the 32-element
// family, prefill, decode and every thread split agree bitwise; against the unpacked
// kernels (quants_k.cpp) only the float rounding of the per-block terms differs.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cpu/repack.h"

namespace minfer::cpu::repack::k {

// Q4_K, Q5_K and Q6_K, in builds with AVX2 or wider.
bool handles(int32_t type);
// Blocks of 16 tokens and more run on the AMX tiles (repack_k_amx.cpp) where the build
// targets them and the OS grants the tile state (bitwise the vector kernel's results).
// set_amx(false) makes this process take the vector kernel (tests compare the two).
bool amx_available();
void set_amx(bool on);
uint64_t amx_calls();  // matmul calls that ran on the tiles so far
// Bytes of one 16-row group of nb super-blocks (a multiple of 64).
size_t group_bytes(int32_t type, int64_t nb);
// One group from its 16 GGUF rows (null: padding row, zero weights).
void pack_group(int32_t type, const uint8_t* const rows[16], int64_t nb, uint8_t* dst);
// As repack::matmul, activations in Q8_K rows of arb bytes.
void matmul(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, float* y, int64_t ldy, int64_t r0,
            int64_t r1, const uint8_t* meta);
// repack::meta_block_bytes / act_meta for Q8_K activations.
size_t meta_block_bytes();
void act_meta(const uint8_t* blocks, int64_t n, uint8_t* meta);

}  // namespace minfer::cpu::repack::k
