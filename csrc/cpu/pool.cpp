#include "cpu/pool.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

namespace minfer::cpu {

void Pool::Deleter::operator()(uint8_t* p) const { std::free(p); }

int Pool::make(size_t nbytes) {
    size_t rounded = (nbytes + 63) / 64 * 64;
    if (rounded == 0) rounded = 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, rounded);
    bufs_.push_back(Buf{std::unique_ptr<uint8_t, Deleter>((uint8_t*)p), nbytes, false});
    return (int)bufs_.size() - 1;
}

int Pool::alloc(size_t nbytes) {
    for (size_t i = 0; i < bufs_.size(); ++i) {
        Buf& b = bufs_[i];
        if (b.free && b.nbytes == nbytes) {
            b.free = false;
            std::memset(b.ptr.get(), 0, nbytes);
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
    return bufs_[id].ptr.get();
}

const uint8_t* Pool::data(int id) const {
    if (!valid(id)) throw std::out_of_range("pool " + name_ + ": unknown buffer " + std::to_string(id));
    return bufs_[id].ptr.get();
}

size_t Pool::bytes_total() const {
    size_t s = 0;
    for (const Buf& b : bufs_) s += b.nbytes;
    return s;
}

}  // namespace minfer::cpu
