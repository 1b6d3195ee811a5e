// Weights of the 32-element family repacked into interleaved row groups for the SIMD
// matmul (the layout llama.cpp's CPU "repack" also uses, in our own form).
//
// A group holds 16 consecutive output rows. For each 32-element block the group stores
// the 16 rows' codes interleaved 4 bytes at a time, so one 512-bit register (two 256-bit
// ones on AVX2) holds 4 codes of each of the 16 rows and a single int8 dot-product
// instruction (vpdpbusd, or maddubs + madd) advances all 16 rows' integer block sums.
// After the 8 steps of a block each 32-bit lane holds one row's exact integer block
// dot; the float epilogue (convert, scale by d_w * d_a, accumulate) is then one vector
// operation for 16 rows instead of one per row. The codes are stored unsigned (code +
// offset) for vpdpbusd; the offset times the activation block sum is subtracted exactly,
// in integers, before the conversion.
//
// Rounding: each (row, token) result is  sum over blocks, in order, of
//   fma(d_w * d_a, (float)exact_int_block_dot, acc)
// followed, for Q4_1 and Q5_1 (whose elements are d * code + m), by
//   fma(m_w * d_a, (float)exact_activation_block_sum, acc)
// whatever the tile, the thread split or the number of tokens, so prefill, decode and
// every thread count agree bitwise. It differs from the unpacked SIMD kernel (which
// keeps 8 float partial sums per block and adds them at the end) only in summation
// order; the integer block dots are exact in both.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

namespace minfer::cpu::repack {

// Whether this build repacks weights of type t (AVX2 or AVX-512 builds: Q4_0, Q4_1, Q5_0,
// Q5_1, Q4_K, Q5_K and Q6_K (cpu/repack_k.h); Q8_0 also where vpdpbusd exists, since
// maddubs would saturate on code + 128).
bool packable(int32_t type);

struct Packed {
    int32_t type = 0;
    int64_t in = 0, out = 0;   // row length, rows
    int64_t nb = 0;            // blocks per row (32 elements; 256 for the K-quants)
    int64_t groups = 0;        // ceil(out / 16); the last group is zero-padded
    size_t group_bytes = 0;    // nb * bytes per 16-row block
    std::unique_ptr<uint8_t, void (*)(void*)> data{nullptr, nullptr};
    size_t bytes() const { return (size_t)groups * group_bytes; }
};

// Repack a GGUF-layout matrix (out rows of `in` elements). Uses up to n_threads threads.
// release_source (only for a read-only file mapping, whose pages fault back from the
// file if read again): drop the source pages chunk by chunk as they are consumed.
std::unique_ptr<Packed> pack(int32_t type, const uint8_t* src, int64_t in, int64_t out, int n_threads,
                             bool release_source = false);

// Tokens the kernel computes per pass over a group (work splits keep to multiples).
int token_tile();

// Rows [r0, r1) of y[t * ldy + r] = dot(row r, activation t) for t < nt, activations in
// the row format act_type_for(type) gives (Q8_0, or Q8_K for the K-quants; arb bytes per row). r0 should be a multiple of 16 (any value is
// correct; a range that starts inside a group recomputes that group's other rows).
// meta: the activations' summaries (below), nb blocks per token, or null to compute
// them here for this call's tokens.
void matmul(const Packed& p, const uint8_t* act, size_t arb, int64_t nt, float* y, int64_t ldy, int64_t r0,
            int64_t r1, const uint8_t* meta = nullptr);

// Per-block summaries of quantized activations that the kernels read besides the codes
// (the block scale as f32; Q8_0: the code sum; Q8_K: the Q4_K min and Q6_K offset terms
// from its sub-block sums), the same for every weight type of the family. Computed per
// matmul call they cost each thread a pass over all tokens of its rows: with 16 threads
// on a 512-token prefill that was +10-24% of the matmuls' thread time (896-row Q5_0/Q8_0
// and Q4_K/Q6_K ffn_down, measured by splitting one thread's work 16 ways). The executor
// computes them once, when it quantizes, for every thread and every matmul sharing the
// activations. Bytes per block (0: this build's kernels need none), and the fill of n
// consecutive blocks of one row.
size_t meta_block_bytes(int32_t act_type);
void act_meta(int32_t act_type, const uint8_t* blocks, int64_t n, uint8_t* meta);

}  // namespace minfer::cpu::repack
