// Host side of the in-kernel timeline (timeline.h): one device buffer, bound into each
// instrumented translation unit's symbol on first use.
#include "cuda/timeline.h"

#include <cuda_runtime.h>

#include "cuda/context.h"

namespace minfer::cuda::tl {

void bind_attn(Buf* b);
void bind_mv(Buf* b);

#ifdef MINFER_CUDA_TIMELINE
bool built() { return true; }

static Buf* buffer() {
    static Buf* b = [] {
        ctx();
        Buf* p = nullptr;
        check(cudaMalloc(&p, sizeof(Buf)), "cudaMalloc timeline");
        check(cudaMemset(p, 0, sizeof(Buf)), "cudaMemset timeline");
        bind_attn(p);
        bind_mv(p);
        return p;
    }();
    return b;
}

std::vector<std::vector<unsigned long long>> read(bool reset) {
    Buf* d = buffer();
    check(cudaDeviceSynchronize(), "timeline sync");
    std::vector<unsigned> n(kKinds);
    check(cudaMemcpy(n.data(), d->n, sizeof(unsigned) * kKinds, cudaMemcpyDeviceToHost), "timeline counts");
    std::vector<std::vector<unsigned long long>> out(kKinds);
    std::vector<unsigned long long> ring((size_t)kRing * kWords);
    for (int k = 0; k < kKinds; ++k) {
        if (!n[k]) continue;
        check(cudaMemcpy(ring.data(), d->rec[k], sizeof(unsigned long long) * ring.size(), cudaMemcpyDeviceToHost),
              "timeline records");
        const unsigned cnt = n[k] < (unsigned)kRing ? n[k] : (unsigned)kRing;
        const unsigned first = n[k] < (unsigned)kRing ? 0 : n[k] % kRing;
        for (unsigned i = 0; i < cnt; ++i) {
            const unsigned long long* r = &ring[(size_t)((first + i) % kRing) * kWords];
            out[k].insert(out[k].end(), r, r + kWords);
        }
    }
    if (reset) check(cudaMemset(d->n, 0, sizeof(unsigned) * kKinds), "timeline reset");
    return out;
}
#else
bool built() { return false; }
std::vector<std::vector<unsigned long long>> read(bool) { return {}; }
#endif

namespace {
// Each close waits for its own epoch, so a hold left from a run that failed before its
// wait returns as soon as any later gate opens.
__global__ void k_hold(const volatile unsigned* opened, unsigned epoch, long long max_ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        if ((int)(*opened - epoch) >= 0) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
        __nanosleep(1000);
#endif
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < max_ns);
}
unsigned* g_opened_host = nullptr;
unsigned* g_opened_dev = nullptr;
unsigned g_epoch = 0;
}  // namespace

void gate_close() {
    Lane& c = lane();
    if (!g_opened_host) {
        check(cudaHostAlloc((void**)&g_opened_host, sizeof(unsigned), cudaHostAllocMapped), "cudaHostAlloc gate");
        *(volatile unsigned*)g_opened_host = 0;
        check(cudaHostGetDevicePointer((void**)&g_opened_dev, g_opened_host, 0), "cudaHostGetDevicePointer gate");
    }
    k_hold<<<1, 1, 0, c.stream>>>(g_opened_dev, ++g_epoch, kGateMaxNs);
    check(cudaGetLastError(), "gate kernel launch");
    note_launch();
}

void gate_open() {
    if (g_opened_host) *(volatile unsigned*)g_opened_host = g_epoch;
}

}  // namespace minfer::cuda::tl
