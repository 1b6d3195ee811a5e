// A backend's buffer pool: numbered byte buffers, 64-byte aligned. The Python
// GraphAllocator decides which ids are live; the pool only recycles exact sizes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace minfer::cpu {

class Pool {
public:
    explicit Pool(std::string name) : name_(std::move(name)) {}
    ~Pool();
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;
    Pool(Pool&& o) noexcept : name_(std::move(o.name_)), bufs_(std::move(o.bufs_)) {}
    const std::string& name() const { return name_; }

    // First free buffer of exactly nbytes, zero-filled; else a new one. Throws
    // std::bad_alloc when the memory cannot be had.
    int alloc(size_t nbytes);
    // Always a new buffer: split-boundary staging must not be recycled mid-execute.
    int alloc_fresh(size_t nbytes);
    void free(int id);

    size_t size(int id) const;
    uint8_t* data(int id);
    const uint8_t* data(int id) const;
    int count() const { return (int)bufs_.size(); }
    size_t bytes_total() const;
    bool valid(int id) const { return id >= 0 && id < (int)bufs_.size(); }

private:
    struct Buf {
        uint8_t* ptr;
        size_t nbytes;   // asked for
        size_t mapped;   // > 0: an anonymous mapping of this many bytes (else aligned_alloc)
        bool free;
    };
    int make(size_t nbytes);
    static void zero(Buf& b);
    std::string name_;
    std::vector<Buf> bufs_;
};

}  // namespace minfer::cpu
