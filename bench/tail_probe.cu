// Where a weight-streaming launch loses time at its ends: static vs dynamic work
// distribution for the 7B's decode matvec shapes, reads only (no arithmetic), each launch
// alone. For each case: the median event time of back-to-back launches, and, from one
// launch, when the blocks ended relative to the first block's start (global timer): the
// 10th / 50th / 90th / 99th percentile and the last. Static: one warp a row (the plain matvec's
// pattern). Dynamic: a grid of resident blocks whose warps take work items from a counter
// (whole rows, or a row's quarters with its four warps splitting it inside a block), so an
// SM that starts late or reads slowly takes fewer. Standalone:
//   nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/tail_probe bench/tail_probe.cu && /tmp/tail_probe
#include "probe_common.cuh"

__device__ __forceinline__ uint64_t gtime() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

// Lane l reads 16-byte chunks l, l + 32, ... of [p, p + n16 * 16), C in flight a trip.
template <int C>
__device__ __forceinline__ uint32_t read_span(const uint4* __restrict__ p, int n16, int lane) {
    uint32_t acc = 0;
    for (int t = lane; t < n16; t += 32 * C) {
        uint4 v[C];
#pragma unroll
        for (int k = 0; k < C; ++k) v[k] = t + 32 * k < n16 ? __ldg(p + t + 32 * k) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < C; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    return acc;
}

__device__ __forceinline__ void stamp(uint64_t* ends, uint64_t* starts, uint64_t t0) {
    if (threadIdx.x == 0 && ends) {
        starts[blockIdx.x] = t0;
        ends[blockIdx.x] = gtime();
    }
}

// One warp a row.
template <int C>
__global__ void __launch_bounds__(128) k_static(const uint8_t* __restrict__ W, int rows, int rb, uint64_t* ends,
                                                uint64_t* starts) {
    const uint64_t t0 = gtime();
    const int row = (blockIdx.x * 128 + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    uint32_t acc = 0;
    if (row < rows) acc = read_span<C>(reinterpret_cast<const uint4*>(W + (size_t)row * rb), rb / 16, lane);
    if (acc == 0x12345678u) g_sink = acc;
    __syncthreads();
    stamp(ends, starts, t0);
}

// Warps take whole rows from a counter (the next one requested while a row is read).
// The last warp to find the counter spent resets it for the next launch.
template <int C>
__global__ void __launch_bounds__(128) k_dyn_rows(const uint8_t* __restrict__ W, int rows, int rb, int* counter,
                                                  uint64_t* ends, uint64_t* starts) {
    const uint64_t t0 = gtime();
    const int lane = threadIdx.x & 31, n_warps = gridDim.x * 4;
    uint32_t acc = 0;
    int row = 0;
    if (lane == 0) row = atomicAdd(counter, 1);
    row = __shfl_sync(0xffffffffu, row, 0);
    while (row < rows) {
        int next = 0;
        if (lane == 0) next = atomicAdd(counter, 1);
        acc ^= read_span<C>(reinterpret_cast<const uint4*>(W + (size_t)row * rb), rb / 16, lane);
        row = __shfl_sync(0xffffffffu, next, 0);
    }
    // Every warp draws exactly one spent ticket at or past rows (its last); the one
    // drawing rows + n_warps - 1 is the last of all and resets the counter.
    if (lane == 0 && row == rows + n_warps - 1) *counter = 0;
    if (acc == 0x12345678u) g_sink = acc;
    __syncthreads();
    stamp(ends, starts, t0);
}

// Blocks take whole rows from a counter; the block's four warps read a quarter each.
template <int C>
__global__ void __launch_bounds__(128) k_dyn_quarters(const uint8_t* __restrict__ W, int rows, int rb, int* counter,
                                                      uint64_t* ends, uint64_t* starts) {
    const uint64_t t0 = gtime();
    __shared__ int s_row[2];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int n16 = rb / 16, q0 = n16 * w / 4, q1 = n16 * (w + 1) / 4;
    uint32_t acc = 0;
    if (threadIdx.x == 0) {
        s_row[0] = atomicAdd(counter, 1);
        s_row[1] = -1;
    }
    __syncthreads();
    for (int it = 0;; ++it) {
        const int row = s_row[it & 1];
        if (row >= rows) break;
        if (threadIdx.x == 0) s_row[(it + 1) & 1] = atomicAdd(counter, 1);
        acc ^= read_span<C>(reinterpret_cast<const uint4*>(W + (size_t)row * rb) + q0, q1 - q0, lane);
        __syncthreads();
    }
    // The block's one spent ticket is the larger slot (the other holds its last row, or -1).
    if (threadIdx.x == 0 && max(s_row[0], s_row[1]) == rows + (int)gridDim.x - 1) *counter = 0;
    if (acc == 0x12345678u) g_sink = acc;
    __syncthreads();
    stamp(ends, starts, t0);
}

// Block end times of one launch (after warm-up ones), relative to the first block start.
template <class F>
void ends_of(Pool& pool, size_t bytes, unsigned blocks, F launch, double q[5]) {
    uint64_t *e, *s;
    CK(cudaMalloc(&e, blocks * sizeof(uint64_t)));
    CK(cudaMalloc(&s, blocks * sizeof(uint64_t)));
    std::vector<double> med[5];
    for (int r = 0; r < 9; ++r) {
        launch(pool.next(bytes), e, s);
        CK(cudaDeviceSynchronize());
        std::vector<uint64_t> he(blocks), hs(blocks);
        CK(cudaMemcpy(he.data(), e, blocks * 8, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hs.data(), s, blocks * 8, cudaMemcpyDeviceToHost));
        const uint64_t t0 = *std::min_element(hs.begin(), hs.end());
        std::vector<double> d(blocks);
        for (unsigned i = 0; i < blocks; ++i) d[i] = (he[i] - t0) / 1000.0;
        std::sort(d.begin(), d.end());
        const double ps[5] = {0.1, 0.5, 0.9, 0.99, 1.0};
        for (int k = 0; k < 5; ++k) med[k].push_back(d[std::min<size_t>(blocks - 1, (size_t)(ps[k] * blocks))]);
    }
    for (int k = 0; k < 5; ++k) {
        std::sort(med[k].begin(), med[k].end());
        q[k] = med[k][med[k].size() / 2];
    }
    CK(cudaFree(e));
    CK(cudaFree(s));
}

int main() {
    int n_sm = 0;
    CK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
    Pool pool{nullptr, (size_t)3 << 30};
    CK(cudaMalloc(&pool.base, pool.size));
    CK(cudaMemset(pool.base, 1, pool.size));
    int* counter;
    CK(cudaMalloc(&counter, sizeof(int)));
    CK(cudaMemset(counter, 0, sizeof(int)));
    std::printf("SMs %d; block ends in us from the first block's start: p10 p50 p90 p99 last\n", n_sm);
    struct Shape {
        const char* name;
        int rows, rb;
    };
    const Shape shapes[] = {
        {"down Q4_K 3584 x 10656 B", 3584, 18944 / 256 * 144},
        {"down Q6_K 3584 x 15552 B", 3584, (18944 / 256 * 210 + 15) / 16 * 16},
        {"gate|up Q4_K 37888 x 2016 B", 37888, 3584 / 256 * 144},
        {"q|k|v Q4_K 4608 x 2016 B", 4608, 3584 / 256 * 144},
    };
    for (const Shape& sh : shapes) {
        const size_t bytes = (size_t)sh.rows * sh.rb;
        auto report = [&](const char* how, unsigned blocks, auto launch) {
            double q[5];
            const double us = time_us(pool, bytes, [&](uint8_t* p) { launch(p, nullptr, nullptr); });
            ends_of(pool, bytes, blocks, launch, q);
            std::printf("%-30s %-34s %6.1f MB %7.2f us %5.0f GB/s | ends %6.2f %6.2f %6.2f %6.2f %6.2f\n", sh.name, how,
                        bytes / 1e6, us, bytes / us / 1e3, q[0], q[1], q[2], q[3], q[4]);
        };
        const unsigned st_blocks = (unsigned)((sh.rows + 3) / 4);
        report("static warp/row C=6", st_blocks, [&](uint8_t* p, uint64_t* e, uint64_t* s) {
            k_static<6><<<st_blocks, 128>>>(p, sh.rows, sh.rb, e, s);
        });
        for (int per_sm : {7, 8}) {
            const unsigned blocks = (unsigned)(n_sm * per_sm);
            char how[64];
            std::snprintf(how, sizeof how, "dynamic warp/row C=6, %d/SM", per_sm);
            report(how, blocks, [&](uint8_t* p, uint64_t* e, uint64_t* s) {
                k_dyn_rows<6><<<blocks, 128>>>(p, sh.rows, sh.rb, counter, e, s);
            });
            std::snprintf(how, sizeof how, "dynamic block/row quarters, %d/SM", per_sm);
            report(how, blocks, [&](uint8_t* p, uint64_t* e, uint64_t* s) {
                k_dyn_quarters<6><<<blocks, 128>>>(p, sh.rows, sh.rb, counter, e, s);
            });
        }
    }
    CK(cudaFree(pool.base));
    return 0;
}
