// How the device stores a weight's rows. GGUF blocks of 18/20/22/24/34/210 bytes put
// the quants at 2-byte alignment, so a kernel reading them natively issues many narrow
// loads, and the decode matvec is bound by the instructions it issues, not by DRAM.
// At upload such rows are split into arrays within the row (all quants, then the high
// bits, then the scales), and rows are padded to 16 bytes, so every quant load is one
// 16-byte load. Q4_K and Q5_K blocks (144 / 176 bytes) are aligned as they are and stay
// in their GGUF layout, as do F32 and F16.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/ggml_types.h"

namespace minfer::cuda {

#if defined(__CUDACC__)
#define MC_HD __host__ __device__ __forceinline__
#else
#define MC_HD inline
#endif

// Rearranged in the device copy (offsets below); the others keep their GGUF bytes.
MC_HD bool packed_layout(int32_t t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0 || t == T_Q6_K;
}

// Byte offsets inside a packed row of nb 32-element blocks (Q6_K: ns = nb / 8 superblocks).
//   Q4_0: qs[16] per block, then d (f16)          Q4_1: qs[16], then (d, m) f16 pairs
//   Q5_0: qs[16], then qh (u32), then d           Q5_1: qs[16], then qh, then (d, m)
//   Q8_0: qs[32], then d
//   Q6_K: ql[128] per superblock, then qh[64], then scales[16], then d (f16)
// The bytes of each field are those of the GGUF block, so decoding formulas stay ggml's.
struct Packed {
    int qs_bytes;   // quant bytes per 32-element block (legacy types)
    int qh_at;      // offset of the qh array / nb (0: none), in bytes per block
    int sc_at;      // offset of the scale array, in bytes per block
};
MC_HD Packed packed_fields(int32_t t) {
    switch (t) {
        case T_Q4_0: return {16, 0, 16};
        case T_Q4_1: return {16, 0, 16};
        case T_Q5_0: return {16, 16, 20};
        case T_Q5_1: return {16, 16, 20};
        case T_Q8_0: return {32, 0, 32};
        default: return {0, 0, 0};
    }
}

// Device row stride: the GGUF row size, padded to 16 bytes when the layout is packed.
MC_HD size_t device_row_bytes(int32_t t, size_t row_bytes) {
    return packed_layout(t) ? (row_bytes + 15) / 16 * 16 : row_bytes;
}

// Q6_K packed offsets within a row of ns superblocks.
MC_HD size_t q6k_ql(int s) { return (size_t)128 * s; }
MC_HD size_t q6k_qh(int ns, int s) { return (size_t)128 * ns + (size_t)64 * s; }
MC_HD size_t q6k_sc(int ns, int s) { return (size_t)192 * ns + (size_t)16 * s; }
MC_HD size_t q6k_d(int ns, int s) { return (size_t)208 * ns + (size_t)2 * s; }

#undef MC_HD

// Host: rows x row_bytes GGUF bytes -> rows x device_row_bytes in the packed layout
// (padding zeroed). in_dim = elements per row.
void pack_rows(int32_t t, const uint8_t* src, size_t row_bytes, int64_t rows, int64_t in_dim, uint8_t* dst);

}  // namespace minfer::cuda
