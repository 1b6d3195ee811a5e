// How the device stores a weight's rows. GGUF blocks of 18/20/22/24/34/210 bytes put
// the quants at 2-byte alignment, so a kernel reading them natively issues many narrow
// loads, and the decode matvec is bound by the instructions it issues, not by DRAM.
// At upload such rows are split into arrays within the row (all quants, then the high
// bits, then the scales), and rows are padded to 16 bytes, so every quant load is one
// 16-byte load. Q4_K and Q6_K rows also interleave their quants by groups of 8 units
// (a unit is a quarter superblock, 32 quant bytes: what a matvec lane decodes per trip):
// a group holds its units' first 16-byte halves, then their second halves, so the
// 8 lanes that decode a group's units read 128 contiguous bytes per load instead of
// 16 bytes every 32 (a load's L1 wavefronts grow with the lines and sectors it touches;
// the 7B's down projection was bound by them: with this and the activations' chunk order,
// quant.cuh, its L1 throughput fell from 82% to 44% of peak and tg128 rose 7%). Q5_K blocks (176 bytes) are aligned as
// they are and stay in their GGUF layout, as do F32 and F16.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/ggml_types.h"

namespace minfer::cuda {

#if defined(__CUDACC__)
#define MC_HD __host__ __device__ __forceinline__ constexpr
#else
#define MC_HD constexpr inline
#endif

// Rearranged in the device copy (offsets below); the others keep their GGUF bytes.
MC_HD bool packed_layout(int32_t t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q6_K;
}

// Byte offsets inside a packed row of nb 32-element blocks (Q6_K: ns = nb / 8 superblocks).
//   Q4_0: qs[16] per block, then d (f16)          Q4_1: qs[16], then (d, m) f16 pairs
//   Q5_0: qs[16], then qh (u32), then d           Q5_1: qs[16], then qh, then (d, m)
//   Q8_0: qs[32], then d
//   Q4_K: the 16-byte headers (d, dmin, 12 scale bytes) of all superblocks, then the
//         quants by 8-unit groups (kq_half)
//   Q6_K: ql by 8-unit groups (kq_half), then qh (32 bytes a unit pair, by 4-pair
//         groups the same way), then scales[16] per superblock, then d (f16)
// (Q4_K / Q6_K: groups of zeros pad an odd superblock count, kq_ns_pad.)
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

// K-quant rows keep whole 8-unit groups: a row of an odd number of superblocks gets a
// last group of 4 units and 4 units of zero padding, so every offset below is a shift
// and an add (a partial group's own stride cost the staged kernel 4-12 registers).
MC_HD int kq_ns_pad(int ns) { return (ns + 1) & ~1; }
// Half i (16 bytes) of unit u's 32 quant bytes in an array of 8-unit groups of 256 bytes.
MC_HD size_t kq_half(int u, int i) { return (size_t)256 * (u >> 3) + (size_t)128 * i + (size_t)16 * (u & 7); }

// Q4_K offsets within a row of ns superblocks: superblock s's header, unit u's half i.
MC_HD size_t q4k_hdr(int s) { return (size_t)16 * s; }
MC_HD size_t q4k_qs(int ns, int u, int i) { return (size_t)16 * ns + kq_half(u, i); }

// Q6_K offsets within a row of ns superblocks: unit u's ql half i; unit u's qh half i
// (units 2 pr and 2 pr + 1 share 32 qh bytes: 4-pair groups of 128 bytes); superblock
// s's scales and d.
MC_HD size_t q6k_ql(int u, int i) { return kq_half(u, i); }
MC_HD size_t q6k_qh(int ns, int u, int i) {
    return (size_t)128 * kq_ns_pad(ns) + (size_t)128 * (u >> 3) + (size_t)64 * i + (size_t)16 * ((u >> 1) & 3);
}
MC_HD size_t q6k_sc(int ns, int s) { return (size_t)192 * kq_ns_pad(ns) + (size_t)16 * s; }
MC_HD size_t q6k_d(int ns, int s) { return (size_t)192 * kq_ns_pad(ns) + (size_t)16 * ns + (size_t)2 * s; }

// Device row stride: the GGUF row size, padded to 16 bytes when the layout is packed
// (and to whole 8-unit groups for the K-quants).
MC_HD size_t device_row_bytes(int32_t t, size_t row_bytes) {
    if (t == T_Q4_K) {
        const int ns = (int)(row_bytes / 144);
        return (size_t)16 * ns + (size_t)128 * kq_ns_pad(ns);
    }
    if (t == T_Q6_K) {
        const int ns = (int)(row_bytes / 210);
        return ((size_t)192 * kq_ns_pad(ns) + (size_t)18 * ns + 15) / 16 * 16;
    }
    return packed_layout(t) ? (row_bytes + 15) / 16 * 16 : row_bytes;
}

#undef MC_HD

// Host: rows x row_bytes GGUF bytes -> rows x device_row_bytes in the packed layout
// (padding zeroed). in_dim = elements per row.
void pack_rows(int32_t t, const uint8_t* src, size_t row_bytes, int64_t rows, int64_t in_dim, uint8_t* dst);

}  // namespace minfer::cuda
