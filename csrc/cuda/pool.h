// A CUDA buffer pool with the CPU pool's contract: numbered buffers, exact-size reuse,
// zero-filled on alloc. Buffers are never moved or freed while the pool lives, so a
// captured graph's pointers stay valid. Each buffer gets a pinned host mirror on first
// host access: the staging of writes (H2D) and the target of reads/views (D2H).
//
// A group is a set of buffers carved from one device block and one pinned block at the
// same offsets (a graph's small inputs): write_many then moves adjacent members in one
// H2D, so a decode step's token id, position and cell cost one copy, not three.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace minfer::cuda {

struct Lane;

class DevPool {
public:
    explicit DevPool(std::string name) : name_(std::move(name)) {}
    ~DevPool();
    DevPool(const DevPool&) = delete;
    DevPool& operator=(const DevPool&) = delete;

    const std::string& name() const { return name_; }
    // The pool's lane (context.h), created on first use: every call with this pool runs
    // on it (bindings_cuda.cpp makes it the current lane), and so do its plans, which
    // hold it too: it ends, its streams waited for, with the last of them and the pool.
    const std::shared_ptr<Lane>& own_lane();
    bool has_lane() const { return lane_ != nullptr; }
    int alloc(size_t nbytes);
    int alloc_fresh(size_t nbytes);
    // Buffers of these sizes, laid out in this order in one block (16-byte aligned),
    // zero-filled; a freed group of the same sizes is reused whole. Plain alloc never
    // takes a group's member.
    std::vector<int> alloc_group(const std::vector<size_t>& sizes);
    void free(int id);
    size_t size(int id) const;
    void* data(int id);
    int count() const { return (int)bufs_.size(); }
    size_t bytes_total() const;
    bool valid(int id) const { return id >= 0 && id < (int)bufs_.size(); }

    // Greedy-pick targets (buffer, n): see PickSlot in context.h. A freed buffer stops
    // being one.
    void add_pick_target(int id, int64_t n);
    int64_t pick_target(int id) const;  // its n, or 0

    void check_range(int id, size_t offset, size_t nbytes) const;
    // Stream-ordered H2D through the buffer's pinned mirror.
    void write(int id, const void* src, size_t nbytes, size_t offset);
    // Whole-buffer writes of several buffers (distinct ids): consecutive members of one
    // group go in one H2D (the padding between them rides along), the rest one each.
    void write_many(const std::vector<int>& ids, const std::vector<const void*>& srcs,
                    const std::vector<size_t>& nbytes);
    // D2H into the pinned mirror, wait; returns the mirror at offset (valid until the
    // next host access of this buffer).
    const void* fetch(int id, size_t nbytes, size_t offset);

private:
    struct Buf {
        void* d = nullptr;
        size_t n = 0;
        bool free = false;
        void* pinned = nullptr;
        cudaEvent_t staged = nullptr;  // the last H2D out of the mirror (shared by a group)
        int group = -1;                // index into groups_, or -1
        int member = 0;                // position in the group
        bool owner = true;             // frees d, pinned and staged (a group's member 0)
    };
    struct Group {
        std::vector<int> ids;
        std::vector<size_t> sizes;
    };
    static constexpr size_t kGroupAlign = 16;
    int make(size_t nbytes);
    void* mirror(Buf& b);
    void wait_staged(Buf& b);
    std::string name_;
    std::vector<Buf> bufs_;
    std::vector<Group> groups_;
    std::vector<std::pair<int, int64_t>> pick_targets_;
    std::shared_ptr<Lane> lane_;
};

}  // namespace minfer::cuda
