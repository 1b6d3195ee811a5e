#include "cpu/pool.h"

#include <sys/mman.h>
#include <sys/sysinfo.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

namespace minfer::cpu {

namespace {
// Buffers from this size up are anonymous mappings: the kernel hands out zero pages
// and backs a page only when it is first written, so a KV region sized for a long
// context costs resident memory only for the cells actually used (a memset would
// touch, and keep, all of it). No MAP_NORESERVE: a size the kernel can never back is
// refused here, as std::bad_alloc, rather than failing later on first touch.
constexpr size_t kMapMin = size_t(1) << 20;
constexpr size_t kPage = 4096;

// RAM + swap: more than that can never be backed, whatever the overcommit policy says
// about reserving it (with overcommit_memory=1 the mapping itself would succeed and the
// failure come later, as the OOM killer).
size_t host_capacity() {
    struct sysinfo si;
    if (sysinfo(&si) != 0) return SIZE_MAX;
    return ((size_t)si.totalram + (size_t)si.totalswap) * si.mem_unit;
}
}  // namespace

Pool::~Pool() {
    for (Buf& b : bufs_) {
        if (b.mapped) munmap(b.ptr, b.mapped);
        else std::free(b.ptr);
    }
}

void Pool::zero(Buf& b) {
    // DONTNEED on a private anonymous mapping drops the pages: reads see zeros again
    // and the memory goes back to the system until written.
    if (b.mapped) madvise(b.ptr, b.mapped, MADV_DONTNEED);
    else std::memset(b.ptr, 0, b.nbytes);
}

int Pool::make(size_t nbytes) {
    Buf b{nullptr, nbytes, 0, false};
    if (nbytes >= kMapMin) {
        const size_t len = (nbytes + kPage - 1) / kPage * kPage;
        if (len > host_capacity()) throw std::bad_alloc();
        void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        b.ptr = (uint8_t*)p;
        b.mapped = len;
    } else {
        size_t rounded = (nbytes + 63) / 64 * 64;
        if (rounded == 0) rounded = 64;
        void* p = std::aligned_alloc(64, rounded);
        if (!p) throw std::bad_alloc();
        std::memset(p, 0, rounded);
        b.ptr = (uint8_t*)p;
    }
    bufs_.push_back(b);
    return (int)bufs_.size() - 1;
}

int Pool::alloc(size_t nbytes) {
    for (size_t i = 0; i < bufs_.size(); ++i) {
        Buf& b = bufs_[i];
        if (b.free && b.nbytes == nbytes) {
            b.free = false;
            zero(b);
            return (int)i;
        }
    }
    return make(nbytes);
}

int Pool::alloc_fresh(size_t nbytes) { return make(nbytes); }

void Pool::free(int id) {
    if (!valid(id)) throw std::out_of_range("pool " + name_ + ": free of unknown buffer " + std::to_string(id));
    bufs_[id].free = true;
}

size_t Pool::size(int id) const {
    if (!valid(id)) throw std::out_of_range("pool " + name_ + ": unknown buffer " + std::to_string(id));
    return bufs_[id].nbytes;
}

uint8_t* Pool::data(int id) {
    if (!valid(id)) throw std::out_of_range("pool " + name_ + ": unknown buffer " + std::to_string(id));
    return bufs_[id].ptr;
}

const uint8_t* Pool::data(int id) const {
    if (!valid(id)) throw std::out_of_range("pool " + name_ + ": unknown buffer " + std::to_string(id));
    return bufs_[id].ptr;
}

size_t Pool::bytes_total() const {
    size_t s = 0;
    for (const Buf& b : bufs_) s += b.nbytes;
    return s;
}

}  // namespace minfer::cpu
