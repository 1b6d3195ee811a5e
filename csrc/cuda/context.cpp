#include "cuda/context.h"

#include <algorithm>
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
std::atomic<Context*> g_ctx{nullptr};
std::mutex g_mu;
std::mutex g_lanes_mu;
std::vector<std::weak_ptr<Lane>> g_lanes;
thread_local Lane* t_lane = nullptr;

void track(const std::shared_ptr<Lane>& l) {
    std::lock_guard<std::mutex> lk(g_lanes_mu);
    std::erase_if(g_lanes, [](const std::weak_ptr<Lane>& w) { return w.expired(); });
    g_lanes.push_back(l);
}
}  // namespace

Context& ctx() {
    if (Context* c = g_ctx.load()) return *c;
    std::lock_guard<std::mutex> lk(g_mu);
    if (Context* c = g_ctx.load()) return *c;
    std::string why;
    if (device_count(&why) <= 0) throw std::runtime_error(why);
    auto* c = new Context();
    MC_CHECK(cudaSetDevice(0));
    MC_CHECK(cudaDeviceGetAttribute(&c->n_sm, cudaDevAttrMultiProcessorCount, 0));
    MC_CHECK(cudaDeviceGetAttribute(&c->smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0));
    MC_CHECK(cudaDeviceGetAttribute(&c->smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    c->deflt = std::make_shared<Lane>(false);
    track(c->deflt);
    g_ctx.store(c);
    return *c;
}

Lane::Lane(bool gemms) {
    MC_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    MC_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    if (gemms) {
        check_blas(cublasCreate(&blas), "cublasCreate");
        check_blas(cublasSetStream(blas, stream), "cublasSetStream");
        // A fixed workspace: cuBLAS then allocates nothing inside a graph capture.
        const size_t ws_bytes = 64u << 20;
        MC_CHECK(cudaMalloc(&blas_ws, ws_bytes));
        check_blas(cublasSetWorkspace(blas, blas_ws, ws_bytes), "cublasSetWorkspace");
    }
    MC_CHECK(cudaHostAlloc((void**)&err_host, sizeof(int), cudaHostAllocMapped));
    *err_host = 0;
    MC_CHECK(cudaHostGetDevicePointer((void**)&err_dev, err_host, 0));
}

Lane::~Lane() {
    // Unchecked: this may run while the process ends.
    cudaStreamSynchronize(stream);
    cudaStreamSynchronize(side);
    if (blas) cublasDestroy(blas);
    if (blas_ws) cudaFree(blas_ws);
    if (pick.dev) cudaFree(pick.dev);
    if (pick.host) cudaFreeHost(pick.host);
    if (argmax_scratch) cudaFree(argmax_scratch);
    if (topk_scratch) cudaFree(topk_scratch);
    for (cudaEvent_t e : {mask_copied, handoff})
        if (e) cudaEventDestroy(e);
    if (err_host) cudaFreeHost(err_host);
    cudaStreamDestroy(side);
    cudaStreamDestroy(stream);
}

std::shared_ptr<Lane> new_lane() {
    ctx();
    auto l = std::make_shared<Lane>(true);
    track(l);
    return l;
}

Lane& lane() {
    Lane* l = t_lane;
    return l ? *l : *ctx().deflt;
}

Lane* swap_lane(Lane* l) {
    Lane* prev = t_lane;
    t_lane = l;
    return prev;
}

std::vector<std::shared_ptr<Lane>> live_lanes() {
    std::lock_guard<std::mutex> lk(g_lanes_mu);
    std::vector<std::shared_ptr<Lane>> r;
    for (const auto& w : g_lanes)
        if (auto l = w.lock()) r.push_back(std::move(l));
    return r;
}

void Staging::grow(size_t need) {
    if (need <= cap) return;
    if (dev) MC_CHECK(cudaFree(dev));
    if (pin) MC_CHECK(cudaFreeHost(pin));
    dev = dev_alloc(need);
    pin = host_alloc_pinned(need);
    cap = need;
}

Staging::~Staging() {
    if (dev) cudaFree(dev);
    if (pin) cudaFreeHost(pin);
}

std::string device_name() {
    Context& c = ctx();
    cudaDeviceProp p;
    MC_CHECK(cudaGetDeviceProperties(&p, c.device));
    return p.name;
}

void raise_device_error() {
    Lane& l = lane();
    const int e = *(volatile int*)l.err_host;
    if (!e) return;
    *(volatile int*)l.err_host = 0;
    switch (e) {
        case 1: throw std::invalid_argument("CUDA step: token id outside the vocabulary");
        case 2: throw std::invalid_argument("CUDA step: row id outside the source rows");
        case 3: throw std::invalid_argument("CUDA step: KV cell outside the context");
        case 4: throw std::invalid_argument("CUDA step: position or attention span outside the context");
        default: throw std::invalid_argument("CUDA step: bad index data (code " + std::to_string(e) + ")");
    }
}

void sync_stream() {
    MC_CHECK(cudaStreamSynchronize(lane().stream));
    ++ctx().c.syncs;
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

void forget_pick() { lane().pick.pool = nullptr; }

PickSlot& pick_slot() {
    PickSlot& p = lane().pick;
    if (!p.dev) {
        p.dev = (int32_t*)dev_alloc(sizeof(int32_t));
        p.host = (int32_t*)host_alloc_pinned(sizeof(int32_t));
    }
    return p;
}

}  // namespace minfer::cuda
