#include "cuda/pool.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <tuple>

#include "cuda/context.h"

namespace minfer::cuda {

DevPool::~DevPool() {
    if (bufs_.empty()) return;
    if (lane_) cudaStreamSynchronize(lane_->stream);
    for (Buf& b : bufs_) {
        if (!b.owner) continue;
        cudaFree(b.d);
        if (b.pinned) cudaFreeHost(b.pinned);
        if (b.staged) cudaEventDestroy(b.staged);
    }
}

const std::shared_ptr<Lane>& DevPool::own_lane() {
    if (!lane_) lane_ = new_lane();
    return lane_;
}

int DevPool::make(size_t nbytes) {
    forget_pick();
    Buf b;
    b.d = dev_alloc(nbytes);
    b.n = nbytes;
    MC_CHECK(cudaMemsetAsync(b.d, 0, nbytes ? nbytes : 1, lane().stream));
    bufs_.push_back(b);
    return (int)bufs_.size() - 1;
}

int DevPool::alloc(size_t nbytes) {
    for (size_t i = 0; i < bufs_.size(); ++i) {
        Buf& b = bufs_[i];
        if (b.free && b.n == nbytes && b.group < 0) {
            b.free = false;
            forget_pick();
            MC_CHECK(cudaMemsetAsync(b.d, 0, nbytes ? nbytes : 1, lane().stream));
            return (int)i;
        }
    }
    return make(nbytes);
}

int DevPool::alloc_fresh(size_t nbytes) { return make(nbytes); }

std::vector<int> DevPool::alloc_group(const std::vector<size_t>& sizes) {
    if (sizes.empty()) return {};
    Lane& l = lane();
    for (Group& g : groups_) {
        if (g.sizes != sizes) continue;
        bool all_free = true;
        for (int id : g.ids) all_free &= bufs_[id].free;
        if (!all_free) continue;
        forget_pick();
        for (int id : g.ids) bufs_[id].free = false;
        const Buf& last = bufs_[g.ids.back()];
        const Buf& first = bufs_[g.ids.front()];
        const size_t span = (size_t)((uint8_t*)last.d - (uint8_t*)first.d) + last.n;
        MC_CHECK(cudaMemsetAsync(first.d, 0, span ? span : 1, l.stream));
        return g.ids;
    }
    std::vector<size_t> off(sizes.size());
    size_t total = 0;
    for (size_t k = 0; k < sizes.size(); ++k) {
        off[k] = total;
        total += (sizes[k] + kGroupAlign - 1) / kGroupAlign * kGroupAlign;
    }
    uint8_t* d = (uint8_t*)dev_alloc(total);
    uint8_t* h = (uint8_t*)host_alloc_pinned(total);
    cudaEvent_t ev = nullptr;
    MC_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    MC_CHECK(cudaMemsetAsync(d, 0, total ? total : 1, l.stream));
    Group g;
    g.sizes = sizes;
    for (size_t k = 0; k < sizes.size(); ++k) {
        Buf b;
        b.d = d + off[k];
        b.n = sizes[k];
        b.pinned = h + off[k];
        b.staged = ev;
        b.group = (int)groups_.size();
        b.member = (int)k;
        b.owner = k == 0;
        bufs_.push_back(b);
        g.ids.push_back((int)bufs_.size() - 1);
    }
    groups_.push_back(g);
    return g.ids;
}

void DevPool::free(int id) {
    if (!valid(id)) throw std::out_of_range("pool " + name_ + ": no buffer " + std::to_string(id));
    bufs_[id].free = true;
    std::erase_if(pick_targets_, [&](const auto& t) { return t.first == id; });
}

void DevPool::add_pick_target(int id, int64_t n) {
    check_range(id, 0, (size_t)n * 4);
    for (auto& t : pick_targets_)
        if (t.first == id) {
            t.second = n;
            return;
        }
    pick_targets_.emplace_back(id, n);
}

int64_t DevPool::pick_target(int id) const {
    for (const auto& t : pick_targets_)
        if (t.first == id) return t.second;
    return 0;
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

void DevPool::wait_staged(Buf& b) {
    // The mirror is the staging area: an H2D still reading it must finish first (by
    // the time a step is read back, it has, so this wait is normally free).
    if (cudaEventQuery(b.staged) == cudaErrorNotReady) {
        MC_CHECK(cudaEventSynchronize(b.staged));
        ++ctx().c.syncs;
    }
}

void DevPool::write(int id, const void* src, size_t nbytes, size_t offset) {
    check_range(id, offset, nbytes);
    Context& c = ctx();
    const cudaStream_t stream = lane().stream;
    Buf& b = bufs_[id];
    uint8_t* m = (uint8_t*)mirror(b);
    wait_staged(b);
    forget_pick();
    std::memcpy(m + offset, src, nbytes);
    MC_CHECK(cudaMemcpyAsync((uint8_t*)b.d + offset, m + offset, nbytes, cudaMemcpyHostToDevice, stream));
    MC_CHECK(cudaEventRecord(b.staged, stream));
    ++c.c.h2d;
    c.c.h2d_bytes += nbytes;
}

void DevPool::write_many(const std::vector<int>& ids, const std::vector<const void*>& srcs,
                         const std::vector<size_t>& nbytes) {
    const size_t n = ids.size();
    if (srcs.size() != n || nbytes.size() != n) throw std::invalid_argument("write_many: ids, data and sizes differ in length");
    for (size_t k = 0; k < n; ++k) {
        check_range(ids[k], 0, nbytes[k]);
        if (nbytes[k] != bufs_[ids[k]].n)
            throw std::invalid_argument("pool " + name_ + ": write_many writes whole buffers; buffer " +
                                        std::to_string(ids[k]) + " holds " + std::to_string(bufs_[ids[k]].n) +
                                        " bytes, got " + std::to_string(nbytes[k]));
        for (size_t j = 0; j < k; ++j)
            if (ids[j] == ids[k]) throw std::invalid_argument("write_many: buffer " + std::to_string(ids[k]) + " twice");
    }
    forget_pick();
    // Stage every item in its mirror, then copy runs of consecutive group members
    // (ordered by position in the group) as one span each.
    std::vector<size_t> order(n);
    for (size_t k = 0; k < n; ++k) {
        order[k] = k;
        Buf& b = bufs_[ids[k]];
        mirror(b);
        wait_staged(b);
        std::memcpy(b.pinned, srcs[k], nbytes[k]);
    }
    auto key = [&](size_t k) {  // group members by (group, position), then the rest by id
        const Buf& b = bufs_[ids[k]];
        return std::make_tuple(b.group < 0, b.group < 0 ? ids[k] : b.group, b.member);
    };
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(a) < key(b); });
    Context& c = ctx();
    const cudaStream_t stream = lane().stream;
    for (size_t i = 0; i < n;) {
        const Buf& first = bufs_[ids[order[i]]];
        size_t j = i + 1;
        while (j < n) {
            const Buf& prev = bufs_[ids[order[j - 1]]];
            const Buf& next = bufs_[ids[order[j]]];
            if (first.group < 0 || next.group != first.group || next.member != prev.member + 1) break;
            ++j;
        }
        const Buf& last = bufs_[ids[order[j - 1]]];
        const size_t span = (size_t)((uint8_t*)last.d - (uint8_t*)first.d) + last.n;
        MC_CHECK(cudaMemcpyAsync(first.d, first.pinned, span, cudaMemcpyHostToDevice, stream));
        ++c.c.h2d;
        c.c.h2d_bytes += span;
        // One record per run: a group's members share the event, and the stream
        // orders this record after every earlier copy out of the group's mirror.
        MC_CHECK(cudaEventRecord(first.staged, stream));
        i = j;
    }
}

const void* DevPool::fetch(int id, size_t nbytes, size_t offset) {
    check_range(id, offset, nbytes);
    Context& c = ctx();
    Buf& b = bufs_[id];
    uint8_t* m = (uint8_t*)mirror(b);
    MC_CHECK(cudaMemcpyAsync(m + offset, (uint8_t*)b.d + offset, nbytes, cudaMemcpyDeviceToHost, lane().stream));
    ++c.c.d2h;
    c.c.d2h_bytes += nbytes;
    sync_stream();
    raise_device_error();
    return m + offset;
}

}  // namespace minfer::cuda
