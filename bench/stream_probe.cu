// Read-bandwidth ceilings of the decode matvec's access patterns on this GPU, without
// their arithmetic: how fast can bytes laid out like the 7B's gate|up, down and output
// weights reach the SMs through each load path? Standalone (no minfer), so one nvcc
// call builds it on the GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/stream_probe bench/stream_probe.cu && /tmp/stream_probe
// Each case streams a weight-sized region, rotating through a pool larger than L2 so no
// launch finds its bytes there, and prints the median of back-to-back launches.
#include "probe_common.cuh"

// Grid-stride 16-byte loads, U in flight per thread: the plain copy-read ceiling.
template <int U>
__global__ void __launch_bounds__(256) k_flat(const uint4* __restrict__ p, size_t n16) {
    uint32_t acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += stride * U) {
        uint4 v[U];
#pragma unroll
        for (int k = 0; k < U; ++k) v[k] = i + k * stride < n16 ? __ldg(p + i + k * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < U; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    if (acc == 0x12345678u) g_sink = acc;
}

// One warp per row (the plain matvec): lane l reads 16-byte chunks l, l + 32, ... of the
// row, C chunks in flight per lane per trip. S warps share a row (split-K): warp s of the
// row takes trips s, s + S, ...
template <int C, int S>
__global__ void __launch_bounds__(128) k_rows(const uint8_t* __restrict__ W, int rows, int row_bytes) {
    const int gw = (blockIdx.x * 128 + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    const int row = gw / S, s = gw % S;
    if (row >= rows) return;
    const uint4* r = reinterpret_cast<const uint4*>(W + (size_t)row * row_bytes);
    const int n16 = row_bytes / 16;
    uint32_t acc = 0;
    for (int t = s * 32 * C + lane; t < n16; t += S * 32 * C) {
        uint4 v[C];
#pragma unroll
        for (int k = 0; k < C; ++k) v[k] = t + 32 * k < n16 ? __ldg(r + t + 32 * k) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < C; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    if (acc == 0x12345678u) g_sink = acc;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// The staged matvec's pattern: each warp owns a contiguous run of rows of two matrices
// (gate, up: one bulk copy each per slot, or one copy of the interleaved pair when IL)
// and streams them through a ring of NS slots; the lanes read every staged byte once.
// RR: the warps take rows round-robin (warp w: rows w, w + n_warps, ...) instead of each
// a contiguous run, so the rows in flight at any time form one band.
template <int NS, bool IL, bool RR = false>
__global__ void __launch_bounds__(128) k_bulk(const uint8_t* __restrict__ W, const uint8_t* __restrict__ W2,
                                              int rows, int rb, int n_warps) {
    extern __shared__ __align__(16) uint8_t sm[];
    const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
    const int gw = blockIdx.x * 4 + wib;
    int r0 = (int)((int64_t)rows * gw / n_warps), r1 = (int)((int64_t)rows * (gw + 1) / n_warps);
    if (RR) r0 = 0, r1 = gw < rows ? (rows - gw + n_warps - 1) / n_warps : 0;  // slots, not rows
    auto row_of = [&](int st) { return RR ? st * n_warps + gw : r0 + st; };
    const uint32_t slot = (IL || W2 ? 2u : 1u) * rb;  // no W2: rows of one matrix
    uint64_t* bars = reinterpret_cast<uint64_t*>(sm) + wib * NS;
    uint8_t* ring = sm + 4 * NS * sizeof(uint64_t) + (size_t)wib * NS * slot;
    auto request = [&](int row, int k) {
        uint8_t* d = ring + (size_t)k * slot;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bars + k)), "r"(slot)
                     : "memory");
        if (IL) {
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem_u32(d)),
                "l"(W + (size_t)row * slot), "r"(slot), "r"(smem_u32(bars + k))
                : "memory");
        } else if (!W2) {
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem_u32(d)),
                "l"(W + (size_t)row * rb), "r"(rb), "r"(smem_u32(bars + k))
                : "memory");
        } else {
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem_u32(d)),
                "l"(W + (size_t)row * rb), "r"(rb), "r"(smem_u32(bars + k))
                : "memory");
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem_u32(d + rb)),
                "l"(W2 + (size_t)row * rb), "r"(rb), "r"(smem_u32(bars + k))
                : "memory");
        }
    };
    const int n = r1 - r0;
    if (lane == 0 && n > 0) {
        for (int k = 0; k < NS; ++k)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bars + k)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int k = 0; k < NS && k < n; ++k) request(row_of(k), k);
    }
    __syncwarp();
    uint32_t acc = 0;
    for (int st = 0; st < n; ++st) {
        const int k = st % NS;
        const uint32_t phase = (uint32_t)(st / NS) & 1u;
        uint32_t done = 0;
        while (!done)
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.b32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(smem_u32(bars + k)), "r"(phase)
                : "memory");
        const uint4* s = reinterpret_cast<const uint4*>(ring + (size_t)k * slot);
        for (int i = lane; i < (int)slot / 16; i += 32) {
            const uint4 v = s[i];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncwarp();
        if (lane == 0 && st + NS < n) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            request(row_of(st + NS), k);
        }
    }
    if (acc == 0x12345678u) g_sink = acc;
}

void report(const char* name, size_t bytes, double us) {
    std::printf("%-58s %8.1f MB %8.2f us %7.0f GB/s\n", name, bytes / 1e6, us, bytes / us / 1e3);
}

int main() {
    int n_sm = 0, smem_sm = 0;
    CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    Pool pool{nullptr, (size_t)3 << 30};
    CK(cudaMalloc(&pool.base, pool.size));
    CK(cudaMemset(pool.base, 1, pool.size));
    std::printf("SMs %d, smem per SM %d\n", n_sm, smem_sm);

    // The 7B shapes (Q4_K rows of 3584 and 18944 elements: 144 bytes per 256).
    const int rb_in = 3584 / 256 * 144, rows_ffn = 18944;       // gate, up rows: 2,016 bytes
    // Q6_K rows are padded to 16 bytes at upload (cuda/layout.h).
    const int rb_down4 = 18944 / 256 * 144, rb_down6 = (18944 / 256 * 210 + 15) / 16 * 16, rows_d = 3584;
    const int rb_out = (3584 / 256 * 210 + 15) / 16 * 16, rows_out = 152064;
    const size_t gu = (size_t)2 * rows_ffn * rb_in;
    const size_t out = (size_t)rows_out * rb_out;

    // The o projection's 7.2 MB (3,584 rows of 2,016 bytes) and about q|k|v's 9.7 MB.
    const size_t o_bytes = (size_t)3584 * rb_in, qkv_bytes = 9732096;
    for (size_t bytes : {o_bytes, qkv_bytes, gu, (size_t)rows_d * rb_down4, (size_t)rows_d * rb_down6, out,
                         (size_t)1 << 30}) {
        for (int bps : {4, 8}) {
            const unsigned blocks = (unsigned)(n_sm * bps);
            char name[96];
            std::snprintf(name, sizeof name, "flat U=8, %d blocks of 256 per SM", bps);
            report(name, bytes, time_us(pool, bytes, [&](uint8_t* p) {
                       k_flat<8><<<blocks, 256>>>((const uint4*)p, bytes / 16);
                   }));
        }
    }
    // The down projection, one warp (or S warps) a row.
    for (int rb : {rb_down4, rb_down6}) {
        const size_t bytes = (size_t)rows_d * rb;
        auto rows_case = [&](auto kern, int S, const char* what) {
            const unsigned blocks = (unsigned)((rows_d * S + 3) / 4);
            char name[96];
            std::snprintf(name, sizeof name, "down rows %d B: %s", rb, what);
            report(name, bytes, time_us(pool, bytes, [&](uint8_t* p) { kern<<<blocks, 128>>>(p, rows_d, rb); }));
        };
        rows_case(k_rows<3, 1>, 1, "warp/row, 3 chunks in flight");
        rows_case(k_rows<6, 1>, 1, "warp/row, 6 chunks in flight");
        rows_case(k_rows<12, 1>, 1, "warp/row, 12 chunks in flight");
        rows_case(k_rows<3, 2>, 2, "2 warps/row, 3 chunks");
        rows_case(k_rows<6, 2>, 2, "2 warps/row, 6 chunks");
        rows_case(k_rows<3, 4>, 4, "4 warps/row, 3 chunks");
        rows_case(k_rows<6, 4>, 4, "4 warps/row, 6 chunks");
    }
    // Staged (k_bulk): rows of rb bytes, of two matrices (pairs: W2 beside W, or
    // interleaved) or one, NS slots a warp, per_sm blocks of 4 warps an SM where the
    // shared memory lets them.
    auto staged = [&](auto kern, const char* what, int ns, int per_sm, bool pairs, int rows, int rb, int reps) {
        const size_t bytes = (size_t)(pairs ? 2 : 1) * rows * rb;
        const size_t smem = 4 * (ns * sizeof(uint64_t) + (size_t)ns * (pairs ? 2 : 1) * rb);
        if (smem * per_sm > (size_t)smem_sm) return;
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        int occ = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, 128, smem));
        const int bps = std::min(occ, per_sm);
        const unsigned blocks = (unsigned)(n_sm * bps);
        char name[96];
        std::snprintf(name, sizeof name, "%s NS=%d, %d blocks/SM", what, ns, bps);
        report(name, bytes, time_us(pool, bytes, [&](uint8_t* p) {
                   kern<<<blocks, 128, smem>>>(p, pairs ? p + bytes / 2 : nullptr, rows, rb, (int)blocks * 4);
               }, reps));
    };
    // gate|up: 2 KB rows of two matrices (or interleaved pairs).
    for (int per_sm : {4, 6}) {
        staged(k_bulk<2, false>, "gate|up staged two copies", 2, per_sm, true, rows_ffn, rb_in, 41);
        staged(k_bulk<2, true>, "gate|up staged interleaved", 2, per_sm, true, rows_ffn, rb_in, 41);
        staged(k_bulk<3, false>, "gate|up staged two copies", 3, per_sm, true, rows_ffn, rb_in, 41);
        std::printf("round-robin rows:\n");
        staged(k_bulk<2, false, true>, "gate|up staged two copies", 2, per_sm, true, rows_ffn, rb_in, 41);
        staged(k_bulk<3, false, true>, "gate|up staged two copies", 3, per_sm, true, rows_ffn, rb_in, 41);
        staged(k_bulk<2, true, true>, "gate|up staged interleaved", 2, per_sm, true, rows_ffn, rb_in, 41);
    }
    // The output matvec (Q6_K rows of 2,944 bytes, 447 MB): one matrix.
    for (bool rr : {false, true}) {
        if (rr) std::printf("round-robin rows:\n");
        for (int per_sm : {4, 6, 8}) {
            staged(rr ? k_bulk<2, false, true> : k_bulk<2, false>, "output staged", 2, per_sm, false, rows_out, rb_out, 15);
            staged(rr ? k_bulk<3, false, true> : k_bulk<3, false>, "output staged", 3, per_sm, false, rows_out, rb_out, 15);
            staged(rr ? k_bulk<4, false, true> : k_bulk<4, false>, "output staged", 4, per_sm, false, rows_out, rb_out, 15);
        }
    }
    {
        const unsigned blocks = (unsigned)((rows_out + 3) / 4);
        report("output rows 2944 B: warp/row, 6 chunks in flight", out, time_us(pool, out, [&](uint8_t* p) {
                   k_rows<6, 1><<<blocks, 128>>>(p, rows_out, rb_out);
               }, 15));
    }
    // gate|up as plain warps (one warp per row pair, all of a lane's chunks in flight).
    {
        const unsigned blocks = (unsigned)((2 * rows_ffn + 3) / 4);
        report("gate|up rows 2016 B: warp/row, 4 chunks in flight", gu, time_us(pool, gu, [&](uint8_t* p) {
                   k_rows<4, 1><<<blocks, 128>>>(p, 2 * rows_ffn, rb_in);
               }));
    }
    CK(cudaFree(pool.base));
    return 0;
}
