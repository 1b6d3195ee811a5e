// Matrix-vector products (decode and small blocks), the int8 activation copies they read
// (a quantization launch, the RMSNorm's deferred copy) and the RoPE angle table. Weights
// are in the device layout (cuda/layout.h).
#include <atomic>
#include <mutex>
#include <stdexcept>

#include "cuda/context.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/mv_math.cuh"
#include "cuda/quant.cuh"
#include "cuda/norm.cuh"
#include "cuda/rope.cuh"
#include "cuda/route.cuh"
#include "cuda/silu.cuh"
#include "cuda/timeline.cuh"

namespace minfer::cuda {

namespace tl {
TL_BIND(bind_mv)
}

namespace {

// ---- decode matvec ------------------------------------------------------------------
// One warp per output row; lane l takes units l, l + 32, ... of the row (a unit is what
// one thread decodes per trip: a 32-element block, or a quarter of a K-quant superblock),
// two units per trip with all their loads issued before the arithmetic, every weight
// load 16 bytes wide. A lane adds its units' sums in ascending order, then the warp
// reduces with a fixed butterfly: a row's bits depend on the row length alone, never on
// which launch computed it, how many rows or columns it had, or which jobs it fused.
// Every float operation is spelled out (_rn) so no instantiation contracts differently.

struct MvArgs {
    MvJob job[MV_MAX_JOBS];
    int block0[MV_MAX_JOBS];
    int njobs;
    int in_dim, nb;       // elements and 32-element blocks per row
    int prefetch;         // request the warp's row into L2 before pdl_wait()
    const float* x;       // f32 activations (F32 / F16 weights)
    const int8_t* xq;     // int8 copy, column c at xq + c * in_dim
    const float2* xds;    // per block (d, d * sum(q)), column c at xds + c * nb
    MvRopeStore rope;     // the q|k|v launch's RoPE + KV-store tail (rope.tickets set) or none
    int rope_tk0[MV_MAX_JOBS];  // job j's first head ticket
    // The int8 copy is an RMSNorm's deferred copy (of x * w, not of the normalized x):
    // a quantized job's row sums are multiplied by the norm's scale (column c's at
    // xscale[c]) before the epilogue. Null: none.
    const float* xscale;
    // One row a warp, every job's rows at most 64 units of a quantized type: a warp loads
    // its row's units into registers before pdl_wait() (mv_row_early; one-column launches,
    // k_matvec's EW instantiations).
    int wearly;
};

constexpr int MV_WARPS = 4;

using mvm::ld4;
using mvm::ldg4;
using mvm::ldh;
using mvm::ldu16;
using mvm::ldw;
__device__ __forceinline__ int dp4(uint32_t a, uint32_t b, int c) { return __dp4a((int)a, (int)b, c); }
// a's bytes unsigned, b's signed.
__device__ __forceinline__ int dp4us(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ uint32_t W_(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Chunk position p (xq_chunk) of column col's int8 copy.
__device__ __forceinline__ uint4 xq16(const MvArgs& a, int col, int p) {
    return ldg4(a.xq + (size_t)col * a.in_dim + 16 * p);
}
__device__ __forceinline__ float2 xds_at(const MvArgs& a, int col, int blk) {
    return __ldg(a.xds + (size_t)col * a.nb + blk);
}
// sum over i of dot4(w[i], x[i]) for two 16-byte groups, in order (U: w's bytes unsigned).
template <bool U = false>
__device__ __forceinline__ int dot32(const uint32_t w[8], const uint4& x0, const uint4& x1, int s = 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s = U ? dp4us(w[i], W_(x0, i), s) : dp4(w[i], W_(x0, i), s);
#pragma unroll
    for (int i = 0; i < 4; ++i) s = U ? dp4us(w[4 + i], W_(x1, i), s) : dp4(w[4 + i], W_(x1, i), s);
    return s;
}
using mvm::fadd;
using mvm::fmul;

// The activation side of one unit (the int8 copy and its (d, d * sum) pairs). A unit's
// dot product reads it through one of two views with the same methods: Lazy loads each
// piece where the arithmetic uses it (the plain kernel: few registers), the value type
// holds pieces loaded once (k_matvec_bulk keeps a lane's units from row to row).
template <class L, int N, class DS>
struct Held {
    using Lazy = L;
    uint4 v[N];
    DS d;
    __device__ __forceinline__ uint4 q(int i) const { return v[i]; }
    __device__ __forceinline__ DS ds() const { return d; }
    __device__ __forceinline__ static Held load(const MvArgs& a, int col, int u) {
        const L l{a, col, u};
        Held h;
#pragma unroll
        for (int i = 0; i < N; ++i) h.v[i] = l.q(i);
        h.d = l.ds();
        return h;
    }
};
struct X32Lazy {  // one 32-element block: its two 16-byte halves, its (d, d * sum)
    const MvArgs& a;
    int col, u;
    __device__ __forceinline__ uint4 q(int i) const { return xq16(a, col, xq_chunk(2 * u + i, a.in_dim)); }
    __device__ __forceinline__ float2 ds() const { return xds_at(a, col, u); }
};
struct XK45Lazy {  // Q4_K / Q5_K unit u: sub-blocks 2p, 2p + 1 of superblock u / 4 (p = u % 4)
    const MvArgs& a;
    int col, u;
    __device__ __forceinline__ uint4 q(int i) const { return xq16(a, col, xq_chunk64(4 * u + i, a.in_dim)); }
    __device__ __forceinline__ float4 ds() const {
        return __ldg(reinterpret_cast<const float4*>(a.xds + (size_t)col * a.nb + 8 * (u >> 2) + 2 * (u & 3)));
    }
};
using X32 = Held<X32Lazy, 2, float2>;
using XK45 = Held<XK45Lazy, 4, float4>;
// Q6_K's pieces come from two chunks, each with its own d: a view of its own.
struct XQ6 {  // Q6_K unit u: chunks ja and jb = ja + 2 of superblock u / 4 (ja = 4 n + k1)
    struct Lazy {
        const MvArgs& a;
        int col, u;
        __device__ __forceinline__ int ja() const { return 4 * ((u >> 1) & 1) + (u & 1); }
        __device__ __forceinline__ uint4 qa(int i) const {
            return xq16(a, col, xq_chunk64(16 * (u >> 2) + 2 * ja() + i, a.in_dim));
        }
        __device__ __forceinline__ uint4 qb(int i) const {
            return xq16(a, col, xq_chunk64(16 * (u >> 2) + 2 * ja() + 4 + i, a.in_dim));
        }
        __device__ __forceinline__ float da() const { return xds_at(a, col, 8 * (u >> 2) + ja()).x; }
        __device__ __forceinline__ float db() const { return xds_at(a, col, 8 * (u >> 2) + ja() + 2).x; }
    };
    uint4 a_[2], b_[2];
    float da_, db_;
    __device__ __forceinline__ uint4 qa(int i) const { return a_[i]; }
    __device__ __forceinline__ uint4 qb(int i) const { return b_[i]; }
    __device__ __forceinline__ float da() const { return da_; }
    __device__ __forceinline__ float db() const { return db_; }
    __device__ __forceinline__ static XQ6 load(const MvArgs& a, int col, int u) {
        const Lazy l{a, col, u};
        return {{l.qa(0), l.qa(1)}, {l.qb(0), l.qb(1)}, l.da(), l.db()};
    }
};

using mvm::spread4;

// Sum of the 16 int8 values in v. Offset quants (Q4_0, Q5_0, Q6_K) are dotted unsigned
// and the offset times this sum taken off the integer result: the same integer as
// offsetting every byte first (__vsubss4 is ~9 instructions a word on sm_90, this is one).
__device__ __forceinline__ int sum16(const uint4& v, int c = 0) {
    c = __dp4a((int)v.x, 0x01010101, c);
    c = __dp4a((int)v.y, 0x01010101, c);
    c = __dp4a((int)v.z, 0x01010101, c);
    return __dp4a((int)v.w, 0x01010101, c);
}

// Units (mv_math.cuh) as Unit<T>::count gives them.
using mvm::kquant;
using mvm::row_units;

template <int T> struct Unit;

// Legacy 4/5-bit blocks (packed): 16 quant bytes, low nibbles = elements 0..15, high
// nibbles = 16..31; Q5 adds a fifth bit from qh; Q4_0 / Q5_0 are offset by 8 / 16, Q4_1 /
// Q5_1 carry a min m (added as m * sum(x)).
template <int T>
struct UnitQ45 {
    static constexpr bool kHigh = T == T_Q5_0 || T == T_Q5_1;
    static constexpr bool kMin = T == T_Q4_1 || T == T_Q5_1;
    uint4 q;
    uint32_t qh, dm;
    __device__ static int count(int nb) { return nb; }
    template <bool G = true>
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int u, int nb) {
        q = ld4<G>(row + 16 * u);
        if constexpr (kHigh) qh = ldw<G>(row + 16 * nb + 4 * u);
        constexpr int sc_at = kHigh ? 20 : 16;
        if constexpr (kMin) dm = ldw<G>(row + sc_at * nb + 4 * u);
        else dm = ldu16<G>(row + sc_at * nb + 2 * u);
    }
    using X = X32;
    __device__ __forceinline__ float dot(const MvArgs& a, int col, int u) const { return dot(typename X::Lazy{a, col, u}, u); }
    template <class XV>
    __device__ __forceinline__ float dot(const XV& x, int) const {
        uint32_t w[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint32_t lo = W_(q, i) & 0x0F0F0F0Fu, hi = (W_(q, i) >> 4) & 0x0F0F0F0Fu;
            if constexpr (kHigh) {
                lo |= spread4(qh, 4 * i);
                hi |= spread4(qh, 4 * i + 16);
            }
            w[i] = lo;
            w[4 + i] = hi;
        }
        // Q4_0 / Q5_0 quants are offset by 8 / 16 (sum16).
        constexpr int off = T == T_Q4_0 ? 8 : T == T_Q5_0 ? 16 : 0;
        const uint4 x0 = x.q(0), x1 = x.q(1);
        const int s = dot32(w, x0, x1, off ? -off * sum16(x1, sum16(x0)) : 0);
        return mvm::val_q45<kMin>(dm, x.ds(), s);
    }
};
template <> struct Unit<T_Q4_0> : UnitQ45<T_Q4_0> {};
template <> struct Unit<T_Q4_1> : UnitQ45<T_Q4_1> {};
template <> struct Unit<T_Q5_0> : UnitQ45<T_Q5_0> {};
template <> struct Unit<T_Q5_1> : UnitQ45<T_Q5_1> {};

template <> struct Unit<T_Q8_0> {
    uint4 q0, q1;
    float d;
    __device__ static int count(int nb) { return nb; }
    template <bool G = true>
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int u, int nb) {
        q0 = ld4<G>(row + 32 * u);
        q1 = ld4<G>(row + 32 * u + 16);
        d = ldh<G>(row + 32 * nb + 2 * u);
    }
    using X = X32;
    __device__ __forceinline__ float dot(const MvArgs& a, int col, int u) const { return dot(typename X::Lazy{a, col, u}, u); }
    template <class XV>
    __device__ __forceinline__ float dot(const XV& x, int) const {
        const uint32_t w[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
        return mvm::val_q8_0(d, x.ds(), dot32(w, x.q(0), x.q(1)));
    }
};

// Q4_K (packed) / Q5_K (GGUF layout): unit = sub-blocks 2p and 2p+1 of superblock sb
// (u = 4 sb + p): the 32 quant bytes they share (low nibbles: 2p, high: 2p+1), the
// 16-byte header (d, dmin, 12 scale bytes) and for Q5_K the 32 high-bit bytes.
template <int T>
struct UnitK45 {
    uint4 h, q0, q1, qh0, qh1;
    __device__ static int count(int nb) { return nb / 2; }
    template <bool G = true>
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int u, int nb) {
        if constexpr (T == T_Q4_K) {  // packed (cuda/layout.h)
            const int ns = nb >> 3;
            h = ld4<G>(row + q4k_hdr(u >> 2));
            q0 = ld4<G>(row + q4k_qs(ns, u, 0));
            q1 = ld4<G>(row + q4k_qs(ns, u, 1));
        } else {
            const uint8_t* b = row + (size_t)176 * (u >> 2);  // GGUF block: header, qh[32], qs[128]
            h = ld4<G>(b);
            q0 = ld4<G>(b + 48 + 32 * (u & 3));
            q1 = ld4<G>(b + 48 + 32 * (u & 3) + 16);
            qh0 = ld4<G>(b + 16);
            qh1 = ld4<G>(b + 32);
        }
    }
    using X = XK45;
    __device__ __forceinline__ float dot(const MvArgs& a, int col, int u) const { return dot(typename X::Lazy{a, col, u}, u); }
    template <class XV>
    __device__ __forceinline__ float dot(const XV& x, int u) const { return dot_sel(x, u, u & 3); }
    // sel: the scale selection, u % 4 or its K4Sel (quant.cuh).
    template <class XV, class Sel>
    __device__ __forceinline__ float dot_sel(const XV& x, int u, const Sel& sel) const {
        const int j0 = 2 * (u & 3), j1 = j0 + 1;
        uint32_t wl[8], wh[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t q = i < 4 ? W_(q0, i) : W_(q1, i - 4);
            wl[i] = q & 0x0F0F0F0Fu;
            // Q4_K: the high nibbles in place, 16 times their value (unsigned bytes; the
            // sum is shifted back, exactly: it is a multiple of 16). Saves a shift a word.
            wh[i] = T == T_Q4_K ? q & 0xF0F0F0F0u : (q >> 4) & 0x0F0F0F0Fu;
            if constexpr (T == T_Q5_K) {
                const uint32_t hb = i < 4 ? W_(qh0, i) : W_(qh1, i - 4);
                wl[i] |= ((hb >> j0) & 0x01010101u) << 4;
                wh[i] |= ((hb >> j1) & 0x01010101u) << 4;
            }
        }
        const int s0 = dot32(wl, x.q(0), x.q(1));
        const int s1 = T == T_Q4_K ? dot32<true>(wh, x.q(2), x.q(3)) >> 4 : dot32(wh, x.q(2), x.q(3));
        int sc0, m0, sc1, m1;
        k4_scale_min(sel, h.y, h.z, h.w, sc0, m0, sc1, m1);
        return mvm::val_k45(h.x, sc0, m0, sc1, m1, s0, s1, x.ds());
    }
};
template <> struct Unit<T_Q4_K> : UnitK45<T_Q4_K> {};
template <> struct Unit<T_Q5_K> : UnitK45<T_Q5_K> {};

// Q6_K (packed): unit u = 4 sb + 2 n + k1 covers chunks 4n + k1 (low nibbles of its 32
// ql bytes, qh bits 2k1) and 4n + k1 + 2 (high nibbles, qh bits 2k1 + 4); each chunk's
// halves have their own int8 scale.
template <> struct Unit<T_Q6_K> {
    uint4 l0, l1, h0, h1, sc;
    float d;
    __device__ static int count(int nb) { return nb / 2; }
    template <bool G = true>
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int u, int nb) {
        const int ns = nb / 8, s = u >> 2;
        l0 = ld4<G>(row + q6k_ql(u, 0));
        l1 = ld4<G>(row + q6k_ql(u, 1));
        h0 = ld4<G>(row + q6k_qh(ns, u, 0));
        h1 = ld4<G>(row + q6k_qh(ns, u, 1));
        sc = ld4<G>(row + q6k_sc(ns, s));
        d = ldh<G>(row + q6k_d(ns, s));
    }
    using X = XQ6;
    __device__ __forceinline__ float dot(const MvArgs& a, int col, int u) const { return dot(typename X::Lazy{a, col, u}, u); }
    template <class XV>
    __device__ __forceinline__ float dot(const XV& x, int u) const {
        const int n = (u >> 1) & 1, k1 = u & 1;
        uint32_t wa[8], wb[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t l = i < 4 ? W_(l0, i) : W_(l1, i - 4);
            const uint32_t hb = i < 4 ? W_(h0, i) : W_(h1, i - 4);
            // 0..63, offset by 32 below (sum16)
            wa[i] = (l & 0x0F0F0F0Fu) | (((hb >> (2 * k1)) & 0x03030303u) << 4);
            wb[i] = ((l >> 4) & 0x0F0F0F0Fu) | (((hb >> (2 * k1 + 4)) & 0x03030303u) << 4);
        }
        const uint4 xa0 = x.qa(0), xa1 = x.qa(1);
        const uint4 xb0 = x.qb(0), xb1 = x.qb(1);
        int sa0 = 0, sa1 = 0, sb0 = 0, sb1 = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            sa0 = dp4(wa[i], W_(xa0, i), sa0);
            sa1 = dp4(wa[4 + i], W_(xa1, i), sa1);
            sb0 = dp4(wb[i], W_(xb0, i), sb0);
            sb1 = dp4(wb[4 + i], W_(xb1, i), sb1);
        }
        sa0 -= 32 * sum16(xa0);
        sa1 -= 32 * sum16(xa1);
        sb0 -= 32 * sum16(xb0);
        sb1 -= 32 * sum16(xb1);
        using mvm::sbyte;
        const int ia = sbyte(sc, 8 * n + 2 * k1) * sa0 + sbyte(sc, 8 * n + 2 * k1 + 1) * sa1;
        const int ib = sbyte(sc, 8 * n + 2 * k1 + 4) * sb0 + sbyte(sc, 8 * n + 2 * k1 + 5) * sb1;
        return mvm::val_q6k(d, ia, ib, x.da(), x.db());
    }
};

// F16 / F32 against the f32 activation: unit = 32 elements.
template <> struct Unit<T_F16> {
    uint4 w[4];
    __device__ static int count(int nb) { return nb; }
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int u, int) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = ldg4(row + 64 * u + 16 * i);
    }
    __device__ __forceinline__ float dot(const MvArgs& a, int col, int u) const {
        const float4* x = reinterpret_cast<const float4*>(a.x + (size_t)col * a.in_dim + 32 * u);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const __half2* h = reinterpret_cast<const __half2*>(&w[i]);
            const float4 x0 = __ldg(x + 2 * i), x1 = __ldg(x + 2 * i + 1);
            const float2 f0 = __half22float2(h[0]), f1 = __half22float2(h[1]);
            const float2 f2 = __half22float2(h[2]), f3 = __half22float2(h[3]);
            s = __fmaf_rn(f0.x, x0.x, s); s = __fmaf_rn(f0.y, x0.y, s);
            s = __fmaf_rn(f1.x, x0.z, s); s = __fmaf_rn(f1.y, x0.w, s);
            s = __fmaf_rn(f2.x, x1.x, s); s = __fmaf_rn(f2.y, x1.y, s);
            s = __fmaf_rn(f3.x, x1.z, s); s = __fmaf_rn(f3.y, x1.w, s);
        }
        return s;
    }
};
template <> struct Unit<T_F32> {
    float4 w[8];
    __device__ static int count(int nb) { return nb; }
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int u, int) {
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = __ldg(reinterpret_cast<const float4*>(row + 128 * u) + i);
    }
    __device__ __forceinline__ float dot(const MvArgs& a, int col, int u) const {
        const float4* x = reinterpret_cast<const float4*>(a.x + (size_t)col * a.in_dim + 32 * u);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float4 xv = __ldg(x + i);
            s = __fmaf_rn(w[i].x, xv.x, s); s = __fmaf_rn(w[i].y, xv.y, s);
            s = __fmaf_rn(w[i].z, xv.z, s); s = __fmaf_rn(w[i].w, xv.w, s);
        }
        return s;
    }
};

template <int T, int NC>
__device__ __forceinline__ void row_dot(const uint8_t* __restrict__ row, const MvArgs& a, int lane, float acc[NC]) {
    const int nu = Unit<T>::count(a.nb);
    int u = lane;
    for (; u + 32 < nu; u += 64) {
        Unit<T> w0, w1;
        w0.load(row, u, a.nb);
        w1.load(row, u + 32, a.nb);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            acc[c] = fadd(acc[c], w0.dot(a, c, u));
            acc[c] = fadd(acc[c], w1.dot(a, c, u + 32));
        }
    }
    if (u < nu) {
        Unit<T> w0;
        w0.load(row, u, a.nb);
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] = fadd(acc[c], w0.dot(a, c, u));
    }
}

// The warp's whole weight row into L2 (fire and forget: no registers held). Issued
// before pdl_wait(), so the row streams in while the previous kernel finishes; no
// kernel writes weights.
__device__ __forceinline__ void prefetch_row(const uint8_t* __restrict__ row, size_t nbytes, int lane) {
    for (size_t o = (size_t)lane * 128; o < nbytes; o += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row + o));
}

// Calls f.template operator()<T>() for a weight type the matvec handles.
template <class F>
__device__ __forceinline__ void mv_dispatch(int type, F&& f) {
    switch (type) {
        case T_F32: f.template operator()<T_F32>(); break;
        case T_F16: f.template operator()<T_F16>(); break;
        case T_Q4_0: f.template operator()<T_Q4_0>(); break;
        case T_Q4_1: f.template operator()<T_Q4_1>(); break;
        case T_Q5_0: f.template operator()<T_Q5_0>(); break;
        case T_Q5_1: f.template operator()<T_Q5_1>(); break;
        case T_Q8_0: f.template operator()<T_Q8_0>(); break;
        case T_Q4_K: f.template operator()<T_Q4_K>(); break;
        case T_Q5_K: f.template operator()<T_Q5_K>(); break;
        default: f.template operator()<T_Q6_K>(); break;
    }
}

// Instantiation codes above the weight types: a launch whose jobs have one of two types
// (q|k|v of mixed layers: the 7B's Q4_K q, k beside a Q6_K v, the 0.5B's Q5_0 beside Q8_0),
// a two-way branch instead of the switch.
__host__ __device__ constexpr int mv_pair(int a, int b) { return 1000 + 32 * a + b; }
__host__ __device__ constexpr bool is_pair(int tt) { return tt >= 1000; }
__host__ __device__ constexpr int pair_a(int tt) { return (tt - 1000) / 32; }
__host__ __device__ constexpr int pair_b(int tt) { return (tt - 1000) % 32; }

// TT >= 0: every job of the launch has weight type TT (no switch: the kernel's register
// count is that type's, not the most demanding type's, so more warps stay resident).
template <int NC, int TT>
__device__ __forceinline__ void row_dot_any(int type, const uint8_t* __restrict__ row, const MvArgs& a, int lane,
                                            float acc[NC]) {
    if constexpr (is_pair(TT)) {
        if (type == pair_a(TT)) row_dot<pair_a(TT), NC>(row, a, lane, acc);
        else row_dot<pair_b(TT), NC>(row, a, lane, acc);
    } else if constexpr (TT >= 0) row_dot<TT, NC>(row, a, lane, acc);
    else mv_dispatch(type, [&] <int T>() { row_dot<T, NC>(row, a, lane, acc); });
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fadd(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One row of one job: the dot products, the warp reduction, the epilogue (lane 0).
// A row's result from its reduced sums: bias, residual, SwiGLU, as every launch shape
// computes it.
__device__ __forceinline__ float mv_store(const MvJob& jb, int row, int c, float acc, float acc2) {
    float r = acc;
    if (jb.bias) r = fadd(r, jb.bias[row]);
    if (jb.resid) r = fadd(r, jb.resid[(size_t)c * jb.rows + row]);
    if (jb.W2) {
        float u = acc2;
        if (jb.bias2) u = fadd(u, jb.bias2[row]);
        r = silu_f(r) * u;
    }
    jb.y[(size_t)c * jb.rows + row] = r;
    return r;
}

__host__ __device__ constexpr bool quantized(int type) { return type != T_F32 && type != T_F16; }

// A row's sums (acc, and W2's acc2) to its stored value: the warp reduction, the norm's
// scale (rs: column 0's, loaded ahead), the epilogue. Returns column 0's (in lane 0).
template <int NC>
__device__ __forceinline__ float mv_finish(const MvArgs& a, const MvJob& jb, int row, int lane, float acc[NC],
                                           float acc2[NC], float rs);

// Returns column 0's stored value (in lane 0).
template <int NC, int TT>
__device__ __forceinline__ float mv_row(const MvArgs& a, const MvJob& jb, int row, int lane) {
    float acc[NC], acc2[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = acc2[c] = 0.0f;
    // A deferred norm copy's scale: loaded now, used after the dot products.
    const float rs = NC == 1 && a.xscale ? __ldg(a.xscale) : 1.0f;
    const uint8_t* ra = jb.W + (size_t)row * jb.row_bytes;
    row_dot_any<NC, TT>(jb.type, ra, a, lane, acc);
    if (jb.W2) row_dot_any<NC, TT>(jb.type2, jb.W2 + (size_t)row * jb.row_bytes2, a, lane, acc2);
    return mv_finish<NC>(a, jb, row, lane, acc, acc2, rs);
}

// A row of at most 64 units held in registers: lane l's units l and l + 32.
template <int T>
struct RowUnits {
    Unit<T> w[2];
    __device__ __forceinline__ void load(const uint8_t* __restrict__ row, int nb, int lane) {
        const int nu = Unit<T>::count(nb);
        if (lane < nu) w[0].load(row, lane, nb);
        if (lane + 32 < nu) w[1].load(row, lane + 32, nb);
    }
    // row_dot's additions in row_dot's order (unit lane, then lane + 32, per column).
    template <int NC>
    __device__ __forceinline__ void dot(const MvArgs& a, int lane, float acc[NC]) const {
        const int nu = Unit<T>::count(a.nb);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (lane < nu) acc[c] = fadd(acc[c], w[0].dot(a, c, lane));
            if (lane + 32 < nu) acc[c] = fadd(acc[c], w[1].dot(a, c, lane + 32));
        }
    }
};

// Whether mv_row_early takes a W2 (gate|up) in instantiation TT for weight type T: only
// in one-type kernels of the 32-element block types; two K-quant rows held across the
// wait made the kernels, held to 72 registers, spill (up to 272 bytes), and the switch
// kernel's registers doubled. The host (matvec_multi) sets wearly accordingly.
__host__ __device__ constexpr bool early_w2_type(int t) { return t == T_Q4_0 || t == T_Q5_0 || t == T_Q8_0; }
template <int TT, int T>
constexpr bool mv_early_w2() { return TT == T && early_w2_type(T); }
// Whether the switch kernel (TT < 0) takes the early path for type T: not for the
// K-quants, whose early rows took its RoPE instantiation from 72 to 161 registers.
template <int TT, int T>
constexpr bool mv_early_ok() { return TT >= 0 || !kquant(T); }

// mv_row for a.wearly launches, pdl_wait() included: the row's weights are on their way
// into registers before the wait, so after it only the activations' loads stand between
// the wait and the arithmetic. The same operations as mv_row: the same bits. (The sums
// are declared after the wait: live across it, the wait's memory clobber kept them in a
// stack frame.)
template <int NC, int TT, int T>
__device__ __forceinline__ float mv_row_early_t(const MvArgs& a, const MvJob& jb, int row, int lane) {
    if constexpr (T == T_F32 || T == T_F16 || !mv_early_ok<TT, T>()) {
        __trap();  // the host sets wearly for quantized types only, K-quants one-type
        return 0.0f;
    } else {
        constexpr bool w2 = mv_early_w2<TT, T>();
        if (!w2 && jb.W2) __trap();  // nor for a W2 here (mv_early_w2)
        RowUnits<T> u1, u2;
        u1.load(jb.W + (size_t)row * jb.row_bytes, a.nb, lane);
        if (w2 && jb.W2) u2.load(jb.W2 + (size_t)row * jb.row_bytes2, a.nb, lane);
        pdl_wait();
        const float rs = NC == 1 && a.xscale ? __ldg(a.xscale) : 1.0f;
        float acc[NC], acc2[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] = acc2[c] = 0.0f;
        u1.template dot<NC>(a, lane, acc);
        if (w2 && jb.W2) u2.template dot<NC>(a, lane, acc2);
        return mv_finish<NC>(a, jb, row, lane, acc, acc2, rs);
    }
}

template <int NC, int TT>
__device__ __forceinline__ float mv_row_early(const MvArgs& a, const MvJob& jb, int row, int lane) {
    if constexpr (is_pair(TT)) {
        if (jb.type == pair_a(TT)) return mv_row_early_t<NC, TT, pair_a(TT)>(a, jb, row, lane);
        return mv_row_early_t<NC, TT, pair_b(TT)>(a, jb, row, lane);
    } else if constexpr (TT >= 0) {
        return mv_row_early_t<NC, TT, TT>(a, jb, row, lane);
    } else {
        float v = 0.0f;
        mv_dispatch(jb.type, [&] <int T>() { v = mv_row_early_t<NC, TT, T>(a, jb, row, lane); });
        return v;
    }
}

template <int NC>
__device__ __forceinline__ float mv_finish(const MvArgs& a, const MvJob& jb, int row, int lane, float acc[NC],
                                           float acc2[NC], float rs) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        acc[c] = warp_sum(acc[c]);
        if (jb.W2) acc2[c] = warp_sum(acc2[c]);
        if (a.xscale) {
            const float r = NC == 1 ? rs : __ldg(a.xscale + c);
            if (quantized(jb.type)) acc[c] = fmul(acc[c], r);
            if (jb.W2 && quantized(jb.type2)) acc2[c] = fmul(acc2[c], r);
        }
    }
    float v0 = 0.0f;
    if (lane == 0) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const float v = mv_store(jb, row, c, acc[c], acc2[c]);
            if (c == 0) v0 = v;
        }
    }
    return v0;
}

__device__ __forceinline__ void prefetch_job_row(const MvJob& jb, int row, int lane) {
    prefetch_row(jb.W + (size_t)row * jb.row_bytes, jb.row_bytes, lane);
    if (jb.W2) prefetch_row(jb.W2 + (size_t)row * jb.row_bytes2, jb.row_bytes2, lane);
}

// Pair k's angle at the step's position: from the table when it holds the position.
__device__ __forceinline__ void rope_cs_of(const MvRopeStore& r, int k, float& c, float& s) {
    rope_cs_at(r.cs_table, r.cs_rows, k, r.n_rot, r.pos[0], r.cfg, c, s);
}

// A warp computes one row (with a.prefetch, requested into L2 before pdl_wait()).
// The q|k|v launch's ticket tail: after this block's rows of job j (one head's rows lie in
// whole blocks: hd % MV_WARPS == 0), the last block of the head ropes it and stores
// it into the KV cache exactly as k_rope2_store does. y is read through L2 (rope_elem's
// __ldcg): other blocks wrote it during this launch. cs: the head's pair angles
// (rope_cs_of), taken by every block of a q or k head before the wait (positions are
// inputs), or null.
constexpr int ROPE_CS_MAX = 128;  // pairs whose angles a block keeps in shared memory

__device__ __forceinline__ void rope_store_tail(const MvArgs& a, const MvJob& jb, int j, int row0,
                                                const float2* cs) {
    const MvRopeStore& r = a.rope;
    const int role = r.role[j];
    if (!role) return;
    const int head = row0 / r.hd;
    __shared__ int s_ticket;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_ticket = atomicAdd(r.tickets + a.rope_tk0[j] + head, 1);
    __syncthreads();
    if (s_ticket != r.hd / MV_WARPS - 1) return;
    __threadfence();
    const float* xr = jb.y + (int64_t)head * r.hd;
    const int64_t kv_dim = (int64_t)jb.rows;  // k and v jobs: nhk * hd rows
    const int32_t c = r.cells ? r.cells[0] : 0;
    const bool cell_ok = c >= 0 && c < r.n_ctx;
    if (role == 3) {
        if (!cell_ok) {
            if (threadIdx.x == 0) *r.err = 3;
        } else {
            __half* vr = (__half*)r.vc + (int64_t)c * kv_dim + (int64_t)head * r.hd;
            for (int i = threadIdx.x; i < r.hd; i += blockDim.x) vr[i] = __float2half_rn(__ldcg(xr + i));
        }
    } else {
        const int64_t half = r.n_rot / 2, per_row = r.hd - half;
        float* yr = (role == 1 ? r.yq : r.yk) + (int64_t)head * r.hd;
        __half* kr = (__half*)r.kc + (int64_t)c * kv_dim + (int64_t)head * r.hd;
        for (int64_t k = threadIdx.x; k < per_row; k += blockDim.x) {
            int64_t i0, i1;
            float y0, y1;
            if (cs)
                rope_apply(xr, r.cfg.style, k, half, r.n_rot, k < half ? cs[k].x : 0.0f, k < half ? cs[k].y : 0.0f, i0,
                           y0, i1, y1);
            else
                rope_elem(xr, k, half, r.n_rot, r.pos[0], r.cfg, i0, y0, i1, y1);
            yr[i0] = y0;
            yr[i1] = y1;
            if (role == 2) {
                if (!cell_ok) {
                    *r.err = 3;
                } else {
                    kr[i0] = __float2half_rn(y0);
                    kr[i1] = __float2half_rn(y1);
                }
            }
        }
    }
    if (threadIdx.x == 0) r.tickets[a.rope_tk0[j] + head] = 0;
}

// The q|k|v launch's tail without tickets (rope.local): a q or k head's rows are dealt to its
// blocks so that each block holds whole rotated pairs, or four pass-through rows; the
// block exchanges its four row values in shared memory and ropes and stores them itself.
// Block i of a head holds pairs 2i and 2i + 1: NeoX rows 2i, 2i + 1, 2i + n_rot/2,
// 2i + 1 + n_rot/2; normal style its own rows 4i .. 4i + 3, as every pass-through block
// does. A v row is stored into the KV cache by its own warp. The same operations on the
// same values as rope_store_tail.
__device__ __forceinline__ int rope_local_row(const MvRopeStore& r, int b, int w) {
    const int per_head = r.hd / MV_WARPS, head = b / per_head, i = b % per_head, half = r.n_rot / 2;
    if (r.cfg.style == 0 && i < half / 2) return head * r.hd + 2 * i + (w < 2 ? w : half + w - 2);
    return head * r.hd + i * MV_WARPS + w;
}
// Whether block b of a q or k job holds two rotated pairs (rope_local_row's first case)
// rather than four pass-through rows.
__device__ __forceinline__ bool rope_local_pairs(const MvRopeStore& r, int b) {
    return b % (r.hd / MV_WARPS) < r.n_rot / 4;
}

__device__ __forceinline__ void rope_local_tail(const MvArgs& a, const MvJob& jb, int j, int b, float v, int lane,
                                                const float2* cs) {
    const MvRopeStore& r = a.rope;
    const int role = r.role[j];
    if (!role) return;
    const int w = threadIdx.x >> 5;
    const int64_t kv_dim = (int64_t)jb.rows;  // k and v jobs: nhk * hd rows
    const int32_t c = r.cells ? r.cells[0] : 0;
    const bool cell_ok = c >= 0 && c < r.n_ctx;
    if (role == 3) {
        if (lane == 0) {
            if (!cell_ok) *r.err = 3;
            else ((__half*)r.vc)[(int64_t)c * kv_dim + b * MV_WARPS + w] = __float2half_rn(v);
        }
        return;
    }
    __shared__ float vals[MV_WARPS];
    if (lane == 0) vals[w] = v;
    __syncthreads();
    const int per_head = r.hd / MV_WARPS, head = b / per_head, i = b % per_head, half = r.n_rot / 2;
    float* yr = (role == 1 ? r.yq : r.yk) + (int64_t)head * r.hd;
    __half* kr = (__half*)r.kc + (int64_t)c * kv_dim + (int64_t)head * r.hd;
    const int t = threadIdx.x;
    if (rope_local_pairs(r, b)) {
        if (t < 2) {
            // Pair 2i + t: NeoX holds its elements in warps t and 2 + t, normal style in
            // warps 2t and 2t + 1.
            const int normal = r.cfg.style;
            int64_t e0, e1;
            rope_pair_at(normal, 2 * i + t, half, e0, e1);
            const float cc = cs[t].x, sn = cs[t].y;
            float y0, y1;
            rope_rot(vals[normal ? 2 * t : t], vals[normal ? 2 * t + 1 : 2 + t], cc, sn, y0, y1);
            yr[e0] = y0;
            yr[e1] = y1;
            if (role == 2) {
                if (!cell_ok) {
                    *r.err = 3;
                } else {
                    kr[e0] = __float2half_rn(y0);
                    kr[e1] = __float2half_rn(y1);
                }
            }
        }
    } else if (t < MV_WARPS) {
        const int i0 = i * MV_WARPS + t;  // = n_rot + (i - n_rot/4) * MV_WARPS + t
        yr[i0] = vals[t];
        if (role == 2) {
            if (!cell_ok) *r.err = 3;
            else kr[i0] = __float2half_rn(vals[t]);
        }
    }
}

// Resident blocks per SM the one-type K-quant kernels are held to: left alone, ptxas gave
// the Q6_K kernel 96 registers (5 blocks) once the deferred norm scale was added (72
// before); held to 7 blocks it takes 72. (The kernels without the RoPE tail fit 8 blocks
// at 64 registers without spills, but the 7B's tg128 fell: 383 / 387 / 384 against 400 /
// 402 / 393.)
template <int NC, int TT>
constexpr int mv_min_blocks() {
    return NC == 1 && (is_pair(TT) ? kquant(pair_a(TT)) || kquant(pair_b(TT)) : kquant(TT)) ? 7 : 0;
}

// RT: the instantiation carries the q|k|v launch's RoPE + KV-store tail (one column only). The
// launches without it take RT = false, whose registers the tail's code does not inflate:
// with it compiled in, the one-type Q4_K / Q6_K kernels spilled (24 / 44 bytes a thread)
// at the 72 registers they are held to, in the o and down projections too.
// EW: the instantiation for a.wearly launches (mv_row_early), apart so that the rows held
// across the wait cost the other launches no registers.
template <int NC, int TT = -1, bool RT = false, bool EW = false>
__global__ void __launch_bounds__(MV_WARPS * 32, mv_min_blocks<NC, TT>()) k_matvec(MvArgs a) {
    static_assert(!RT || NC == 1, "the rope tail takes one column");
    TL_BEGIN(RT ? tl::MV_ROPE : tl::MV);
    pdl_trigger();
    int j = 0;
    while (j + 1 < a.njobs && (int)blockIdx.x >= a.block0[j + 1]) ++j;
    const MvJob& jb = a.job[j];
    const int lane = threadIdx.x & 31;
    const int b = blockIdx.x - a.block0[j];  // the block's index within its job
    const bool rope_local = RT && a.rope.tickets && a.rope.local;
    const bool roped = rope_local && (a.rope.role[j] == 1 || a.rope.role[j] == 2);
    const int row0 = roped ? rope_local_row(a.rope, b, threadIdx.x >> 5) : b * MV_WARPS + (threadIdx.x >> 5);
    const bool has_row = row0 < jb.rows;  // a warp without a row reads and writes nothing
    if (a.prefetch && !EW && has_row) prefetch_job_row(jb, row0, lane);
    // The q|k|v launch's tail: the rotation angles (from the table, or double-precision pow, cos,
    // sin) off the critical path, before the wait. (The last block working them out after
    // it measured slower: 0.5B tg128 1,252 / 1,241 against 1,296 / 1,308, f9a55ec.)
    const float2* cs = nullptr;
    if constexpr (RT) {
        __shared__ float2 cs_smem[ROPE_CS_MAX];
        if (roped) {
            if (rope_local_pairs(a.rope, b)) {  // the block's two pairs
                if (threadIdx.x < 2) {
                    float c, sn;
                    rope_cs_of(a.rope, 2 * (b % (a.rope.hd / MV_WARPS)) + threadIdx.x, c, sn);
                    cs_smem[threadIdx.x] = make_float2(c, sn);
                }
                cs = cs_smem;  // read in the tail, after its __syncthreads()
            }
        } else if (a.rope.tickets && (a.rope.role[j] == 1 || a.rope.role[j] == 2) &&
                   a.rope.n_rot / 2 <= ROPE_CS_MAX) {
            for (int k = threadIdx.x; k < a.rope.n_rot / 2; k += blockDim.x) {
                float c, sn;
                rope_cs_of(a.rope, k, c, sn);
                cs_smem[k] = make_float2(c, sn);
            }
            cs = cs_smem;  // read in the tail, after its __syncthreads()
        }
    }
    TL_MARK(1);
    float v = 0.0f;  // the row's value (lane 0)
    if constexpr (EW) {
        if (has_row) v = mv_row_early<NC, TT>(a, jb, row0, lane);  // its wait inside
        else pdl_wait();
    } else {
        pdl_wait();
        TL_MARK(2);
        if (has_row) v = mv_row<NC, TT>(a, jb, row0, lane);
    }
    TL_MARK(3);
    if constexpr (RT) {
        if (rope_local) rope_local_tail(a, jb, j, b, v, lane, cs);
        else if (a.rope.tickets) rope_store_tail(a, jb, j, row0, cs);
        TL_MARK(4);
    }
    TL_MARK(5);
    TL_END();
}


// ---- long rows, four to a block (k_matvec_x4) ----------------------------------------
// k_matvec's one-row-a-warp work dealt differently: a block takes rows 4b .. 4b + 3, and
// "virtual lane" l (0..31) of row r is thread (warp l / 8, lane 8 r + l % 8). Each thread
// does exactly what lane l of the row's warp does in k_matvec (units l, l + 32, ... in
// order), and the butterfly's rounds are the same sums: partners l ^ 16 and l ^ 8 sit in
// warps w ^ 2 and w ^ 1 (through shared memory), l ^ 4, 2, 1 in the same warp. So the bits
// are k_matvec's. What changes is what one load instruction of a warp touches: 8 units of
// 4 rows instead of 32 units of one, so the activation pieces it reads are 8 (each read by
// 4 lanes) instead of 32: a quarter of the L1 wavefronts for the activations, which made
// the down projection L1-bound (Nsight Compute, H200 at 1.95 GHz: L1/TEX 79% at 48% DRAM).
// One job, one column, no W2, no int8 copy out, no RoPE tail; long rows only (launch_x4).
// Several columns (NC) take the same layout: each column's activation pieces are read
// by 8 lanes' worth of units instead of 32, which matters NC times as much (one row a
// warp, four columns ran the 7B's matmuls at a third of the one-column rate).
template <int T, int NC = 1>
__global__ void __launch_bounds__(MV_WARPS * 32, mv_min_blocks<NC, T>()) k_matvec_x4(MvArgs a) {
    static_assert(MV_WARPS == 4, "virtual lanes 8 w + l % 8");
    TL_BEGIN(tl::MV);
    pdl_trigger();
    const MvJob& jb = a.job[0];
    const int w = threadIdx.x >> 5, p = threadIdx.x & 31;
    const int vl = 8 * w + (p & 7), row = blockIdx.x * 4 + (p >> 3);
    __shared__ float red[NC][MV_WARPS][32];
    TL_MARK(1);
    pdl_wait();
    TL_MARK(2);
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    if (row < jb.rows) row_dot<T, NC>(jb.W + (size_t)row * jb.row_bytes, a, vl, acc);
    TL_MARK(3);
#pragma unroll
    for (int c = 0; c < NC; ++c) red[c][w][p] = acc[c];
    __syncthreads();
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = fadd(acc[c], red[c][w ^ 2][p]);  // round 16
    __syncthreads();
#pragma unroll
    for (int c = 0; c < NC; ++c) red[c][w][p] = acc[c];
    __syncthreads();
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        float v = fadd(acc[c], red[c][w ^ 1][p]);  // round 8
        for (int o = 4; o > 0; o >>= 1) v = fadd(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (vl == 0 && row < jb.rows) {
            if (a.xscale) v = fmul(v, __ldg(a.xscale + c));
            mv_store(jb, row, c, v, 0.0f);
        }
    }
    TL_MARK(5);
    TL_END();
}

// ---- staged decode matvec (k_matvec_bulk) -------------------------------------------
// One job, one column, one weight type T (W2 too). Each warp takes row slots of the
// matrix and streams them into a ring of up to BULK_STAGES slots in shared memory with
// bulk asynchronous copies (the copy engine, not registers, holds the bytes in flight),
// one mbarrier per slot; it computes a slot's rows while the next slots are on their way.
// Its first slot is requested before pdl_wait() (weights are never written by a kernel).
// A row's arithmetic is row_dot's (lane l takes units l, l + 32, ... in order), its
// reduction and epilogue mv_row's: the same bits as k_matvec.
constexpr int BULK_STAGES = 4;  // ring slots per warp, at most (the launch picks ns <= this)
// Resident blocks per SM the ring is sized for (bulk_stages), and that the kernel is held
// to (at most 80 registers: left alone, ptxas gave the one-row-slot K-quant kernels 86 to
// 96 once the launch's dead variants were deleted, five blocks an SM).
constexpr int kBulkSmBlocks = 6;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bulk_row(uint64_t* bar, uint8_t* dst, const uint8_t* src, uint32_t bytes,
                                         uint8_t* dst2, const uint8_t* src2, uint32_t bytes2) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes + bytes2)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
    if (bytes2)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         smem_u32(dst2)),
                     "l"(src2), "r"(bytes2), "r"(smem_u32(bar))
                     : "memory");
}

__device__ __forceinline__ void bulk_wait(uint64_t* bar, uint32_t phase) {
    uint32_t done = 0;
    while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.b32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(smem_u32(bar)), "r"(phase)
            : "memory");
}

__device__ __forceinline__ uint4 lds4(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

// A lane's units l and l + 32 (k = 0, 1) in the staged rows of the XR path: by default
// placed from u for every row, as the other kernels place them.
template <int T>
struct StagedLane {
    int lane, nb;
    __device__ StagedLane(int l, int nb_) : lane(l), nb(nb_) {}
    __device__ __forceinline__ float dot(const uint8_t* srow, uint32_t, int k, const typename Unit<T>::X& x) const {
        const int u = lane + 32 * k;
        Unit<T> w;
        w.template load<false>(srow, u, nb);
        return w.dot(x, u);
    }
};
// Q4_K: unit l + 32 k's header lies 128 k bytes after unit l's (4 superblocks), its quants
// 1024 k after (4 groups): the offsets and the scale selection are the lane's constants,
// and the loads take 32-bit shared addresses (from a generic pointer the compiler rebuilt
// the shared window's base for every unit). The same loads and arithmetic as Unit's.
// (The selection passes through a shuffle, each lane reading its own: computed from the
// lane in sight, ptxas recomputed it for every unit, 8 instructions, rather than hold it;
// from a table in memory, its constant-cache miss after the kernel's wait cost 9% of the
// gate|up launch's warp time.)
template <>
struct StagedLane<T_Q4_K> {
    uint32_t h, q;
    K4Sel sel;
    int lane;
    __device__ StagedLane(int l, int nb) : h((uint32_t)q4k_hdr(l >> 2)), q((uint32_t)q4k_qs(nb >> 3, l, 0)), lane(l) {
        const uint32_t hi = ((uint32_t)l >> 1) & 1u, sh = 16u * ((uint32_t)l & 1u);
        sel.sh = __shfl_sync(0xffffffffu, sh, l);
        sel.s01 = __shfl_sync(0xffffffffu, sh + 2u * hi, l);
        sel.k01 = __shfl_sync(0xffffffffu, hi ? 0x3030u : 0x3F3Fu, l);
        sel.k2 = __shfl_sync(0xffffffffu, hi ? 0x0F0Fu : 0u, l);
    }
    __device__ __forceinline__ float dot(const uint8_t*, uint32_t srow, int k, const XK45& x) const {
        static_assert(q4k_hdr(8) == 128 && q4k_qs(0, 32, 0) == 1024 && q4k_qs(0, 0, 1) == 128, "cuda/layout.h");
        Unit<T_Q4_K> w;
        w.h = lds4(srow + h + 128 * k);
        w.q0 = lds4(srow + q + 1024 * k);
        w.q1 = lds4(srow + q + 1024 * k + 128);
        return w.dot_sel(x, lane + 32 * k, sel);
    }
};

// XR: rows of at most 64 units, whose lanes' activation chunks (units lane, lane + 32)
// the warp holds in registers, xr, for all its rows. srow_s: srow's shared address.
template <int T, bool XR>
__device__ __forceinline__ float row_dot_smem(const uint8_t* srow, uint32_t srow_s, const MvArgs& a, int lane,
                                              const StagedLane<T>& sl, const typename Unit<T>::X* xr) {
    const int nu = Unit<T>::count(a.nb);
    float acc = 0.0f;
    if constexpr (XR) {
#pragma unroll
        for (int k = 0; k < 2; ++k)
            if (lane + 32 * k < nu) acc = fadd(acc, sl.dot(srow, srow_s, k, xr[k]));
    } else {
        for (int u = lane; u < nu; u += 32) {
            Unit<T> w;
            w.template load<false>(srow, u, a.nb);
            acc = fadd(acc, w.dot(a, 0, u));
        }
    }
    return acc;
}

// A slot holds R consecutive rows (W's R rows, then W2's), one bulk copy per matrix per
// slot. Bigger copies did not pay on the H200: the 7B's gate|up took 38.3 us with one row
// a slot, 41.4 with two, 67.2 with four (the smem they take leaves fewer warps to hide the
// arithmetic's latency), so rows of 2 KB or more take a slot each.
// The warps take the launch's slots round-robin (warp w: slots w, w + n_warps, ...), so
// the rows in flight at any time form one band of the matrix. (Each warp a contiguous run
// of rows measured slower: the 0.5B's output matvec 45.6 us against 41.2 stamped, 383f57d.)
template <int T, bool XR>
__global__ void __launch_bounds__(MV_WARPS * 32, kBulkSmBlocks) k_matvec_bulk(MvArgs a, int n_warps, int ns, int R) {
    TL_BEGIN(tl::MV_BULK);
    pdl_trigger();
    extern __shared__ __align__(16) uint8_t bulk_smem[];
    const MvJob& jb = a.job[0];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int gw = blockIdx.x * MV_WARPS + wib;
    const int n_slots = (jb.rows + R - 1) / R;
    // Slot st of the warp is the launch's slot st * n_warps + gw.
    const int n_st = gw < n_slots ? (n_slots - gw + n_warps - 1) / n_warps : 0;
    auto slot_row = [&](int st) { return (st * n_warps + gw) * R; };
    const uint32_t rb = (uint32_t)jb.row_bytes, rb2 = jb.W2 ? (uint32_t)jb.row_bytes2 : 0u;
    const uint32_t slot = (uint32_t)R * (rb + rb2);
    uint64_t* bars = reinterpret_cast<uint64_t*>(bulk_smem) + wib * BULK_STAGES;
    uint8_t* ring = bulk_smem + MV_WARPS * BULK_STAGES * sizeof(uint64_t) + (size_t)wib * ns * slot;
    // Slot k <- the R rows of the warp's slot st (fewer at the end).
    auto request = [&](int st, int k) {
        const int rs = slot_row(st), cnt = min(R, jb.rows - rs);
        uint8_t* d = ring + (size_t)k * slot;
        bulk_row(bars + k, d, jb.W + (size_t)rs * rb, (uint32_t)cnt * rb, d + (size_t)R * rb,
                 jb.W2 ? jb.W2 + (size_t)rs * rb2 : nullptr, (uint32_t)cnt * rb2);
    };
    if (lane == 0 && n_st > 0) {
        for (int k = 0; k < ns; ++k)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bars + k)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        request(0, 0);  // the first slot before the wait (bulk_launch says why only that one)
    }
    __syncwarp();
    const uint32_t ring_s = smem_u32(ring);
    const StagedLane<T> sl(lane, a.nb);
    TL_MARK(1);
    pdl_wait();
    TL_MARK(2);
    if (lane == 0)
        for (int k = 1; k < ns && k < n_st; ++k) request(k, k);
    // A deferred norm copy's scale (every type here is quantized).
    const float nsc = a.xscale ? __ldg(a.xscale) : 1.0f;
    typename Unit<T>::X xr[2];
    if constexpr (XR) {
#pragma unroll
        for (int k = 0; k < 2; ++k)
            if (lane + 32 * k < Unit<T>::count(a.nb)) xr[k] = Unit<T>::X::load(a, 0, lane + 32 * k);
    }
    for (int st = 0, k = 0, phase = 0; st < n_st; ++st) {  // k = st % ns, phase = st / ns % 2
        bulk_wait(bars + k, (uint32_t)phase);
        if (st == 0) TL_MARK(3);
        const uint8_t* sw = ring + (size_t)k * slot;
        const int rs = slot_row(st), cnt = min(R, jb.rows - rs);
        for (int q = 0; q < cnt; ++q) {
            const uint32_t ss = ring_s + (uint32_t)k * slot;
            float acc = row_dot_smem<T, XR>(sw + (size_t)q * rb, ss + q * rb, a, lane, sl, xr), acc2 = 0.0f;
            if (rb2)
                acc2 = row_dot_smem<T, XR>(sw + (size_t)R * rb + (size_t)q * rb2, ss + R * rb + q * rb2, a, lane, sl,
                                           xr);
            acc = warp_sum(acc);
            if (rb2) acc2 = warp_sum(acc2);
            if (a.xscale) {
                acc = fmul(acc, nsc);
                acc2 = fmul(acc2, nsc);
            }
            const int row = rs + q;
            if (lane == 0) mv_store(jb, row, 0, acc, acc2);
            if (st == 0 && q == 0) TL_MARK(4);
        }
        __syncwarp();  // every lane is done with slot k
        if (lane == 0 && st + ns < n_st) {
            // The slot's reads (generic proxy) before the copy engine's writes (async proxy).
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            request(st + ns, k);
        }
        if (++k == ns) {
            k = 0;
            phase ^= 1;
        }
    }
    TL_MARK(5);
    TL_END();
}

// Every pair's angle at every position below rows (kernels.h rope_table), by rope_cs.
__global__ void k_rope_table(float2* __restrict__ t, int64_t rows, int n_rot, RopeCfg cfg) {
    const int64_t half = n_rot / 2, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * half) return;
    float c, s;
    rope_cs(i % half, n_rot, (int32_t)(i / half), cfg, c, s);
    t[i] = make_float2(c, s);
}

// The int8 copy of n_blocks blocks of 32 (any number of tokens' rows back to back).
__global__ void k_quant_q8(const float* __restrict__ x, int n_blocks, int in_dim, int8_t* __restrict__ q,
                           float2* __restrict__ ds) {
    TL_BEGIN(tl::QUANT);
    pdl_wait();
    TL_MARK(1);
    pdl_trigger();
    const int blk = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32);
    const int lane = threadIdx.x % 32;
    if (blk >= n_blocks) return;
    const int nb = in_dim / 32, col = blk / nb;
    quant_block_q8(x[blk * 32 + lane], lane, q + (int64_t)col * in_dim, 32 * (blk - col * nb), in_dim, ds + blk);
    TL_MARK(2);
    TL_END();
}

// RMSNorm rows (one block each, blockDim.x = rms_threads(d), d % 32 == 0, d <=
// kNormCopyMaxRow): y = rms_norm(x) * w, bitwise k_rms_norm's, and each row's deferred
// copy for the matvecs that read y: the int8 copy of x * w per 32-element group and the
// row's scale (norm.cuh), which rides on the matvec's row sums. A thread's elements are
// held in registers; its weights are loaded before pdl_wait() (no kernel writes them).
constexpr int NORM_REG = (int)(kNormCopyMaxRow / 1024);
__global__ void k_rms_norm_copy(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
                                int d, float eps, int8_t* __restrict__ q, float2* __restrict__ ds,
                                float* __restrict__ scale, int early) {
    TL_BEGIN(tl::NORM);
    if (early) pdl_trigger();
    __shared__ double red[kNormCopyMaxRow / 32];
    __shared__ float sc;
    const int T = blockDim.x, t = threadIdx.x, lane = t % 32, nb = d / 32;
    const int64_t r = blockIdx.x;
    float wv[NORM_REG], xv[NORM_REG];
#pragma unroll
    for (int k = 0; k < NORM_REG; ++k) wv[k] = w && t + k * T < d ? w[t + k * T] : 0.0f;
    TL_MARK(1);
    pdl_wait();
    TL_MARK(2);
    if (!early) pdl_trigger();
#pragma unroll
    for (int k = 0; k < NORM_REG; ++k) xv[k] = t + k * T < d ? __ldcg(x + r * d + t + k * T) : 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_REG; ++k) {
        const int i = t + k * T, g = i / 32;
        if (i >= d) break;  // whole warps leave together: d and T are multiples of 32
        const double s = group_ss(xv[k]);
        if (lane == 0) red[g] = s;
        quant_block_q8(w ? __fmul_rn(xv[k], wv[k]) : xv[k], lane, q + r * d, 32 * g, d, ds + r * nb + g);
    }
    TL_MARK(3);
    __syncthreads();
    TL_MARK(4);
    if (t < 32) {
        const float s = rms_scale_of(red, nb, d, eps, lane);
        if (lane == 0) sc = scale[r] = s;
    }
    TL_MARK(5);
    __syncthreads();
    TL_MARK(6);
#pragma unroll
    for (int k = 0; k < NORM_REG; ++k) {
        const int i = t + k * T;
        if (i >= d) break;
        const float v = __fmul_rn(xv[k], sc);
        y[r * d + i] = w ? __fmul_rn(v, wv[k]) : v;
    }
    TL_MARK(7);
    TL_END();
}

}  // namespace

bool matvec_type_supported(int32_t wtype) {
    switch (wtype) {
        case T_F32: case T_F16: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0:
        case T_Q4_K: case T_Q5_K: case T_Q6_K: return true;
        default: return false;
    }
}

size_t matvec_scratch_bytes(int64_t in_dim, int64_t ncols) {
    return (size_t)ncols * ((size_t)in_dim + (size_t)(in_dim / 32) * sizeof(float2));
}

size_t norm_copy_bytes(int64_t d, int64_t nt) {
    return matvec_scratch_bytes(d, nt) + (size_t)nt * (size_t)(d / 32) * sizeof(double) + (size_t)nt * sizeof(float);
}

namespace {

template <int NC>
void launch_mv(const MvArgs& a, unsigned blocks) {
    launch(k_matvec<NC>, blocks, MV_WARPS * 32, a);
}

// A one-column launch takes the instantiations with the RoPE tail only when it has the
// tail (every launch on them, the tail's registers paid by all, measured the same: 0.5B
// tg128 1,276 / 1,351 / 1,330 against 1,294 / 1,303 / 1,350, 7B 393 / 401 / 391 against 389
// / 399 / 400, 47a1d8d; without the tail's code Q4_K and Q6_K no longer spill).
template <int TT>
void launch_mv1(const MvArgs& a, unsigned blocks) {
    const bool rt = a.rope.tickets != nullptr;
    if (a.wearly) {
        if (rt) launch(k_matvec<1, TT, true, true>, blocks, MV_WARPS * 32, a);
        else launch(k_matvec<1, TT, false, true>, blocks, MV_WARPS * 32, a);
    } else {
        if (rt) launch(k_matvec<1, TT, true>, blocks, MV_WARPS * 32, a);
        else launch(k_matvec<1, TT, false>, blocks, MV_WARPS * 32, a);
    }
}

// The staged matvec for a one-job, one-column, one-type launch of rows whose slots fit.
// ns slots per warp: the most (up to 4) that leave room for six blocks per SM: the warps
// also need company to hide the latency of their arithmetic, not only bytes in flight.
// (Four or five blocks an SM measured slower, 8 and 10 the same, 580f369 and b77a348; four
// blocks of four slots for the output matvec alone, which a pure-streaming probe read at
// 4.2 TB/s against 3.2, took 186.8 us against 179.3 on the 7B with its arithmetic, and for
// every staged launch 7B tg128 346 / 347 / 349 against 373 / 371 / 374, 617461a; four
// blocks of three slots 537.9 / 538.8 against 545.4 / 545.3 at e47f1fc.)
size_t bulk_smem_bytes(size_t slot, int ns) { return (size_t)MV_WARPS * (BULK_STAGES * sizeof(uint64_t) + ns * slot); }

int bulk_stages(size_t slot) {
    int ns = BULK_STAGES;
    while (ns > 1 && bulk_smem_bytes(slot, ns) * kBulkSmBlocks > (size_t)ctx().smem_per_sm) --ns;
    return ns;
}

// Rows per slot: as many as make a copy of about 4 KB (8 and 16 KB copies measured slower,
// 580f369).
int bulk_rows(size_t row_slot) {
    int R = (int)(4096 / row_slot);
    return R < 1 ? 1 : R > 8 ? 8 : R;
}

template <int T, bool XR>
void launch_bulk_xr(const MvArgs& a, size_t row_slot, int R, int ns) {
    const size_t slot = row_slot * (size_t)R;
    const MvJob& j = a.job[0];
    const size_t smem = bulk_smem_bytes(slot, ns);
    // The largest dynamic shared memory this instantiation was allowed. It only grows,
    // under the lock: two threads' launches never lower what a third relies on.
    static std::atomic<size_t> attr{0};
    if (smem > attr.load()) {
        static std::mutex mu;
        std::lock_guard<std::mutex> lk(mu);
        if (smem > attr.load()) {
            check(cudaFuncSetAttribute(k_matvec_bulk<T, XR>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                  "cudaFuncSetAttribute");
            attr.store(smem);
        }
    }
    int per_sm = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_matvec_bulk<T, XR>, MV_WARPS * 32, smem),
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    int64_t blocks = (int64_t)ctx().n_sm * (per_sm > 0 ? per_sm : 1);
    const int64_t need = (j.rows + MV_WARPS - 1) / MV_WARPS;  // at least a row per warp
    if (blocks > need) blocks = need;
    // A warp requests its first slot before the wait, the rest after it. The launch before
    // a staged one is a norm, whose latency chain the early copies slow down: with all of
    // them early, the 7B's ffn norm took 4.7 us on the timeline against the attention
    // norm's 3.4, and gate|up's wait returned 2.9 us after it ended against q|k|v's 1.2.
    // H200 tg128 side by side, 3 rounds: 7B 492.0 / 490.6 / 495.6 with one slot early,
    // 480.0 / 484.7 / 484.6 with all (two for gate|up, three for the output), 480.3 /
    // 481.5 / 480.7 with none; 0.5B 1,831 / 1,830 / 1,840, 1,815 / 1,824 / 1,806 and 1,799
    // / 1,782 / 1,831 (66f6215, a740438; two early, 534.3 / 533.3, and none, 529.8 / 529.9,
    // lost again at e47f1fc).
    launch_smem(k_matvec_bulk<T, XR>, (unsigned)blocks, MV_WARPS * 32, smem, a, (int)(blocks * MV_WARPS), ns, R);
    ++ctx().c.staged;
}

// Rows of at most 64 units keep each lane's activation chunks in registers for the warp's
// whole run (reloaded for every row, as the plain kernel does, measured slower: H200 7B
// gate|up 39.3 us against 29.9, tg128 359 / 364 against 394 / 391, a6ce246).
bool bulk_xreg(int type, int nb) { return row_units(type, nb) <= 64; }

// Calls f.template operator()<T>() for the weight types the Qwen Q4_K_M / Q8_0 files are
// made of, which the one-type, staged and four-rows-a-block kernels are instantiated for;
// false for another type. (quant.cuh's dispatch_type takes all ten types: through it
// each of those kernels would be compiled for four types no launch gives it.)
template <class F>
bool dispatch_typed(int t, F&& f) {
    switch (t) {
        case T_Q4_K: f.template operator()<T_Q4_K>(); return true;
        case T_Q5_K: f.template operator()<T_Q5_K>(); return true;
        case T_Q6_K: f.template operator()<T_Q6_K>(); return true;
        case T_Q8_0: f.template operator()<T_Q8_0>(); return true;
        case T_Q5_0: f.template operator()<T_Q5_0>(); return true;
        case T_Q4_0: f.template operator()<T_Q4_0>(); return true;
        default: return false;
    }
}

template <int T>
void launch_bulk_t(const MvArgs& a, size_t row_slot, int R, int ns) {
    if (bulk_xreg(T, a.nb)) launch_bulk_xr<T, true>(a, row_slot, R, ns);
    else launch_bulk_xr<T, false>(a, row_slot, R, ns);
}

// Whether the launch takes the staged matvec: when it streams more than 16 MiB in row
// slots of at most 8 KB and at least 512 bytes when the activations stay in registers,
// else 2 KB (H200, the 0.5B's Q8_0 output of 952-byte rows: 45.2 us staged with them in
// registers, 51.0 plain; 65 vs 49 staged without). Smaller launches ran faster on the
// plain kernel (0.5B gate|up 9.5 vs 8.6 us, 7B o 14.6 vs 14.2 with the o / down average,
// at 4 MiB); the plain kernel for every launch measured slower (7B gate|up 43.1 against
// 30.3 us, output 232.6 against 178.6, 617461a; gate|up 470.2 / 469.8 against 537.9 /
// 544.4 tg128 at e47f1fc). Rows longer than a slot take the plain kernel (the staged
// kernel in chunks of a row lost, 2fc64d7 and 2aa82eb).
bool launch_bulk(const MvArgs& a) {
    const MvJob& j = a.job[0];
    if (a.njobs != 1 || a.rope.tickets || (j.W2 && j.type2 != j.type)) return false;
    if (j.row_bytes % 16 || (j.W2 && (j.row_bytes2 % 16 || (uintptr_t)j.W2 % 16)) || (uintptr_t)j.W % 16) return false;
    const size_t slot = j.row_bytes + (j.W2 ? j.row_bytes2 : 0);
    const size_t min_row = bulk_xreg(j.type, a.nb) ? 512 : 2048;
    if (slot < min_row || slot * (size_t)j.rows <= ((size_t)16 << 20) || slot > 8192) return false;
    const int R = bulk_rows(slot);
    const int ns = bulk_stages(slot * R);
    if (bulk_smem_bytes(slot * R, ns) > (size_t)ctx().smem_optin) return false;
    return dispatch_typed(j.type, [&]<int T>() { launch_bulk_t<T>(a, slot, R, ns); });
}

// The weight type of every job (W2 too), or -1 where they differ.
int one_type(const MvJob* jobs, int njobs) {
    const int t = jobs[0].type;
    for (int i = 0; i < njobs; ++i)
        if (jobs[i].type != t || (jobs[i].W2 && jobs[i].type2 != t)) return -1;
    return t;
}

// k_matvec_x4 for a one-column, one-job launch of rows of at least kX4MinUnits units of
// one of the typed kernels' weight types, without W2, int8 copy or RoPE tail. H200 tg128
// side by side, 3 rounds: the 7B's down rows (296 units) 496.6 / 498.2 / 495.0 against
// 491.6 / 493.1 / 494.3 one row a warp, and with the two-type q|k|v kernel (pair_type)
// 504.3 / 504.8 / 503.7; the 0.5B's down rows (76 and 152 units) lost four to a block:
// 1,775 / 1,720 / 1,777 against 1,842 / 1,833 / 1,838 (3a05235).
constexpr int kX4MinUnits = 200;
// Launches of NC > 1 columns (one job without W2, matvec_multi checks) take it for rows of
// at least g_x4_cols_units units (all, unless a test holds it to one row a warp).
int g_x4_cols_units = 0;
template <int NC = 1>
bool launch_x4(const MvArgs& a) {
    const MvJob& j = a.job[0];
    if (NC == 1 && (a.njobs != 1 || a.rope.tickets || a.wearly || j.W2 || j.q_out)) return false;
    if (row_units(j.type, a.nb) < (NC == 1 ? kX4MinUnits : g_x4_cols_units)) return false;
    const unsigned blocks = (unsigned)((j.rows + 3) / 4);
    if (!dispatch_typed(j.type, [&]<int T>() { launch(k_matvec_x4<T, NC>, blocks, MV_WARPS * 32, a); })) return false;
    ++ctx().c.x4;
    return true;
}

// The pair instantiation (mv_pair) of a launch whose jobs have exactly the two types of
// one, no W2, or -1. (The switch kernel, whose K-quant rows load after the wait, measured
// slower for them: H200 tg128 side by side, 3 rounds: 7B 491.6 / 493.1 / 494.3 against
// 494.3 / 493.7 / 494.1 alone, 496.6 / 498.2 / 495.0 against 504.3 / 504.8 / 503.7 with
// k_matvec_x4 for down; 0.5B 1,831 / 1,812 / 1,794 against 1,832 / 1,829 / 1,836, 3a05235.)
int pair_type(const MvJob* jobs, int njobs) {
    for (const int tt : {mv_pair(T_Q4_K, T_Q6_K), mv_pair(T_Q5_0, T_Q8_0)}) {
        bool ok = true, seen_a = false, seen_b = false;
        for (int i = 0; i < njobs; ++i) {
            ok = ok && !jobs[i].W2 && (jobs[i].type == pair_a(tt) || jobs[i].type == pair_b(tt));
            seen_a = seen_a || jobs[i].type == pair_a(tt);
            seen_b = seen_b || jobs[i].type == pair_b(tt);
        }
        if (ok && seen_a && seen_b) return tt;
    }
    return -1;
}

// The one-type instantiations of one-column launches (decode), for the types the Qwen
// Q4_K_M / Q8_0 files are made of; others take the switch. (Every launch on the switch
// kernel measured slower: tg128 0.5B 751 / 796 against 837 / 787, 7B 252 / 251 against
// 259 / 255, d98fd85 at 1749894.)
bool launch_mv_typed(const MvArgs& a, unsigned blocks) {
    if (dispatch_typed(one_type(a.job, a.njobs), [&]<int T>() { launch_mv1<T>(a, blocks); })) return true;
    switch (pair_type(a.job, a.njobs)) {
        case mv_pair(T_Q4_K, T_Q6_K): launch_mv1<mv_pair(T_Q4_K, T_Q6_K)>(a, blocks); break;
        case mv_pair(T_Q5_0, T_Q8_0): launch_mv1<mv_pair(T_Q5_0, T_Q8_0)>(a, blocks); break;
        default: return false;
    }
    ++ctx().c.pair;
    return true;
}

}  // namespace

void matvec_multi(const MvJob* jobs, int njobs, int64_t in_dim, const float* x, void* scratch, int ncols,
                  bool xq_ready, const MvRopeStore* rope, bool in_norm) {
    if (njobs < 1 || njobs > MV_MAX_JOBS) throw std::invalid_argument("matvec_multi: 1..4 jobs");
    if (ncols < 1 || (ncols > 1 && (njobs != 1 || jobs[0].W2)))
        throw std::invalid_argument("matvec_multi: several columns take one job without W2");
    if (in_norm && (!xq_ready || !scratch || in_dim % 32 || in_dim > kNormCopyMaxRow))
        throw std::invalid_argument("matvec_multi: a norm's deferred copy is made before, rows of <= 4096");
    const int nb = (int)(in_dim / 32);
    MvArgs a;
    a.xscale = in_norm ? norm_copy_scale(scratch, in_dim, ncols) : nullptr;
    a.x = x;
    a.in_dim = (int)in_dim;
    a.nb = nb;
    a.xq = (const int8_t*)scratch;
    a.xds = scratch ? (const float2*)((uint8_t*)scratch + (size_t)ncols * in_dim) : nullptr;
    bool quant = false;
    for (int i = 0; i < njobs; ++i)
        quant |= !(jobs[i].type == T_F32 || jobs[i].type == T_F16) || (jobs[i].W2 && !(jobs[i].type2 == T_F32 || jobs[i].type2 == T_F16));
    if (quant && !scratch) throw std::invalid_argument("matvec_multi: quantized weights need the activation scratch");
    if (quant && !xq_ready) {
        const int n = nb * ncols;
        launch(k_quant_q8, (unsigned)((n * 32 + 255) / 256), 256, x, n, (int)in_dim, (int8_t*)a.xq, (float2*)a.xds);
    }
    a.njobs = njobs;
    // One row a warp. (Several, as many as fit one wave of resident warps, measured
    // slower: H200 7B tg128 233 against 256, the 0.5B no faster, 5e7fd8b.)
    // L2 prefetch of the row before pdl_wait(), while the launch before finishes, for
    // launches of at most 16 MiB of weights: it shortens small, latency-bound launches,
    // but cost the large, bandwidth-bound ones (7B tg128 307 with it against 316, while the
    // 0.5B lost 2% without, 562697d; the 7B's down prefetched, 64 MiB, was dropped too).
    size_t wbytes = 0;
    for (int i = 0; i < njobs; ++i)
        wbytes += (size_t)jobs[i].rows * (jobs[i].row_bytes + (jobs[i].W2 ? jobs[i].row_bytes2 : 0));
    a.prefetch = wbytes <= ((size_t)16 << 20);
    a.wearly = 0;
    a.rope = MvRopeStore{};
    if (rope) {
        // A head's rows in whole blocks of one row per warp; one token.
        if (ncols != 1 || rope->hd % MV_WARPS) throw std::invalid_argument("matvec_multi: rope tail needs one column");
        a.rope = *rope;
        // Whole rotated pairs in each block, no tickets, where the rotary dims allow it;
        // else the last block of each head, found by a ticket, ropes and stores the head
        // (slower where both can: 0.5B tg128 1,211 / 1,289 against 1,301 / 1,340, 72b3a5d).
        a.rope.local = rope->n_rot % 4 == 0 && (rope->hd - rope->n_rot) % MV_WARPS == 0;
        int tk = 0;
        for (int i = 0; i < njobs; ++i) {
            a.rope_tk0[i] = tk;
            if (rope->role[i]) {
                if (jobs[i].rows % rope->hd) throw std::invalid_argument("matvec_multi: rope job rows % hd");
                tk += jobs[i].rows / rope->hd;
            }
        }
    }
    {
        // Rows of at most 64 units loaded into registers before the wait (after it,
        // prefetched into L2 before it, measured slower: H200 0.5B tg128 1,601 / 1,629 /
        // 1,606 against 1,796 / 1,770 / 1,799, 3572076). Whether launch_mv_typed takes the
        // launch: K-quants only then (mv_early_ok), a W2 only then and of a type
        // mv_early_w2 allows.
        const bool one = one_type(jobs, njobs) >= 0;
        const bool same = one || pair_type(jobs, njobs) >= 0;
        const bool w2_ok = one && early_w2_type(jobs[0].type);
        a.wearly = 1;
        for (int i = 0; i < njobs; ++i) {
            const int32_t t = jobs[i].type;
            if (!quantized(t) || row_units(t, nb) > 64 || (jobs[i].W2 && !w2_ok) || (kquant(t) && !same)) a.wearly = 0;
        }
    }
    int b = 0;
    for (int i = 0; i < njobs; ++i) {
        if (jobs[i].q_out && (jobs[i].rows % 32 || njobs != 1 || ncols != 1))
            throw std::invalid_argument("matvec_multi: q_out needs one job, one column, rows % 32 == 0");
        a.job[i] = jobs[i];
        a.block0[i] = b;
        b += (jobs[i].rows + MV_WARPS - 1) / MV_WARPS;
    }
    // Blocks of 9 and more columns: the tensor cores, the weights read once.
    if (ncols > 1 && !rope && mmq_matvec(jobs[0], in_dim, a.xq, a.xds, a.xscale, ncols)) return;
    // Columns in launches of 8, 4, 2, 1: each column's bits are the same in all of them.
    for (int c0 = 0; c0 < ncols;) {
        const int left = ncols - c0;
        const int nc = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        MvArgs ac = a;
        if (nc > 1) ac.wearly = 0;  // launch_mv's instantiations have no early path
        ac.x = x + (size_t)c0 * in_dim;
        if (ac.xq) {
            ac.xq += (size_t)c0 * in_dim;
            ac.xds += (size_t)c0 * nb;
        }
        if (ac.xscale) ac.xscale += c0;
        ac.job[0].y += (size_t)c0 * jobs[0].rows;
        if (ac.job[0].resid) ac.job[0].resid += (size_t)c0 * jobs[0].rows;
        switch (nc) {
            case 8: if (!launch_x4<8>(ac)) launch_mv<8>(ac, (unsigned)b); break;
            case 4: if (!launch_x4<4>(ac)) launch_mv<4>(ac, (unsigned)b); break;
            case 2: if (!launch_x4<2>(ac)) launch_mv<2>(ac, (unsigned)b); break;
            default: {
                // The next matvec's int8 input (q_out: gate|up + SwiGLU's, for down) by a
                // quantization launch of its own after this one. (By 32-row group tickets
                // inside it, whose fences, atomics and reloads stall the launch's tail more
                // than a launch boundary costs under PDL, it measured slower: H200 tg128,
                // side by side, the 0.5B's plain gate|up 1,482.6 / 1,396.5 / 1,481.3 against
                // 1,526.8 / 1,524.9 / 1,523.3; the 7B's staged one 449.0 / 445.6 / 438.6
                // against 467.8 / 470.1 / 464.8, 19d24bb and 770337a.)
                const MvJob j0 = ac.job[0];
                const bool qsplit = j0.q_out != nullptr;
                if (qsplit) ac.job[0].q_out = nullptr;
                if (!launch_bulk(ac) && !launch_x4(ac) && !launch_mv_typed(ac, (unsigned)b))
                    launch_mv1<-1>(ac, (unsigned)b);
                if (qsplit) {
                    const int n = j0.rows / 32;
                    launch(k_quant_q8, (unsigned)((n * 32 + 255) / 256), 256, (const float*)j0.y, n, j0.rows, j0.q_out,
                           j0.ds_out);
                }
                break;
            }
        }
        c0 += nc;
    }
}

int& x4_cols_min_units() { return g_x4_cols_units; }

void rope_table(float2* table, int64_t rows, int n_rot, const RopeCfg& cfg) {
    const int64_t n = rows * (n_rot / 2);
    k_rope_table<<<blocks_for(n, 256), 256, 0, lane().stream>>>(table, rows, n_rot, cfg);
    note_launch();
}

bool mv_blocks_one_wave(int64_t rows) {
    return (rows + MV_WARPS - 1) / MV_WARPS <= (int64_t)ctx().n_sm * mv_min_blocks<1, T_Q4_K>();
}

void rms_norm_copy(const float* x, const float* w, float* y, int64_t d, int64_t nt, float eps, void* scratch,
                   bool early) {
    if (d % 32 || d > kNormCopyMaxRow || nt < 1) throw std::invalid_argument("rms_norm_copy: d % 32 == 0, d <= 4096");
    // early: the norm lets the launch after it start at its own start (the executor sets
    // it when that launch is a q|k|v matvec of one wave: the 0.5B's 288 blocks, not the
    // 7B's 1,152 at 7 blocks an SM), whose blocks then load their rows and RoPE angles
    // while the down projection before finishes; else once the norm's wait is over
    // (early_next in executor.cpp). Measured (H200 tg128, side
    // by side): after the wait for every launch, 0.5B 1,436 / 1,516 / 1,600 and 7B 464 /
    // 460 / 457 against 1,604 / 1,568 / 1,625 and 473 / 472 / 465 at the start of any
    // q|k|v launch; at the start of every launch, 0.5B 1,543 / 1,541 / 1,475; with the
    // chunk-ordered activations (e47f1fc) the 7B's q|k|v (a wave and a quarter) after the
    // wait, 547.3 / 546.8 / 548.8 / 547.3 / 547.2 against 537.9 / 544.4 / 545.4 / 545.3 /
    // 544.7 at its start.
    launch(k_rms_norm_copy, (unsigned)nt, rms_threads(d), x, w, y, (int)d, eps, (int8_t*)scratch,
           (float2*)((uint8_t*)scratch + nt * d), norm_copy_scale(scratch, d, nt), early ? 1 : 0);
}


// ---- expert matvec (MATMUL_ID of decode-sized blocks: kernels.h matvec_id) -------------
// Row r of slot p = t * k + j is row ids[p] * out + r of the expert tensor against x row t
// (or p). The expert is read on the device after the wait (MOE_TOPK wrote it), so one
// launch serves every slot and a captured graph every step. A group of G lanes (8, 16 or
// 32: the fewest that cover the row's units, so short rows such as a 768-wide down
// projection do not leave most of a warp idle) takes a row: lane l of it takes units l,
// l + G, ... two per trip as row_dot does, and the group reduces by a butterfly. With G =
// 32 that is row_dot and warp_sum, so such a row's bits are k_matvec's. Each slot reads
// its expert's rows for itself (slots of one expert read them again, from L2 when close).

namespace {

struct MvIdArgs {
    MvArgs a;  // the activations: column c is x row c (x, xq, xds, xscale); in_dim, nb
    MvIdJob j;
    int lanes;     // G
    int64_t rows;  // nt * k * out
};

template <int T>
__device__ __forceinline__ float id_row_dot(const uint8_t* __restrict__ row, const MvArgs& a, int col, int gl, int G) {
    const int nu = Unit<T>::count(a.nb);
    float acc = 0.0f;
    int u = gl;
    for (; u + G < nu; u += 2 * G) {
        Unit<T> w0, w1;
        w0.load(row, u, a.nb);
        w1.load(row, u + G, a.nb);
        acc = fadd(acc, w0.dot(a, col, u));
        acc = fadd(acc, w1.dot(a, col, u + G));
    }
    if (u < nu) {
        Unit<T> w0;
        w0.load(row, u, a.nb);
        acc = fadd(acc, w0.dot(a, col, u));
    }
    return acc;
}

// W2: gate|up + SwiGLU, y = silu(gate row) * (up row), the epilogue mv_store applies.
// A slot whose id is outside [0, n_expert) gets a zero row, as on the CPU. QO: blocks of
// 32 rows (32 * G threads) that also write those rows' int8 copy (j.q_out).
template <int T, bool W2, bool QO>
__global__ void __launch_bounds__(QO ? 1024 : MV_WARPS * 32) k_matvec_id(MvIdArgs p) {
    pdl_trigger();
    const MvIdJob& j = p.j;
    const int lane = threadIdx.x & 31, G = p.lanes, gl = lane & (G - 1);
    const int64_t gr = ((int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * (32 / G) + lane / G;
    pdl_wait();
    float acc = 0.0f, acc2 = 0.0f;
    bool ok = false;
    int xr = 0;
    if (gr < p.rows) {
        const int64_t slot = gr / j.out, r = gr - slot * j.out;
        const int32_t e = j.ids[slot];
        xr = (int)(j.x_rows == j.nt ? slot / j.k : slot);
        ok = e >= 0 && e < j.n_expert;
        if (ok) {
            const size_t off = ((size_t)e * j.out + r) * j.row_bytes;
            acc = id_row_dot<T>(j.W + off, p.a, xr, gl, G);
            if constexpr (W2) acc2 = id_row_dot<T>(j.W2 + off, p.a, xr, gl, G);
        }
    }
    for (int o = G / 2; o > 0; o >>= 1) {  // every lane takes part: no lane left before
        acc = fadd(acc, __shfl_xor_sync(0xffffffffu, acc, o));
        if constexpr (W2) acc2 = fadd(acc2, __shfl_xor_sync(0xffffffffu, acc2, o));
    }
    float v = 0.0f;
    if (gl == 0 && gr < p.rows) {
        if (ok) {
            if (p.a.xscale && quantized(T)) {  // a norm's deferred copy: its row's scale
                const float rs = __ldg(p.a.xscale + xr);
                acc = fmul(acc, rs);
                if constexpr (W2) acc2 = fmul(acc2, rs);
            }
            v = acc;
            if constexpr (W2) v = silu_f(acc) * acc2;
        }
        j.y[gr] = v;
    }
    if constexpr (QO) {  // the block's 32 rows (of one slot: out % 32 == 0), quantized by warp 0
        __shared__ float rows[32];
        if (gl == 0) rows[threadIdx.x / G] = v;
        __syncthreads();
        if (threadIdx.x >= 32) return;
        const int64_t r0 = (int64_t)blockIdx.x * 32, slot = r0 / j.out, e0 = r0 - slot * j.out;
        quant_block_q8(rows[lane], lane, j.q_out + slot * j.out, (int)e0, j.out, j.ds_out + r0 / 32);
    }
}

// kernels.h matvec_id_sum: block b is output row r = b % out of token t = b / out; group
// g of G lanes takes slot t * k + g (k * G lanes, rounded up to whole warps), as
// k_matvec_id's rows; thread 0 then adds the slots' rows as k_moe_sum does.
struct MvIdSumArgs {
    MvIdArgs p;
    const float* w;
    const float* resid;
    float* y;
};

template <int T>
__global__ void k_matvec_id_sum(MvIdSumArgs s) {
    pdl_trigger();
    const MvIdArgs& p = s.p;
    const MvIdJob& j = p.j;
    __shared__ float rows[32];  // k <= 32: a block holds k * G <= 1024 lanes
    const int G = p.lanes, g = threadIdx.x / G, gl = threadIdx.x & (G - 1);
    const int64_t t = blockIdx.x / j.out, r = blockIdx.x - t * j.out;
    pdl_wait();
    float acc = 0.0f;
    bool ok = false;
    int xr = 0;
    const int64_t slot = t * j.k + g;
    if (g < j.k) {
        const int32_t e = j.ids[slot];
        xr = (int)(j.x_rows == j.nt ? t : slot);
        ok = e >= 0 && e < j.n_expert;
        if (ok) acc = id_row_dot<T>(j.W + ((size_t)e * j.out + r) * j.row_bytes, p.a, xr, gl, G);
    }
    for (int o = G / 2; o > 0; o >>= 1) acc = fadd(acc, __shfl_xor_sync(0xffffffffu, acc, o));
    if (g < j.k && gl == 0) {
        float v = 0.0f;
        if (ok) {
            if (p.a.xscale && quantized(T)) acc = fmul(acc, __ldg(p.a.xscale + xr));
            v = acc;
        }
        j.y[slot * j.out + r] = v;
        rows[g] = v;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    const float* wt = s.w + t * j.k;
    float sum = __fmul_rn(wt[0], rows[0]);
    for (int q = 1; q < j.k; ++q) sum = __fadd_rn(sum, __fmul_rn(wt[q], rows[q]));
    const int64_t i = t * j.out + r;
    if (s.resid) sum = __fadd_rn(s.resid[i], sum);  // resid may be y: read before the write
    s.y[i] = sum;
}

// The decode router (kernels.h matvec_route): token t's logit e is row e against x row t,
// one row a warp as k_matvec_id's 32-lane rows (so the plain matvec's bits); then the
// block that draws the last ticket routes every token (route.cuh: one token by the whole
// block, several a warp each) from the logits the others wrote, and puts the ticket back
// to zero.
struct MvRouteArgs {
    MvArgs a;
    const uint8_t* W;
    size_t row_bytes;
    float* logits;  // written here; r reads them back
    int* ticket;
    RouteArgs r;    // n_expert, nt and the route
};

template <int T, int NPL>
__global__ void __launch_bounds__(MV_WARPS * 32) k_matvec_route(MvRouteArgs p) {
    pdl_trigger();
    const int lane = threadIdx.x & 31;
    const int64_t gr = (int64_t)blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    const int n_expert = p.r.n_expert, nt = p.r.nt;
    pdl_wait();
    if (gr < (int64_t)nt * n_expert) {
        const int64_t t = gr / n_expert, e = gr - t * n_expert;
        float acc = id_row_dot<T>(p.W + e * p.row_bytes, p.a, (int)t, lane, 32);
        for (int o = 16; o > 0; o >>= 1) acc = fadd(acc, __shfl_xor_sync(0xffffffffu, acc, o));
        if (lane == 0) {
            if (p.a.xscale && quantized(T)) acc = fmul(acc, __ldg(p.a.xscale + t));
            p.logits[gr] = acc;
        }
    }
    __shared__ bool s_last;
    __threadfence();  // this block's logits before its ticket
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(p.ticket, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();  // every block's logits (read through L2) after the last ticket
    if (threadIdx.x == 0) *p.ticket = 0;
    if (nt == 1) {  // the decode step: the block's warps rank the experts together
        route_token_block<NPL>(p.r, 0);
        return;
    }
    for (int64_t t = threadIdx.x >> 5; t < nt; t += MV_WARPS) route_token<NPL>(p.r, t, lane);
}

}  // namespace

// Lanes that take one row of an expert matvec: the fewest of 8, 16 or 32 that cover its
// units (k_matvec_id).
static int id_lanes(int type, int64_t in_dim) {
    const int nu = row_units(type, (int)(in_dim / 32));
    return nu <= 8 ? 8 : nu <= 16 ? 16 : 32;
}

// The activations of an expert or router matvec (x_rows rows of in_dim): the int8 copy in
// scratch, made here by a quantization launch unless the launch before made it
// (xq_ready), or a norm's deferred copy (in_norm).
static MvArgs rows_activations(const char* who, int type, int64_t in_dim, int64_t x_rows, const float* x, void* scratch,
                               bool xq_ready, bool in_norm) {
    const bool quant = quantized(type);
    if (quant && !scratch) throw std::invalid_argument(std::string(who) + ": quantized weights need the activation scratch");
    if (in_norm && (!xq_ready || in_dim > kNormCopyMaxRow))
        throw std::invalid_argument(std::string(who) + ": a norm's deferred copy is made before, rows of <= 4096");
    MvArgs a{};
    a.x = x;
    a.in_dim = (int)in_dim;
    a.nb = (int)(in_dim / 32);
    a.xq = (const int8_t*)scratch;
    a.xds = scratch ? (const float2*)((uint8_t*)scratch + (size_t)x_rows * in_dim) : nullptr;
    a.xscale = in_norm ? norm_copy_scale(scratch, in_dim, x_rows) : nullptr;
    if (quant && !xq_ready) {
        const int n = a.nb * (int)x_rows;
        launch(k_quant_q8, (unsigned)((n * 32 + 255) / 256), 256, x, n, (int)in_dim, (int8_t*)a.xq, (float2*)a.xds);
    }
    return a;
}

void matvec_route(const MvRouteJob& j, int64_t in_dim, const float* x, void* scratch, bool xq_ready, bool in_norm) {
    if (in_dim % 32 || j.nt < 1 || j.nt > kRowExactMaxTokens || j.k < 1 || j.k > j.n_expert || j.k > kRouteMaxK ||
        !route_fusable(j.type, j.n_expert) || !j.ticket || (j.w && (j.gating < 1 || j.gating > 3)))
        throw std::invalid_argument("matvec_route: rows of a multiple of 32, 1 <= nt <= 64, 1 <= k <= n_expert, k <= 32, "
                                    "router weights F32, F16 or Q8_0 of at most 256 experts, a ticket, gating 1..3");
    MvRouteArgs p{};
    p.a = rows_activations("matvec_route", j.type, in_dim, j.nt, x, scratch, xq_ready, in_norm);
    p.W = j.W;
    p.row_bytes = j.row_bytes;
    p.logits = j.logits;
    p.ticket = j.ticket;
    p.r = RouteArgs{j.logits, j.ids, j.w, j.n_expert, j.k, j.nt, j.gating, j.norm, j.scale};
    const unsigned blocks = (unsigned)(((int64_t)j.nt * j.n_expert + MV_WARPS - 1) / MV_WARPS);
    auto go = [&]<int T>() {
        dispatch_route(j.n_expert, [&]<int NPL>() {
            if constexpr (NPL <= 8) launch(k_matvec_route<T, NPL>, blocks, MV_WARPS * 32, p);
        });
    };
    if (j.type == T_F32) go.template operator()<T_F32>();
    else if (j.type == T_F16) go.template operator()<T_F16>();
    else go.template operator()<T_Q8_0>();
}

void matvec_id_sum(const MvIdJob& j, int64_t in_dim, const float* x, void* scratch, bool xq_ready, bool in_norm,
                   const float* w, const float* resid, float* y_sum) {
    if (in_dim % 32 || j.out < 1 || j.k < 1 || j.k > 32 || j.nt < 1 || j.n_expert < j.k || j.W2 ||
        (j.x_rows != j.nt && j.x_rows != (int64_t)j.nt * j.k))
        throw std::invalid_argument("matvec_id_sum: rows of a multiple of 32, 1 <= k <= min(n_expert, 32), no W2, "
                                    "x_rows nt or nt * k");
    MvIdSumArgs s{};
    s.p.a = rows_activations("matvec_id_sum", j.type, in_dim, j.x_rows, x, scratch, xq_ready, in_norm);
    s.p.j = j;
    s.p.lanes = id_lanes(j.type, in_dim);
    s.w = w;
    s.resid = resid;
    s.y = y_sum;
    const unsigned threads = (unsigned)((j.k * s.p.lanes + 31) / 32 * 32);
    const unsigned blocks = (unsigned)((int64_t)j.nt * j.out);
    const bool ok = dispatch_type(j.type, [&]<int T>() { launch(k_matvec_id_sum<T>, blocks, threads, s); });
    if (!ok) throw std::invalid_argument("matvec_id_sum: weight type " + std::to_string(j.type) + " has no CUDA kernel");
}

void matvec_id(const MvIdJob& j, int64_t in_dim, const float* x, void* scratch, bool xq_ready, bool in_norm) {
    if (in_dim % 32 || j.out < 1 || j.k < 1 || j.nt < 1 || j.n_expert < j.k ||
        (j.x_rows != j.nt && j.x_rows != (int64_t)j.nt * j.k))
        throw std::invalid_argument("matvec_id: rows of a multiple of 32, 1 <= k <= n_expert, x_rows nt or nt * k");
    MvIdArgs p{};
    p.a = rows_activations("matvec_id", j.type, in_dim, j.x_rows, x, scratch, xq_ready, in_norm);
    p.j = j;
    p.lanes = id_lanes(j.type, in_dim);
    p.rows = (int64_t)j.nt * j.k * j.out;
    if (j.q_out && (!j.W2 || j.out % 32))
        throw std::invalid_argument("matvec_id: an int8 copy of the output needs gate|up rows of a multiple of 32");
    const int64_t per_block = (int64_t)MV_WARPS * (32 / p.lanes);
    const unsigned blocks = (unsigned)((p.rows + per_block - 1) / per_block);
    const bool ok = dispatch_type(j.type, [&]<int T>() {
        if (j.q_out) launch(k_matvec_id<T, true, true>, (unsigned)(p.rows / 32), 32 * p.lanes, p);
        else if (j.W2) launch(k_matvec_id<T, true, false>, blocks, MV_WARPS * 32, p);
        else launch(k_matvec_id<T, false, false>, blocks, MV_WARPS * 32, p);
    });
    if (!ok) throw std::invalid_argument("matvec_id: weight type " + std::to_string(j.type) + " has no CUDA kernel");
}

}  // namespace minfer::cuda
