#include "cuda/pool.h"

#include <cstring>
#include <stdexcept>

#include "cuda/context.h"

namespace minfer::cuda {

DevPool::~DevPool() {
    if (bufs_.empty()) return;
    cudaStreamSynchronize(ctx().stream);
    for (Buf& b : bufs_) {
        cudaFree(b.d);
        if (b.pinned) cudaFreeHost(b.pinned);
        if (b.staged) cudaEventDestroy(b.staged);
    }
}

int DevPool::make(size_t nbytes) {
    Buf b;
    b.d = dev_alloc(nbytes);
    b.n = nbytes;
    MC_CHECK(cudaMemsetAsync(b.d, 0, nbytes ? nbytes : 1, ctx().stream));
    bufs_.push_back(b);
    return (int)bufs_.size() - 1;
}

int DevPool::alloc(size_t nbytes) {
    for (size_t i = 0; i < bufs_.size(); ++i) {
        Buf& b = bufs_[i];
        if (b.free && b.n == nbytes) {
            b.free = false;
            MC_CHECK(cudaMemsetAsync(b.d, 0, nbytes ? nbytes : 1, ctx().stream));
            return (int)i;
        }
    }
    return make(nbytes);
}

int DevPool::alloc_fresh(size_t nbytes) { return make(nbytes); }

void DevPool::free(int id) {
    if (!valid(id)) throw std::out_of_range("pool " + name_ + ": no buffer " + std::to_string(id));
    bufs_[id].free = true;
}

size_t DevPool::size(int id) const {
    if (!valid(id)) throw std::out_of_range("pool " + name_ + ": no buffer " + std::to_string(id));
    return bufs_[id].n;
}

void* DevPool::data(int id) {
    if (!valid(id)) throw std::out_of_range("pool " + name_ + ": no buffer " + std::to_string(id));
    return bufs_[id].d;
}

size_t DevPool::bytes_total() const {
    size_t s = 0;
    for (const Buf& b : bufs_) s += b.n;
    return s;
}

void DevPool::check_range(int id, size_t offset, size_t nbytes) const {
    size_t sz = size(id);
    if (offset > sz || nbytes > sz - offset)
        throw std::out_of_range("pool " + name_ + ": buffer " + std::to_string(id) + " holds " + std::to_string(sz) +
                                " bytes; access of " + std::to_string(nbytes) + " at offset " + std::to_string(offset));
}

void* DevPool::mirror(Buf& b) {
    if (!b.pinned) {
        b.pinned = host_alloc_pinned(b.n);
        MC_CHECK(cudaEventCreateWithFlags(&b.staged, cudaEventDisableTiming));
    }
    return b.pinned;
}

void DevPool::write(int id, const void* src, size_t nbytes, size_t offset) {
    check_range(id, offset, nbytes);
    Context& c = ctx();
    Buf& b = bufs_[id];
    uint8_t* m = (uint8_t*)mirror(b);
    // The mirror is the staging area: an H2D still reading it must finish first (by
    // the time a step is read back, it has, so this wait is normally free).
    if (cudaEventQuery(b.staged) == cudaErrorNotReady) {
        MC_CHECK(cudaEventSynchronize(b.staged));
        ++c.c.syncs;
    }
    std::memcpy(m + offset, src, nbytes);
    MC_CHECK(cudaMemcpyAsync((uint8_t*)b.d + offset, m + offset, nbytes, cudaMemcpyHostToDevice, c.stream));
    MC_CHECK(cudaEventRecord(b.staged, c.stream));
    ++c.c.h2d;
    c.c.h2d_bytes += nbytes;
}

const void* DevPool::fetch(int id, size_t nbytes, size_t offset) {
    check_range(id, offset, nbytes);
    Context& c = ctx();
    Buf& b = bufs_[id];
    uint8_t* m = (uint8_t*)mirror(b);
    MC_CHECK(cudaMemcpyAsync(m + offset, (uint8_t*)b.d + offset, nbytes, cudaMemcpyDeviceToHost, c.stream));
    ++c.c.d2h;
    c.c.d2h_bytes += nbytes;
    sync_stream();
    raise_device_error();
    return m + offset;
}

}  // namespace minfer::cuda
