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

}  // namespace minfer::cuda::tl
