// Attention for blocks of more than kRowExactMaxTokens tokens (prefill) on the tensor
// cores: flash attention with f16 Q, K, V and P, f32 accumulation and softmax.
//
// A block takes 64 query rows of one head (a warp 16 of them) and walks the KV cells
// the rows can see in tiles of 64, each tile staged once in shared memory for the four
// warps: S = Q K^T and O += P V are mma.sync m16n8k16 products, the running max and sum
// are per row (the four lanes that hold a row combine theirs with butterflies). The
// one-warp-per-(token, head) kernel in k_attn.cu re-reads every K/V row for every
// query row from L2 with scalar FMAs, which cost 13 ms of a 7B pp512 step; this one
// reads each tile once per block. Rounding Q and P to f16 makes rows differ from the
// decode kernel's in the last bits (blocks this large never took the row-exact path).
// Fixed work split, fixed reduction order: the same inputs give the same bits.
#include <cuda_fp16.h>

#include <climits>
#include <cmath>

#include "common/attn_span.h"
#include "cuda/context.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace minfer::cuda {

namespace {

constexpr int PF_WARPS = 4;
constexpr int PF_ROWS = 16 * PF_WARPS;  // query rows per block
constexpr int PF_TILE = 64;             // KV cells per tile

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_raw(__half lo, __half hi) {
    return (uint32_t)__half_as_ushort(lo) | ((uint32_t)__half_as_ushort(hi) << 16);
}

// c += a b for a 16x16 (row-major) and b 16x8 (column-major) f16 tile, f32 accumulators.
// Fragments (lane = 4 g + t): a {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)},
// b {(k 2t..2t+1, n g), (k 2t+8.., n g)}, c {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The cells query row t may see (common/attn_span.h: segment 0 a shared prefix, then
// segment 1 its own), checked as k_attn checks them (empty segments and the error word
// for a bad position or span), narrowed to the last `window` cells on a sliding-window
// layer.
__device__ __forceinline__ void row_range(const AttnDev& a, int64_t t, int lo[2], int hi[2], int* err) {
    int64_t l[2] = {0, 0}, h[2] = {0, 0};
    if (t < a.nt) {
        if (a.span) {
            const int32_t* sp = a.span + kSpanInts * t;
            if (span_ok(sp, a.n_ctx)) {
                l[1] = sp[0];
                h[1] = sp[1];
                l[0] = sp[2];
                h[0] = sp[3];
            } else {
                *err = 4;
            }
        } else {
            const int64_t p = a.pos[t];
            if (p >= 0 && p < a.n_ctx)
                h[1] = p + 1;
            else
                *err = 4;
        }
        attn_window(l, h, a.window);
    }
    for (int s = 0; s < 2; ++s) {
        lo[s] = (int)l[s];
        hi[s] = (int)h[s];
    }
}

// CAP: the scores are soft-capped (a.softcap > 0), in a kernel of its own.
template <int HD, bool CAP>
__global__ void __launch_bounds__(PF_WARPS * 32) k_attn_prefill(AttnDev a, int* err) {
    pdl_wait();
    pdl_trigger();
    constexpr int RS = HD + 8;  // smem row stride in halves: conflict-free fragment loads
    __shared__ __align__(16) __half Ks[PF_TILE * RS];
    __shared__ __align__(16) __half Vs[PF_TILE * RS];
    __shared__ int s_lo[2][PF_ROWS], s_hi[2][PF_ROWS];
    __shared__ int s_blo[2], s_bhi[2];
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tq = lane & 3;
    const int64_t t0 = (int64_t)blockIdx.x * PF_ROWS;
    const int h = blockIdx.y;
    const int64_t kvh = h / (a.nh / a.nkv);
    const int64_t kvs = a.nkv * HD;

    if (threadIdx.x < 2) {
        s_blo[threadIdx.x] = INT_MAX;
        s_bhi[threadIdx.x] = 0;
    }
    __syncthreads();
    if (threadIdx.x < PF_ROWS) {
        int lo[2], hi[2];
        row_range(a, t0 + threadIdx.x, lo, hi, err);
        for (int sg = 0; sg < 2; ++sg) {
            if (hi[sg] <= lo[sg]) lo[sg] = INT_MAX, hi[sg] = 0;
            s_lo[sg][threadIdx.x] = lo[sg];
            s_hi[sg][threadIdx.x] = hi[sg];
            if (hi[sg] > 0) {
                atomicMin(&s_blo[sg], lo[sg]);
                atomicMax(&s_bhi[sg], hi[sg]);
            }
        }
    }
    __syncthreads();
    const int ra = 16 * w + g, rb = ra + 8;  // this lane's two rows within the block

    // Q rows as A fragments, one per 16 head dims.
    uint32_t qa[HD / 16][4];
    {
        const bool va = t0 + ra < a.nt, vb = t0 + rb < a.nt;
        const float* qra = a.q + (t0 + ra) * a.q_stride + h * HD;
        const float* qrb = a.q + (t0 + rb) * a.q_stride + h * HD;
#pragma unroll
        for (int k = 0; k < HD / 16; ++k) {
            const int c = 16 * k + 2 * tq;
            const float2 z = make_float2(0.0f, 0.0f);
            const float2 a0 = va ? *reinterpret_cast<const float2*>(qra + c) : z;
            const float2 a2 = va ? *reinterpret_cast<const float2*>(qra + c + 8) : z;
            const float2 b0 = vb ? *reinterpret_cast<const float2*>(qrb + c) : z;
            const float2 b2 = vb ? *reinterpret_cast<const float2*>(qrb + c + 8) : z;
            qa[k][0] = pack_half2(a0.x, a0.y);
            qa[k][1] = pack_half2(b0.x, b0.y);
            qa[k][2] = pack_half2(a2.x, a2.y);
            qa[k][3] = pack_half2(b2.x, b2.y);
        }
    }

    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

    const __half* Kg = reinterpret_cast<const __half*>(a.k) + kvh * HD;
    const __half* Vg = reinterpret_cast<const __half*>(a.v) + kvh * HD;
    // The shared prefixes' cells, then the rows' own: one online softmax over both.
    for (int sg = 0; sg < 2; ++sg) {
    const int blo = s_blo[sg], bhi = s_bhi[sg];
    const int lo_a = s_lo[sg][ra], hi_a = s_hi[sg][ra], lo_b = s_lo[sg][rb], hi_b = s_hi[sg][rb];
    int wlo = min(lo_a, lo_b), whi = max(hi_a, hi_b);
    for (int x = 16; x > 0; x >>= 1) {
        wlo = min(wlo, __shfl_xor_sync(0xffffffffu, wlo, x));
        whi = max(whi, __shfl_xor_sync(0xffffffffu, whi, x));
    }
    const int c_first = blo < bhi ? blo / PF_TILE * PF_TILE : 0;
    const int c_last = blo < bhi ? bhi : 0;
    for (int c0 = c_first; c0 < c_last; c0 += PF_TILE) {
        __syncthreads();  // the previous tile's readers are done
        // Cells outside [blo, bhi) may never have been written: zeros, so a masked
        // cell's P = 0 never meets a NaN.
        for (int i = threadIdx.x; i < PF_TILE * HD / 8; i += PF_WARPS * 32) {
            const int r = i / (HD / 8), cc = i % (HD / 8) * 8;
            const int64_t cell = c0 + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
            if (cell >= blo && cell < bhi) {
                kv = *reinterpret_cast<const uint4*>(Kg + cell * kvs + cc);
                vv = *reinterpret_cast<const uint4*>(Vg + cell * kvs + cc);
            }
            *reinterpret_cast<uint4*>(Ks + r * RS + cc) = kv;
            *reinterpret_cast<uint4*>(Vs + r * RS + cc) = vv;
        }
        __syncthreads();
        if (c0 >= whi || c0 + PF_TILE <= wlo) continue;

        float s[PF_TILE / 8][4];
#pragma unroll
        for (int n = 0; n < PF_TILE / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            const __half* kr = Ks + (8 * n + g) * RS + 2 * tq;
#pragma unroll
            for (int k = 0; k < HD / 16; ++k)
                mma16816(s[n], qa[k], *reinterpret_cast<const uint32_t*>(kr + 16 * k),
                         *reinterpret_cast<const uint32_t*>(kr + 16 * k + 8));
        }
        float mx_a = -INFINITY, mx_b = -INFINITY;
        // Soft-capped as the CPU does it: cap * tanh(s * (1 / cap)).
        auto score = [&](float v) {
            if constexpr (CAP) return __fmul_rn(a.softcap, tanhf(__fmul_rn(v * a.scale, __frcp_rn(a.softcap))));
            return v * a.scale;
        };
#pragma unroll
        for (int n = 0; n < PF_TILE / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = c0 + 8 * n + 2 * tq + e;
                s[n][e] = c >= lo_a && c < hi_a ? score(s[n][e]) : -INFINITY;
                s[n][2 + e] = c >= lo_b && c < hi_b ? score(s[n][2 + e]) : -INFINITY;
                mx_a = fmaxf(mx_a, s[n][e]);
                mx_b = fmaxf(mx_b, s[n][2 + e]);
            }
        }
#pragma unroll
        for (int x = 1; x < 4; x <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, x));
        }
        const float nm_a = fmaxf(m_a, mx_a), nm_b = fmaxf(m_b, mx_b);
        // A row with no cell so far keeps max -inf: subtract 0 then, so exp gives 0, not NaN.
        const float base_a = nm_a == -INFINITY ? 0.0f : nm_a, base_b = nm_b == -INFINITY ? 0.0f : nm_b;
        const float corr_a = expf(m_a - base_a), corr_b = expf(m_b - base_b);
        m_a = nm_a;
        m_b = nm_b;
        float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
        for (int n = 0; n < PF_TILE / 8; ++n) {
            s[n][0] = expf(s[n][0] - base_a);
            s[n][1] = expf(s[n][1] - base_a);
            s[n][2] = expf(s[n][2] - base_b);
            s[n][3] = expf(s[n][3] - base_b);
            sum_a += s[n][0] + s[n][1];
            sum_b += s[n][2] + s[n][3];
        }
        l_a = l_a * corr_a + sum_a;
        l_b = l_b * corr_b + sum_b;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            o[n][0] *= corr_a;
            o[n][1] *= corr_a;
            o[n][2] *= corr_b;
            o[n][3] *= corr_b;
        }
        // The S accumulators of cells 16k..16k+15 are exactly P's A fragment layout.
#pragma unroll
        for (int k = 0; k < PF_TILE / 16; ++k) {
            const uint32_t pa[4] = {pack_half2(s[2 * k][0], s[2 * k][1]), pack_half2(s[2 * k][2], s[2 * k][3]),
                                    pack_half2(s[2 * k + 1][0], s[2 * k + 1][1]),
                                    pack_half2(s[2 * k + 1][2], s[2 * k + 1][3])};
            const __half* v0 = Vs + (16 * k + 2 * tq) * RS + g;
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                const __half* v = v0 + 8 * n;
                mma16816(o[n], pa, pack_raw(v[0], v[RS]), pack_raw(v[8 * RS], v[9 * RS]));
            }
        }
    }
    }

#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, x);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, x);
    }
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
    const int64_t ostride = a.nh * HD;
    if (t0 + ra < a.nt) {
        float* orow = a.out + (t0 + ra) * ostride + h * HD + 2 * tq;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
            *reinterpret_cast<float2*>(orow + 8 * n) = make_float2(o[n][0] * inv_a, o[n][1] * inv_a);
    }
    if (t0 + rb < a.nt) {
        float* orow = a.out + (t0 + rb) * ostride + h * HD + 2 * tq;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n)
            *reinterpret_cast<float2*>(orow + 8 * n) = make_float2(o[n][2] * inv_b, o[n][3] * inv_b);
    }
}

}  // namespace

bool attention_prefill(const AttnDev& a, int* err) {
    if (a.nt <= kRowExactMaxTokens || a.q_out || a.q_stride % 2) return false;
    const dim3 grid((unsigned)((a.nt + PF_ROWS - 1) / PF_ROWS), (unsigned)a.nh);
    const bool cap = a.softcap > 0.0f;
    switch (a.hd) {
        case 32: launch(cap ? k_attn_prefill<32, true> : k_attn_prefill<32, false>, grid, PF_WARPS * 32, a, err); return true;
        case 64: launch(cap ? k_attn_prefill<64, true> : k_attn_prefill<64, false>, grid, PF_WARPS * 32, a, err); return true;
        case 96: launch(cap ? k_attn_prefill<96, true> : k_attn_prefill<96, false>, grid, PF_WARPS * 32, a, err); return true;
        case 128: launch(cap ? k_attn_prefill<128, true> : k_attn_prefill<128, false>, grid, PF_WARPS * 32, a, err); return true;
        default: return false;  // 256: too many registers for this tiling; k_attn takes it
    }
}

}  // namespace minfer::cuda
