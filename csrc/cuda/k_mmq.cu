// Batched quantized matmul on the int8 tensor cores: a block of 9 to 64 token columns
// reads each weight once, and every column is bitwise the decode matvec's (k_matvec.cu).
//
// Why the bits agree. The matvec gives lane l of a row's warp the units l, l + 32, ... (a
// unit: a 32-element block, or half a K-quant superblock); each unit's value is a float
// function of exact integer sums (mv_math.cuh), the lane adds its units' values in
// ascending order from 0.0f, and the warp's butterfly adds the 32 lane sums in a fixed
// tree. Here mma.sync computes the same integer sums for 16 rows x 8 columns at a time
// (integers are exact in any order), the same mv_math function turns them into the same
// floats, and the additions follow the same order: a block's W warps take the tree's W
// subtrees of its last log2(W) rounds (warp w: lanes w, w + W, ... of the butterfly,
// "classes"), a warp walks its 32 / W classes in the tree's depth-first order adding each
// class's units in ascending order, and folds finished classes with a stack (shared
// memory) exactly as the butterfly's first rounds pair them; the block then adds the W
// subtrees as its last rounds do. Empty classes (rows of fewer than 32 units) add 0.0f,
// as the matvec's idle lanes do. Float addition is commutative, so only the tree's shape
// fixes the bits, not which warp holds which operand.
//
// Weight words go straight from global memory into the A fragments (the 4 lanes of a row
// group read the unit's 32 quant bytes of their row); offset quants (Q4_0, Q5_0, Q6_K)
// are recentred to int8 so the mma's integer is the matvec's offset-corrected one.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>

#include "cuda/context.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/mv_math.cuh"
#include "cuda/quant.cuh"

namespace minfer::cuda {

namespace {

using mvm::fadd;
using mvm::fmul;

constexpr int MQ_ROWS = 16;   // rows a block: one m16 tile
// Warps a block, each two of the row tile's 32 classes. Four (a quarter-tree each) and
// eight measured slower (bench/batch_steps.py --ab, H100, the 7B's 64-row step 28.5 and
// 28.6 ms against 21.5; the experiment log): more warps over the same rows keep more
// loads in flight, and one block an SM leaves more of the SM's memory to L1.
constexpr int MQ_WARPS = 16;
constexpr uint32_t NIB = 0x0F0F0F0Fu;

struct MmqArgs {
    const uint8_t* W;
    size_t row_bytes;
    int rows;
    const float* bias;
    const float* resid;   // added after the bias, as mv_store does; null: none
    float* y;             // column c's row r at y[c * rows + r]
    int in_dim, nb, nu;   // elements, 32-element blocks and units per row
    int ncols;
    const int8_t* xq;     // the int8 copy, column c at xq + c * in_dim (chunk order, quant.cuh)
    const float2* xds;    // (d, d * sum) per block, column c at xds + c * nb
    const float* xscale;  // a norm's deferred copy: the row sums times xscale[c]; null: none
};

using mvm::ld4;
using mvm::ldh;
using mvm::ldu16;
using mvm::ldw;
using mvm::sbyte;
// Four bytes of the int8 activation copy.
__device__ __forceinline__ uint32_t ldx(const int8_t* p) { return ldw(reinterpret_cast<const uint8_t*>(p)); }

// The integer sums come out of the mma as floats: it adds them to C = 0x4B400000, the
// bits of 1.5 * 2^23, and for |s| < 2^22 the bits 0x4B400000 + s are the float 1.5 * 2^23
// + s, so subtracting 1.5 * 2^23 gives float(s) exactly. A unit's sums stay far below
// 2^22 (32 products of int8 activations and at most 8-bit weights: |s| < 2^20), and the
// subtraction runs at the full FP32 rate where an int-to-float conversion runs at 1/8.
constexpr int kFloatBias = 0x4B400000;
__device__ __forceinline__ float unbias(int d) { return __fsub_rn(__int_as_float(d), 12582912.0f); }

// d = A (16 x 32, rows g / g + 8 in a[0..3]) * B (32 x 8, column g in b0, b1) + c, int32.
__device__ __forceinline__ void mma_k32(const uint32_t a[4], uint32_t b0, uint32_t b1, int d[4], int c) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c), "r"(c), "r"(c), "r"(c));
}
// The same over 16 elements (Q6_K's half chunks, each with its own scale).
__device__ __forceinline__ void mma_k16(uint32_t a0, uint32_t a1, uint32_t b0, int d[4], int c) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(c), "r"(c), "r"(c), "r"(c));
}

// Bytes of B-bit unsigned quants q to the int8 bytes of q - 2^(B-1): flipping the top bit
// gives the B-bit two's complement, and its sign is copied up into bits B..7 by one
// multiply that stays inside each byte.
template <int B>
__device__ __forceinline__ uint32_t centred(uint32_t v) {
    constexpr uint32_t m = (1u << (B - 1)) * 0x01010101u;
    const uint32_t x = v ^ m;
    return x | ((x & m) * ((1u << (9 - B)) - 2));
}

// Where the lanes' pieces of a launch's columns are: B-fragment column (col0 + 8 j + g)
// and value columns (col0 + 8 j + 2 t + e), clamped to the last real column (their results
// are not stored).
template <int NT>
struct Cols {
    const int8_t* xb[NT];
    int cv[NT][2];
    __device__ __forceinline__ Cols(const MmqArgs& a, int col0, int g, int t) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            xb[j] = a.xq + (size_t)min(col0 + 8 * j + g, a.ncols - 1) * a.in_dim;
            cv[j][0] = min(col0 + 8 * j + 2 * t, a.ncols - 1);
            cv[j][1] = min(col0 + 8 * j + 2 * t + 1, a.ncols - 1);
        }
    }
};

// One unit u of the thread's rows (wa: row g, wb: row g + 8) against every column:
// acc[4 j + i] += the unit's value for row g + 8 (i >> 1), column 8 j + 2 t + (i & 1).
// The values: mv_math's value functions on exact floats of the sums (products of an
// integer scale and a sum, and Q6_K's sum of two such, stay below 2^24, so they are
// exact in floats and equal to the integer product's conversion, as the matvec has it).
template <int T, int NT>
__device__ __forceinline__ void unit(const MmqArgs& a, const uint8_t* wa, const uint8_t* wb, int u, int t,
                                     const Cols<NT>& cs, float acc[4 * NT]) {
    if constexpr (T == T_Q4_K || T == T_Q5_K) {
        uint32_t lo[4], hi[4];
        uint4 h[2];
        if constexpr (T == T_Q4_K) {  // packed (cuda/layout.h)
            const int ns = a.nb >> 3;
            const size_t o0 = q4k_qs(ns, u, 0) + 4 * t, o1 = q4k_qs(ns, u, 1) + 4 * t;
            const uint32_t q[4] = {ldw(wa + o0), ldw(wb + o0), ldw(wa + o1), ldw(wb + o1)};
            h[0] = ld4(wa + q4k_hdr(u >> 2));
            h[1] = ld4(wb + q4k_hdr(u >> 2));
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo[i] = q[i] & NIB;
                hi[i] = (q[i] >> 4) & NIB;
            }
        } else {  // GGUF blocks: header, qh[32], qs[128]
            const size_t b = (size_t)176 * (u >> 2), oq = b + 48 + 32 * (u & 3) + 4 * t;
            const uint32_t q[4] = {ldw(wa + oq), ldw(wb + oq), ldw(wa + oq + 16), ldw(wb + oq + 16)};
            const uint32_t qh[4] = {ldw(wa + b + 16 + 4 * t), ldw(wb + b + 16 + 4 * t), ldw(wa + b + 32 + 4 * t),
                                    ldw(wb + b + 32 + 4 * t)};
            h[0] = ld4(wa + b);
            h[1] = ld4(wb + b);
            const int j0 = 2 * (u & 3);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo[i] = (q[i] & NIB) | (((qh[i] >> j0) & 0x01010101u) << 4);
                hi[i] = ((q[i] >> 4) & NIB) | (((qh[i] >> (j0 + 1)) & 0x01010101u) << 4);
            }
        }
        int sc[2][4];  // per row: sc0, m0, sc1, m1
        float fsc[2][4], dd[2][2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            k4_scale_min(u & 3, h[r].y, h[r].z, h[r].w, sc[r][0], sc[r][1], sc[r][2], sc[r][3]);
#pragma unroll
            for (int k = 0; k < 4; ++k) fsc[r][k] = (float)sc[r][k];
            dd[r][0] = mvm::half_lo(h[r].x);
            dd[r][1] = mvm::half_hi(h[r].x);
        }
        const int p0 = 16 * xq_chunk64(4 * u, a.in_dim) + 4 * t, p1 = 16 * xq_chunk64(4 * u + 1, a.in_dim) + 4 * t;
        const int p2 = 16 * xq_chunk64(4 * u + 2, a.in_dim) + 4 * t, p3 = 16 * xq_chunk64(4 * u + 3, a.in_dim) + 4 * t;
        const int dso = 8 * (u >> 2) + 2 * (u & 3);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            int s0[4], s1[4];
            mma_k32(lo, ldx(cs.xb[j] + p0), ldx(cs.xb[j] + p1), s0, kFloatBias);
            mma_k32(hi, ldx(cs.xb[j] + p2), ldx(cs.xb[j] + p3), s1, kFloatBias);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float4 ds = __ldg(reinterpret_cast<const float4*>(a.xds + (size_t)cs.cv[j][e] * a.nb + dso));
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int i = 2 * r + e;
                    const float v = mvm::val_k45f(dd[r][0], dd[r][1], fmul(fsc[r][0], unbias(s0[i])), fsc[r][1],
                                                  fmul(fsc[r][2], unbias(s1[i])), fsc[r][3], ds);
                    acc[4 * j + i] = fadd(acc[4 * j + i], v);
                }
            }
        }
    } else if constexpr (T == T_Q6_K) {
        // Unit u = 4 sb + 2 n + k1: chunks ja = 4 n + k1 (low nibbles, qh bits 2 k1) and
        // ja + 2 (high nibbles, qh bits 2 k1 + 4) of superblock sb, each in two halves of
        // 16 with their own int8 scales.
        const int ns = a.nb >> 3, sb = u >> 2, n = (u >> 1) & 1, k1 = u & 1, ja = 4 * n + k1;
        const size_t ol0 = q6k_ql(u, 0) + 4 * t, ol1 = q6k_ql(u, 1) + 4 * t;
        const size_t oh0 = q6k_qh(ns, u, 0) + 4 * t, oh1 = q6k_qh(ns, u, 1) + 4 * t;
        uint32_t wa_[2][2], wb_[2][2];  // [half][row]: chunk ja's and chunk ja + 2's quants
        float fisc[2][4], d[2];  // per row: the four int8 scales, the superblock's d
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint8_t* w = r ? wb : wa;
            const uint32_t l0 = ldw(w + ol0), l1 = ldw(w + ol1), h0 = ldw(w + oh0), h1 = ldw(w + oh1);
            wa_[0][r] = centred<6>((l0 & NIB) | (((h0 >> (2 * k1)) & 0x03030303u) << 4));
            wa_[1][r] = centred<6>((l1 & NIB) | (((h1 >> (2 * k1)) & 0x03030303u) << 4));
            wb_[0][r] = centred<6>(((l0 >> 4) & NIB) | (((h0 >> (2 * k1 + 4)) & 0x03030303u) << 4));
            wb_[1][r] = centred<6>(((l1 >> 4) & NIB) | (((h1 >> (2 * k1 + 4)) & 0x03030303u) << 4));
            const uint4 sc = ld4(w + q6k_sc(ns, sb));
            fisc[r][0] = (float)sbyte(sc, 8 * n + 2 * k1);
            fisc[r][1] = (float)sbyte(sc, 8 * n + 2 * k1 + 1);
            fisc[r][2] = (float)sbyte(sc, 8 * n + 2 * k1 + 4);
            fisc[r][3] = (float)sbyte(sc, 8 * n + 2 * k1 + 5);
            d[r] = ldh(w + q6k_d(ns, sb));
        }
        const int c0 = 16 * sb + 2 * ja;
        const int pa0 = 16 * xq_chunk64(c0, a.in_dim) + 4 * t, pa1 = 16 * xq_chunk64(c0 + 1, a.in_dim) + 4 * t;
        const int pb0 = 16 * xq_chunk64(c0 + 4, a.in_dim) + 4 * t, pb1 = 16 * xq_chunk64(c0 + 5, a.in_dim) + 4 * t;
        const int dsa = 8 * sb + ja;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            int sa0[4], sa1[4], sb0[4], sb1[4];
            mma_k16(wa_[0][0], wa_[0][1], ldx(cs.xb[j] + pa0), sa0, kFloatBias);
            mma_k16(wa_[1][0], wa_[1][1], ldx(cs.xb[j] + pa1), sa1, kFloatBias);
            mma_k16(wb_[0][0], wb_[0][1], ldx(cs.xb[j] + pb0), sb0, kFloatBias);
            mma_k16(wb_[1][0], wb_[1][1], ldx(cs.xb[j] + pb1), sb1, kFloatBias);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float2* xd = a.xds + (size_t)cs.cv[j][e] * a.nb + dsa;
                const float da = __ldg(xd).x, db = __ldg(xd + 2).x;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int i = 2 * r + e;
                    // |scale * sum| <= 128 * 16 * 32 * 128 = 2^23: two of them add to at most
                    // 2^24, still exact.
                    const float fa = fadd(fmul(fisc[r][0], unbias(sa0[i])), fmul(fisc[r][1], unbias(sa1[i])));
                    const float fb = fadd(fmul(fisc[r][2], unbias(sb0[i])), fmul(fisc[r][3], unbias(sb1[i])));
                    acc[4 * j + i] = fadd(acc[4 * j + i], mvm::val_q6kf(d[r], fa, fb, da, db));
                }
            }
        }
    } else {
        // 32-element blocks (packed): low nibbles are elements 0..15, high 16..31 (Q8_0:
        // 32 bytes in order).
        uint32_t q[4];  // a fragment: row g, row g + 8 (elements 4t..), then the same at 16 + 4t
        uint32_t dm[2];
        float d8[2];
        if constexpr (T == T_Q8_0) {
            const size_t o = (size_t)32 * u + 4 * t;
            q[0] = ldw(wa + o);
            q[1] = ldw(wb + o);
            q[2] = ldw(wa + o + 16);
            q[3] = ldw(wb + o + 16);
            d8[0] = ldh(wa + (size_t)32 * a.nb + 2 * u);
            d8[1] = ldh(wb + (size_t)32 * a.nb + 2 * u);
        } else {
            constexpr bool kHigh = T == T_Q5_0 || T == T_Q5_1;
            constexpr bool kMin = T == T_Q4_1 || T == T_Q5_1;
            constexpr int sc_at = kHigh ? 20 : 16;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint8_t* w = r ? wb : wa;
                const uint32_t v = ldw(w + (size_t)16 * u + 4 * t);
                uint32_t lo = v & NIB, hi = (v >> 4) & NIB;
                if constexpr (kHigh) {
                    const uint32_t qh = ldw(w + (size_t)16 * a.nb + 4 * u);
                    lo |= mvm::spread4(qh, 4 * t);
                    hi |= mvm::spread4(qh, 4 * t + 16);
                }
                if constexpr (T == T_Q4_0) {
                    lo = centred<4>(lo);
                    hi = centred<4>(hi);
                } else if constexpr (T == T_Q5_0) {
                    lo = centred<5>(lo);
                    hi = centred<5>(hi);
                }
                q[r] = lo;
                q[2 + r] = hi;
                if constexpr (kMin) dm[r] = ldw(w + (size_t)sc_at * a.nb + 4 * u);
                else dm[r] = ldu16(w + (size_t)sc_at * a.nb + 2 * u);
            }
        }
        const int p0 = 16 * xq_chunk(2 * u, a.in_dim) + 4 * t, p1 = 16 * xq_chunk(2 * u + 1, a.in_dim) + 4 * t;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            int s[4];
            mma_k32(q, ldx(cs.xb[j] + p0), ldx(cs.xb[j] + p1), s, kFloatBias);
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float2 ds = __ldg(a.xds + (size_t)cs.cv[j][e] * a.nb + u);
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int i = 2 * r + e;
                    float v;
                    if constexpr (T == T_Q8_0) v = mvm::val_q8_0f(d8[r], ds, unbias(s[i]));
                    else v = mvm::val_q45f<T == T_Q4_1 || T == T_Q5_1>(dm[r], ds, unbias(s[i]));
                    acc[4 * j + i] = fadd(acc[4 * j + i], v);
                }
            }
        }
    }
}

// k's lowest m bits in reverse order.
__host__ __device__ constexpr int brev(int k, int m) {
    int r = 0;
    for (int i = 0; i < m; ++i) r |= ((k >> i) & 1) << (m - 1 - i);
    return r;
}
constexpr int log2i(int n) { return n <= 1 ? 0 : 1 + log2i(n / 2); }

// Shared memory: per warp a stack of log2(32 / W) levels of 4 NT values a lane (the
// finished classes' partial sums), indexed [level][pair][lane] so a warp's accesses never
// conflict; afterwards each warp's first level takes its subtree's sum for the block's
// last rounds (one level even where a warp has a single class and no stack).
template <int NT>
constexpr size_t mmq_smem_bytes() {
    constexpr int W = MQ_WARPS, m = log2i(32 / W);
    return (size_t)W * (m > 0 ? m : 1) * 4 * NT * 32 * sizeof(float);
}

// The sum of the warps' subtree values at p[w * stride] for w = B, B + S, ... (N of them)
// in the butterfly's last rounds: those S apart pair last (v_w += v_(w + W / 2) first).
template <int B, int S, int N>
__device__ __forceinline__ float subtrees(const float* p, size_t stride) {
    if constexpr (N == 1) return p[B * stride];
    else return fadd(subtrees<B, 2 * S, N / 2>(p, stride), subtrees<B + S, 2 * S, N / 2>(p, stride));
}

template <int T, int NT>
__global__ void __launch_bounds__(MQ_WARPS * 32) k_mmq(MmqArgs a) {
    extern __shared__ float mq_smem[];
    pdl_trigger();
    constexpr int W = MQ_WARPS;
    constexpr int K = 32 / W, M = log2i(K), LV = M > 0 ? M : 1;  // classes a warp, stack levels
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * MQ_ROWS, col0 = blockIdx.y * 8 * NT;
    constexpr int P = 4 * NT;
    // Rows past the last load the last row (their results are not stored).
    const uint8_t* wa = a.W + (size_t)min(row0 + g, a.rows - 1) * a.row_bytes;
    const uint8_t* wb = a.W + (size_t)min(row0 + g + 8, a.rows - 1) * a.row_bytes;
    const Cols<NT> cs(a, col0, g, t);
    float* st = mq_smem + (size_t)warp * LV * P * 32;
    // The block's rows into L2 before the wait (no kernel writes weights): a warp walks
    // its units a class at a time, one unit in flight, which alone would not keep enough
    // bytes in flight to stream; blocks start a wave at a time, so L2 holds a wave's rows.
    {
        const int nrows = min(MQ_ROWS, a.rows - row0);
        const size_t lines = (a.row_bytes + 127) / 128;
        for (size_t i = threadIdx.x; i < (size_t)nrows * lines; i += blockDim.x) {
            const uint8_t* p = a.W + (size_t)(row0 + i / lines) * a.row_bytes + 128 * (i % lines);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
        }
    }
    pdl_wait();
    float acc[P];
#pragma unroll 1
    for (int k = 0; k < K; ++k) {
        // Class l of the warp's subtree in depth-first order (W = 4 would walk l, l + 16,
        // l + 8, l + 24, l + 4, ...: lane l's partner in round 16 is l + 16, and so on).
        const int l = warp + W * brev(k, M);
#pragma unroll
        for (int p = 0; p < P; ++p) acc[p] = 0.0f;
        for (int u = l; u < a.nu; u += 32) unit<T, NT>(a, wa, wb, u, t, cs, acc);
        // Fold: class k joins the stack like a binary counter (rounds 16, 8, ...).
        int lv = 0;
        for (; lv < M && (k >> lv) & 1; ++lv) {
#pragma unroll
            for (int p = 0; p < P; ++p) acc[p] = fadd(st[(lv * P + p) * 32 + lane], acc[p]);
        }
        if (lv < M) {
#pragma unroll
            for (int p = 0; p < P; ++p) st[(lv * P + p) * 32 + lane] = acc[p];
        }
    }
    // acc: the warp's subtree sum. The last rounds: v_w += v_(w + s) for s = W / 2, ..., 1.
#pragma unroll
    for (int p = 0; p < P; ++p) st[p * 32 + lane] = acc[p];
    __syncthreads();
    const size_t wstride = (size_t)LV * P * 32;
    for (int e = threadIdx.x; e < P * 32; e += W * 32) {
        const int p = e >> 5, ln = e & 31;
        const float v = subtrees<0, 1, W>(mq_smem + e, wstride);
        // Pair p = 4 j + i of lane (g, t): row g + 8 (i >> 1), column 8 j + 2 t + (i & 1).
        const int j = p >> 2, i = p & 3, lg = ln >> 2, lt = ln & 3;
        const int row = row0 + lg + 8 * (i >> 1), col = col0 + 8 * j + 2 * lt + (i & 1);
        if (row < a.rows && col < a.ncols) {
            float r = a.xscale ? fmul(v, __ldg(a.xscale + col)) : v;
            if (a.bias) r = fadd(r, __ldg(a.bias + row));
            // Not __ldg: y may be the residual's own buffer (the add's output over it).
            if (a.resid) r = fadd(r, a.resid[(size_t)col * a.rows + row]);
            a.y[(size_t)col * a.rows + row] = r;
        }
    }
}

template <int T, int NT>
void launch_mmq_nt(const MmqArgs& a, unsigned gy) {
    constexpr size_t smem = mmq_smem_bytes<NT>();
    if constexpr (smem > 48 * 1024) {
        static const bool allowed = [] {  // once, whichever thread launches first
            check(cudaFuncSetAttribute(k_mmq<T, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                  "cudaFuncSetAttribute");
            return true;
        }();
        (void)allowed;
    }
    const unsigned gx = (unsigned)((a.rows + MQ_ROWS - 1) / MQ_ROWS);
    launch_smem(k_mmq<T, NT>, dim3(gx, gy), MQ_WARPS * 32, smem, a);
}

template <int T>
void launch_mmq(const MmqArgs& a) {
    if (a.ncols <= 16) launch_mmq_nt<T, 2>(a, (a.ncols + 15) / 16);
    else if (a.ncols <= 32) launch_mmq_nt<T, 4>(a, 1);
    else launch_mmq_nt<T, 8>(a, (a.ncols + 63) / 64);
}

int g_mmq_min_cols = 9;

}  // namespace

int& mmq_min_cols() { return g_mmq_min_cols; }

bool mmq_type_supported(int32_t t) { return matvec_type_supported(t) && t != T_F32 && t != T_F16; }

bool mmq_matvec(const MvJob& jb, int64_t in_dim, const int8_t* xq, const float2* xds, const float* xscale,
                int ncols) {
    if (ncols < g_mmq_min_cols || !mmq_type_supported(jb.type) || jb.W2 || jb.q_out) return false;
    if (in_dim % 32 || (in_dim % 256 && mvm::kquant(jb.type)))
        throw std::invalid_argument("mmq_matvec: rows of whole blocks");
    MmqArgs a;
    a.W = jb.W;
    a.row_bytes = jb.row_bytes;
    a.rows = jb.rows;
    a.bias = jb.bias;
    a.resid = jb.resid;
    a.y = jb.y;
    a.in_dim = (int)in_dim;
    a.nb = (int)(in_dim / 32);
    a.nu = mvm::row_units(jb.type, a.nb);
    a.ncols = ncols;
    a.xq = xq;
    a.xds = xds;
    a.xscale = xscale;
    dispatch_type(jb.type, [&]<int T>() {
        if constexpr (T != T_F32 && T != T_F16) launch_mmq<T>(a);
    });
    ++ctx().c.mmq;
    return true;
}

}  // namespace minfer::cuda
