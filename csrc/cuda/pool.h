// A CUDA buffer pool with the CPU pool's contract: numbered buffers, exact-size reuse,
// zero-filled on alloc. Buffers are never moved or freed while the pool lives, so a
// captured graph's pointers stay valid. Each buffer gets a pinned host mirror on first
// host access: the staging of writes (H2D) and the target of reads/views (D2H).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <vector>

namespace minfer::cuda {

class DevPool {
public:
    explicit DevPool(std::string name) : name_(std::move(name)) {}
    ~DevPool();
    DevPool(const DevPool&) = delete;
    DevPool& operator=(const DevPool&) = delete;

    const std::string& name() const { return name_; }
    int alloc(size_t nbytes);
    int alloc_fresh(size_t nbytes);
    void free(int id);
    size_t size(int id) const;
    void* data(int id);
    int count() const { return (int)bufs_.size(); }
    size_t bytes_total() const;
    bool valid(int id) const { return id >= 0 && id < (int)bufs_.size(); }

    void check_range(int id, size_t offset, size_t nbytes) const;
    // Stream-ordered H2D through the buffer's pinned mirror.
    void write(int id, const void* src, size_t nbytes, size_t offset);
    // D2H into the pinned mirror, wait; returns the mirror at offset (valid until the
    // next host access of this buffer).
    const void* fetch(int id, size_t nbytes, size_t offset);

private:
    struct Buf {
        void* d = nullptr;
        size_t n = 0;
        bool free = false;
        void* pinned = nullptr;
        cudaEvent_t staged = nullptr;  // the last H2D out of the mirror
    };
    int make(size_t nbytes);
    void* mirror(Buf& b);
    std::string name_;
    std::vector<Buf> bufs_;
};

}  // namespace minfer::cuda
