// Quantized matrix-vector products (decode), the f16 operands of the prefill GEMM, and
// embedding gathers from quantized tables. Weights stay in their GGUF blocks.
#include <algorithm>

#include "cuda/context.h"
#include "cuda/kernels.h"
#include "cuda/quant.cuh"
#include "cuda/silu.cuh"

namespace minfer::cuda {

namespace {

// Decode matvec. One group of tpr threads per output row; thread g of a group takes
// quarter chunks g, g+tpr, ... of the row (four consecutive lanes share a chunk, so a
// warp's weight and activation loads are contiguous), then the group reduces with a
// fixed butterfly (and, past a warp, a fixed-order sum over its warps). tpr depends on
// the row length only, so a row's bits do not depend on which launch computed it: the
// fused launches (several matrices, a SwiGLU pair) equal the separate ones bitwise.
template <int T>
__device__ __forceinline__ float dot8(const uint8_t* __restrict__ wr, const float* __restrict__ x, int u) {
    float v[8];
    int o0, o1;
    deq8<T>(wr, u, v, o0, o1);
    const float4 a = *reinterpret_cast<const float4*>(x + o0);
    const float4 b = *reinterpret_cast<const float4*>(x + o1);
    float s = v[0] * a.x;
    s = fmaf(v[1], a.y, s);
    s = fmaf(v[2], a.z, s);
    s = fmaf(v[3], a.w, s);
    s = fmaf(v[4], b.x, s);
    s = fmaf(v[5], b.y, s);
    s = fmaf(v[6], b.z, s);
    s = fmaf(v[7], b.w, s);
    return s;
}

// The main loop takes MV_BATCH quarter chunks per trip with no branch between them, so
// all their loads issue before the first use (several loads in flight per thread);
// sums are still added in ascending u, as the tail loop does.
constexpr int MV_BATCH = 4;

// F32/F16 weights meet the f32 activation; quantized weights its int8 copy.
template <int T>
__device__ __forceinline__ float dot_one(const uint8_t* __restrict__ wr, const MvArgs& a, int u) {
    if constexpr (T == T_F32 || T == T_F16) return dot8<T>(wr, a.x, u);
    else return dotq8<T>(wr, u, a.xq, a.xds);
}

template <int T>
__device__ __forceinline__ float dot_part(const uint8_t* __restrict__ wr, const MvArgs& a, int g) {
    const int tpr = a.tpr, n_sub = a.n_sub;
    float acc = 0.0f;
    int u = g;
    for (; u + (MV_BATCH - 1) * tpr < n_sub; u += MV_BATCH * tpr) {
        float s[MV_BATCH];
#pragma unroll
        for (int b = 0; b < MV_BATCH; ++b) s[b] = dot_one<T>(wr, a, u + b * tpr);
#pragma unroll
        for (int b = 0; b < MV_BATCH; ++b) acc += s[b];
    }
    for (; u < n_sub; u += tpr) acc += dot_one<T>(wr, a, u);
    return acc;
}

__device__ __forceinline__ float dot_any(int type, const uint8_t* __restrict__ wr, const MvArgs& a, int g) {
    switch (type) {
        case T_F32: return dot_part<T_F32>(wr, a, g);
        case T_F16: return dot_part<T_F16>(wr, a, g);
        case T_Q4_0: return dot_part<T_Q4_0>(wr, a, g);
        case T_Q4_1: return dot_part<T_Q4_1>(wr, a, g);
        case T_Q5_0: return dot_part<T_Q5_0>(wr, a, g);
        case T_Q5_1: return dot_part<T_Q5_1>(wr, a, g);
        case T_Q8_0: return dot_part<T_Q8_0>(wr, a, g);
        case T_Q4_K: return dot_part<T_Q4_K>(wr, a, g);
        case T_Q5_K: return dot_part<T_Q5_K>(wr, a, g);
        default: return dot_part<T_Q6_K>(wr, a, g);
    }
}

// The activation's int8 copy: one warp per block of 32, d = amax / 127 (0 for an
// all-zero block), q = rint(x / d); ds = (d, d * sum(q)).
__global__ void k_quant_q8(const float* __restrict__ x, int n_blocks, int8_t* __restrict__ q, float2* __restrict__ ds) {
    const int blk = (int)((blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32);
    const int lane = threadIdx.x % 32;
    if (blk >= n_blocks) return;
    const float v = x[blk * 32 + lane];
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f;
    const int qi = d > 0.0f ? __float2int_rn(v / d) : 0;
    int sum = qi;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    q[blk * 32 + lane] = (int8_t)qi;
    if (lane == 0) ds[blk] = make_float2(d, d * (float)sum);
}

__device__ __forceinline__ float group_sum(float acc, int tid, int g, int rloc, int tpr, float* red) {
    const int wl = tpr < 32 ? tpr : 32;
    for (int off = wl / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (tpr > 32) {
        const int warp = tid / 32, lane = tid % 32;
        __syncthreads();
        if (lane == 0) red[warp] = acc;
        __syncthreads();
        const int wpg = tpr / 32;
        float s = 0.0f;
        for (int i = 0; i < wpg; ++i) s += red[rloc * wpg + i];
        acc = s;
    }
    return acc;
}

__global__ void __launch_bounds__(256) k_matvec(MvArgs a) {
    __shared__ float red[2][8];
    int j = 0;
    while (j + 1 < a.njobs && (int)blockIdx.x >= a.block0[j + 1]) ++j;
    const MvJob& jb = a.job[j];
    const int tid = threadIdx.x;
    const int g = tid % a.tpr;
    const int rloc = tid / a.tpr;
    const int row = (blockIdx.x - a.block0[j]) * a.rpb + rloc;
    float acc = 0.0f, acc2 = 0.0f;
    if (row < jb.rows) {
        acc = dot_any(jb.type, jb.W + (size_t)row * jb.row_bytes, a, g);
        if (jb.W2) acc2 = dot_any(jb.type2, jb.W2 + (size_t)row * jb.row_bytes2, a, g);
    }
    acc = group_sum(acc, tid, g, rloc, a.tpr, red[0]);
    if (jb.W2) acc2 = group_sum(acc2, tid, g, rloc, a.tpr, red[1]);
    if (g == 0 && row < jb.rows) {
        float r = acc;
        if (jb.bias) r += jb.bias[row];
        if (jb.resid) r += jb.resid[row];
        if (jb.W2) {
            float u = acc2;
            if (jb.bias2) u += jb.bias2[row];
            r = silu_f(r) * u;
        }
        jb.y[row] = r;
    }
}

template <int T>
__global__ void k_dequant_f16(const uint8_t* __restrict__ W, size_t row_bytes, int n_chunks, int64_t total,
                              __half* __restrict__ out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int64_t row = i / n_chunks;
    const int c = (int)(i % n_chunks);
    float v[32];
    deq32<T>(W + (size_t)row * row_bytes, c, v);
    uint4* o = reinterpret_cast<uint4*>(out + row * (int64_t)n_chunks * 32 + c * 32);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        uint4 u;
        __half2* h = reinterpret_cast<__half2*>(&u);
#pragma unroll
        for (int j = 0; j < 4; ++j) h[j] = __floats2half2_rn(v[8 * k + 2 * j], v[8 * k + 2 * j + 1]);
        o[k] = u;
    }
}

template <int T>
__global__ void k_get_rows_q(const uint8_t* __restrict__ table, size_t row_bytes, int n_chunks,
                             const int32_t* __restrict__ ids, int64_t n_rows, float* __restrict__ y, int* err) {
    const int64_t t = blockIdx.x;
    const int32_t id = ids[t];
    float* yr = y + t * (int64_t)n_chunks * 32;
    const bool ok = id >= 0 && id < n_rows;
    if (!ok && threadIdx.x == 0) *err = 1;
    for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) {
        float v[32];
        if (ok) {
            deq32<T>(table + (size_t)id * row_bytes, c, v);
        } else {
#pragma unroll
            for (int j = 0; j < 32; ++j) v[j] = 0.0f;
        }
        float4* o = reinterpret_cast<float4*>(yr + c * 32);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
}

// F32/F16 tables whose rows are not a whole number of 32-element chunks.
__global__ void k_get_rows_plain(int32_t wtype, const uint8_t* __restrict__ table, size_t row_bytes, int64_t d,
                                 const int32_t* __restrict__ ids, int64_t n_rows, float* __restrict__ y, int* err) {
    const int64_t t = blockIdx.x;
    const int32_t id = ids[t];
    const bool ok = id >= 0 && id < n_rows;
    if (!ok && threadIdx.x == 0) *err = 1;
    const uint8_t* r = table + (size_t)(ok ? id : 0) * row_bytes;
    for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        float v = 0.0f;
        if (ok) v = wtype == T_F32 ? reinterpret_cast<const float*>(r)[i] : h2f(reinterpret_cast<const uint16_t*>(r)[i]);
        y[t * d + i] = v;
    }
}

__global__ void k_f32_to_f16(const float* __restrict__ x, __half* __restrict__ y, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half_rn(x[i]);
}

__global__ void k_add_bias_rows(float* __restrict__ y, const float* __restrict__ bias, int64_t nt, int64_t out_dim) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < nt * out_dim) y[i] += bias[i % out_dim];
}

inline unsigned blocks_for(int64_t n, int threads) { return (unsigned)((n + threads - 1) / threads); }

}  // namespace

bool matvec_type_supported(int32_t wtype) {
    switch (wtype) {
        case T_F32: case T_F16: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0:
        case T_Q4_K: case T_Q5_K: case T_Q6_K: return true;
        default: return false;
    }
}

int matvec_tpr(int64_t in_dim) {
    const int n_sub = (int)(in_dim / 8);
    int tpr = 32;
    while (tpr < 256 && n_sub > 8 * tpr) tpr *= 2;
    return tpr;
}

size_t matvec_scratch_bytes(int64_t in_dim) { return (size_t)in_dim + (size_t)(in_dim / 32) * sizeof(float2); }

void matvec_multi(const MvJob* jobs, int njobs, int64_t in_dim, const float* x, void* scratch) {
    if (njobs < 1 || njobs > MV_MAX_JOBS) throw std::invalid_argument("matvec_multi: 1..4 jobs");
    MvArgs a;
    a.x = x;
    a.xq = nullptr;
    a.xds = nullptr;
    bool quant = false;
    for (int i = 0; i < njobs; ++i)
        quant |= !(jobs[i].type == T_F32 || jobs[i].type == T_F16) || (jobs[i].W2 && !(jobs[i].type2 == T_F32 || jobs[i].type2 == T_F16));
    if (quant) {
        if (!scratch) throw std::invalid_argument("matvec_multi: quantized weights need the activation scratch");
        const int nb = (int)(in_dim / 32);
        a.xq = (const int8_t*)scratch;
        a.xds = (const float2*)((uint8_t*)scratch + in_dim);
        k_quant_q8<<<(unsigned)((nb * 32 + 255) / 256), 256, 0, ctx().stream>>>(x, nb, (int8_t*)a.xq, (float2*)a.xds);
        note_launch();
    }
    a.n_sub = (int)(in_dim / 8);
    a.tpr = matvec_tpr(in_dim);
    a.njobs = njobs;
    int64_t total = 0;
    for (int i = 0; i < njobs; ++i) total += jobs[i].rows;
    // Rows per block: enough blocks to cover the SMs twice.
    const int n_sm = ctx().n_sm;
    a.rpb = (int)std::max<int64_t>(1, std::min<int64_t>(256 / a.tpr, total / (2 * n_sm)));
    int b = 0;
    for (int i = 0; i < njobs; ++i) {
        a.job[i] = jobs[i];
        a.block0[i] = b;
        b += (jobs[i].rows + a.rpb - 1) / a.rpb;
    }
    k_matvec<<<(unsigned)b, a.tpr * a.rpb, 0, ctx().stream>>>(a);
    note_launch();
}

void matvec(int32_t wtype, const void* W, size_t row_bytes, int64_t in_dim, int64_t out_dim, const float* x,
            const float* bias, const float* resid, float* y, void* scratch) {
    MvJob j{};
    j.W = (const uint8_t*)W;
    j.row_bytes = row_bytes;
    j.type = wtype;
    j.rows = (int)out_dim;
    j.bias = bias;
    j.resid = resid;
    j.y = y;
    matvec_multi(&j, 1, in_dim, x, scratch);
}

void dequant_f16(int32_t wtype, const void* W, size_t row_bytes, int64_t in_dim, int64_t rows, void* out) {
    const int n_chunks = (int)(in_dim / 32);
    const int64_t total = rows * n_chunks;
    dispatch_type(wtype, [&] <int T>() {
        k_dequant_f16<T><<<blocks_for(total, 256), 256, 0, ctx().stream>>>((const uint8_t*)W, row_bytes, n_chunks,
                                                                            total, (__half*)out);
    });
    note_launch();
}

void f32_to_f16(const float* x, void* y, int64_t n) {
    k_f32_to_f16<<<blocks_for(n, 256), 256, 0, ctx().stream>>>(x, (__half*)y, n);
    note_launch();
}

void add_bias_rows(float* y, const float* bias, int64_t nt, int64_t out_dim) {
    k_add_bias_rows<<<blocks_for(nt * out_dim, 256), 256, 0, ctx().stream>>>(y, bias, nt, out_dim);
    note_launch();
}

void get_rows_w(int32_t wtype, const void* table, size_t row_bytes, int64_t d, const int32_t* ids, int64_t n,
                int64_t n_rows, float* y, int* err) {
    if ((wtype == T_F32 || wtype == T_F16) && d % 32 != 0) {
        k_get_rows_plain<<<(unsigned)n, 128, 0, ctx().stream>>>(wtype, (const uint8_t*)table, row_bytes, d, ids,
                                                                n_rows, y, err);
    } else {
        dispatch_type(wtype, [&] <int T>() {
            k_get_rows_q<T><<<(unsigned)n, 128, 0, ctx().stream>>>((const uint8_t*)table, row_bytes, (int)(d / 32),
                                                                   ids, n_rows, y, err);
        });
    }
    note_launch();
}

}  // namespace minfer::cuda
