// Device side of timeline.h. A kernel opens with TL_BEGIN(kind) (in the timeline build:
// whether this thread records, and a register per mark), marks with TL_MARK(k) (k > 0, a
// constant) and ends with TL_END() on the path thread 0 of block (0, 0) takes. A mark
// after a load says nothing of its arrival; put marks after what consumes it.
#pragma once
#include "cuda/timeline.h"

#ifdef MINFER_CUDA_TIMELINE
namespace minfer::cuda::tl {
// One per translation unit (no relocatable device code); timeline.cu points each at the
// one buffer through bind_*.
static __device__ Buf* g_buf;
__device__ __forceinline__ unsigned long long clk() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
    return t;
}
__device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
    return t;
}
__device__ __forceinline__ void store(int kind, const unsigned long long* t, unsigned long long g0) {
    const unsigned long long g1 = gtimer();
    Buf* b = g_buf;
    if (!b) return;
    const unsigned s = atomicAdd(&b->n[kind], 1u) % kRing;
    unsigned long long* r = b->rec[kind][s];
    for (int k = 0; k < kMarks; ++k) r[k] = t[k];
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    r[kMarks] = g0;
    r[kMarks + 1] = g1;
    r[kMarks + 2] = (unsigned long long)gridDim.x * gridDim.y;
    r[kMarks + 3] = smid;
}
}  // namespace minfer::cuda::tl
#define TL_BIND(name) \
    void name(::minfer::cuda::tl::Buf* b) { cudaMemcpyToSymbol(::minfer::cuda::tl::g_buf, &b, sizeof b); }
#define TL_BEGIN(kind)                                                                                         \
    const int tl_kind_ = (kind);                                                                               \
    const bool tl_on_ = blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;                                 \
    unsigned long long tl_t_[::minfer::cuda::tl::kMarks] = {};                                                 \
    const unsigned long long tl_g0_ = tl_on_ ? ::minfer::cuda::tl::gtimer() : 0ull;                            \
    if (tl_on_) tl_t_[0] = ::minfer::cuda::tl::clk()
#define TL_MARK(k) \
    do {           \
        if (tl_on_) tl_t_[k] = ::minfer::cuda::tl::clk(); \
    } while (0)
#define TL_END() \
    do {         \
        if (tl_on_) ::minfer::cuda::tl::store(tl_kind_, tl_t_, tl_g0_); \
    } while (0)
#else
#define TL_BIND(name) \
    void name(::minfer::cuda::tl::Buf*) {}
#define TL_BEGIN(kind) \
    do {               \
    } while (0)
#define TL_MARK(k) \
    do {           \
    } while (0)
#define TL_END() \
    do {         \
    } while (0)
#endif
