// A backend's buffer pool: numbered byte buffers, 64-byte aligned. The Python
// GraphAllocator decides which ids are live; the pool only recycles exact sizes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace minfer::cpu {

class Pool {
public:
    explicit Pool(std::string name) : name_(std::move(name)) {}
    const std::string& name() const { return name_; }

    // First free buffer of exactly nbytes, zero-filled; else a new one.
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
    struct Deleter { void operator()(uint8_t* p) const; };
    struct Buf { std::unique_ptr<uint8_t, Deleter> ptr; size_t nbytes; bool free; };
    int make(size_t nbytes);
    std::string name_;
    std::vector<Buf> bufs_;
};

}  // namespace minfer::cpu
