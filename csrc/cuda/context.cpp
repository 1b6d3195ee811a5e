#include "cuda/context.h"

#include <mutex>

namespace minfer::cuda {

void throw_cuda(cudaError_t e, const char* what) {
    throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                             ") in " + what);
}

void check_blas(cublasStatus_t s, const char* what) {
    if (s != CUBLAS_STATUS_SUCCESS)
        throw std::runtime_error(std::string("cuBLAS error ") + std::to_string((int)s) + " in " + what);
}

int device_count(std::string* why) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (why) *why = std::string("no CUDA device visible (") + cudaGetErrorString(e) + ")";
        cudaGetLastError();  // clear the sticky-free error so later calls start clean
        return 0;
    }
    if (n == 0 && why) *why = "no CUDA device visible (the driver reports 0 devices)";
    return n;
}

namespace {
Context* g_ctx = nullptr;
std::mutex g_mu;
}  // namespace

Context& ctx() {
    if (g_ctx) return *g_ctx;
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_ctx) return *g_ctx;
    std::string why;
    if (device_count(&why) <= 0) throw std::runtime_error(why);
    auto* c = new Context();
    MC_CHECK(cudaSetDevice(0));
    MC_CHECK(cudaDeviceGetAttribute(&c->n_sm, cudaDevAttrMultiProcessorCount, 0));
    MC_CHECK(cudaDeviceGetAttribute(&c->smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    MC_CHECK(cudaDeviceGetAttribute(&c->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    MC_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    MC_CHECK(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking));
    check_blas(cublasCreate(&c->blas), "cublasCreate");
    check_blas(cublasSetStream(c->blas, c->stream), "cublasSetStream");
    // A fixed workspace: cuBLAS then allocates nothing inside a graph capture.
    c->blas_ws_bytes = 64u << 20;
    MC_CHECK(cudaMalloc(&c->blas_ws, c->blas_ws_bytes));
    check_blas(cublasSetWorkspace(c->blas, c->blas_ws, c->blas_ws_bytes), "cublasSetWorkspace");
    MC_CHECK(cudaHostAlloc((void**)&c->err_host, sizeof(int), cudaHostAllocMapped));
    *c->err_host = 0;
    MC_CHECK(cudaHostGetDevicePointer((void**)&c->err_dev, c->err_host, 0));
    g_ctx = c;
    return *c;
}

std::recursive_mutex& stream_mutex() {
    static std::recursive_mutex mu;
    return mu;
}

std::string device_name() {
    Context& c = ctx();
    cudaDeviceProp p;
    MC_CHECK(cudaGetDeviceProperties(&p, c.device));
    return p.name;
}

void raise_device_error() {
    Context& c = ctx();
    const int e = *(volatile int*)c.err_host;
    if (!e) return;
    *(volatile int*)c.err_host = 0;
    switch (e) {
        case 1: throw std::invalid_argument("CUDA step: token id outside the vocabulary");
        case 2: throw std::invalid_argument("CUDA step: row id outside the source rows");
        case 3: throw std::invalid_argument("CUDA step: KV cell outside the context");
        case 4: throw std::invalid_argument("CUDA step: position or attention span outside the context");
        default: throw std::invalid_argument("CUDA step: bad index data (code " + std::to_string(e) + ")");
    }
}

void sync_stream() {
    Context& c = ctx();
    MC_CHECK(cudaStreamSynchronize(c.stream));
    ++c.c.syncs;
}

void* dev_alloc(size_t nbytes) {
    Context& c = ctx();
    void* p = nullptr;
    MC_CHECK(cudaMalloc(&p, nbytes ? nbytes : 1));
    ++c.c.allocs;
    return p;
}

void* host_alloc_pinned(size_t nbytes) {
    Context& c = ctx();
    void* p = nullptr;
    MC_CHECK(cudaMallocHost(&p, nbytes ? nbytes : 1));
    ++c.c.allocs;
    return p;
}

namespace {
PickSlot g_pick;
}  // namespace

void forget_pick() { g_pick.pool = nullptr; }

PickSlot& pick_slot() {
    PickSlot& p = g_pick;
    if (!p.dev) {
        p.dev = (int32_t*)dev_alloc(sizeof(int32_t));
        p.host = (int32_t*)host_alloc_pinned(sizeof(int32_t));
    }
    return p;
}

}  // namespace minfer::cuda
