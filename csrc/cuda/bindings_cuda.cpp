// _core's CUDA surface: CudaPool (the pool surface on device memory), plan validate/run,
// the device argmax, boundary copies for every (host, device) pair, and counters.
#include "bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>

#include "cpu/pool.h"
#include "common/plan.h"
#include "cuda/context.h"
#include "cuda/executor.h"
#include "cuda/kernels.h"
#include "cuda/timeline.h"
#include "py_weight_store.h"

namespace py = pybind11;

namespace minfer {

using namespace minfer::cuda;

namespace {

// Every call that enqueues on a stream, waits on one or moves memory holds a lane
// (context.h) for its whole length: its pool's, or the default lane where it has none.
// The lane's mutex is taken with the GIL released (a holder may be waiting for the GIL
// to come back), and the lane is the thread's current one until the guard ends (then
// the one before is again). Two threads with two pools (two contexts) run at once, each
// on its own stream; one pool used from two threads is taken in turn, so no capture
// records another thread's launch and a greedy pick's readback follows its own forward.
// Recursive: a callback from a held call (cuda_launches' `after`) may call others. The
// guard keeps the lane alive: a pool's end (PoolDeleter) frees the pool inside it.
class LaneGuard {
public:
    LaneGuard() : LaneGuard(ctx().deflt) {}
    explicit LaneGuard(DevPool& p) : LaneGuard(p.own_lane()) {}
    // Two lanes (copy_buffer between pools) are locked together, so two threads copying
    // opposite ways cannot deadlock; the first is current.
    explicit LaneGuard(std::shared_ptr<Lane> l, std::shared_ptr<Lane> also = nullptr)
        : lane_(std::move(l)), also_(also == lane_ ? nullptr : std::move(also)) {
        {
            py::gil_scoped_release nogil;
            if (also_)
                std::lock(lane_->mu, also_->mu);
            else
                lane_->mu.lock();
        }
        prev_ = swap_lane(lane_.get());
    }
    ~LaneGuard() {
        swap_lane(prev_);
        if (also_) also_->mu.unlock();
        lane_->mu.unlock();
    }
    LaneGuard(const LaneGuard&) = delete;
    LaneGuard& operator=(const LaneGuard&) = delete;

private:
    std::shared_ptr<Lane> lane_, also_;
    Lane* prev_ = nullptr;
};

// A DevPool method run on its pool's lane.
template <class R, class... A>
auto on_lane(R (DevPool::*f)(A...)) {
    return [f](DevPool& p, A... a) -> R {
        LaneGuard g(p);
        return (p.*f)(std::forward<A>(a)...);
    };
}

DevWeights& mirror_of(PyWeightStore& s) {
    if (!s.device_mirror) s.device_mirror = std::make_shared<DevWeights>();
    return *static_cast<DevWeights*>(s.device_mirror.get());
}

void check_host_range(const cpu::Pool& pool, int id, size_t nbytes) {
    if (nbytes > pool.size(id))
        throw std::out_of_range("pool " + pool.name() + ": buffer " + std::to_string(id) + " holds " +
                                std::to_string(pool.size(id)) + " bytes; access of " + std::to_string(nbytes));
}

double copy_bandwidth(size_t nbytes, int reps) {
    Lane& c = lane();
    void* a = dev_alloc(nbytes);
    void* b = dev_alloc(nbytes);
    cudaEvent_t e0, e1;
    MC_CHECK(cudaEventCreate(&e0));
    MC_CHECK(cudaEventCreate(&e1));
    MC_CHECK(cudaMemsetAsync(a, 1, nbytes, c.stream));
    MC_CHECK(cudaMemcpyAsync(b, a, nbytes, cudaMemcpyDeviceToDevice, c.stream));
    MC_CHECK(cudaEventRecord(e0, c.stream));
    for (int i = 0; i < reps; ++i) MC_CHECK(cudaMemcpyAsync(b, a, nbytes, cudaMemcpyDeviceToDevice, c.stream));
    MC_CHECK(cudaEventRecord(e1, c.stream));
    MC_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    MC_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    // Bytes read plus bytes written, as STREAM's copy counts them.
    return 2.0 * (double)nbytes * reps / (ms * 1e-3);
}

// bench/host_gap.py: medians (us) of an nbytes D2H into pinned memory + wait, by the
// copy engine, then by copy_out with 132, 264 and 528 blocks.
std::vector<double> d2h_probe(size_t nbytes, int reps) {
    Lane& c = lane();
    void* d = dev_alloc(nbytes);
    void* h = host_alloc_pinned(nbytes);
    MC_CHECK(cudaMemsetAsync(d, 1, nbytes, c.stream));
    using clk = std::chrono::steady_clock;
    auto time = [&](auto&& fn) {
        std::vector<double> v;
        for (int i = 0; i < reps; ++i) {
            MC_CHECK(cudaStreamSynchronize(c.stream));
            auto t0 = clk::now();
            fn();
            MC_CHECK(cudaStreamSynchronize(c.stream));
            v.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
        }
        return median_of(std::move(v));
    };
    std::vector<double> r;
    r.push_back(time([&] { MC_CHECK(cudaMemcpyAsync(h, d, nbytes, cudaMemcpyDeviceToHost, c.stream)); }));
    for (unsigned b : {132u, 264u, 528u}) r.push_back(time([&] { copy_out(d, h, nbytes, b); }));
    const bool same = ((const uint8_t*)h)[nbytes - 1] == 1;
    cudaFree(d);
    cudaFreeHost(h);
    if (!same) throw std::runtime_error("d2h_probe: the copy did not land");
    return r;
}

// A pool's end frees device and pinned memory and waits on its lane's stream: like every
// call that touches the stream, under its LaneGuard, so it never lands inside another
// thread's capture on that lane. Not while the interpreter finalizes: a daemon thread
// frozen there may hold the mutex, and no other thread runs by then; nor for a pool that
// never made its lane (it has nothing on a stream).
struct PoolDeleter {
    void operator()(DevPool* p) const {
#if PY_VERSION_HEX >= 0x030D0000
        const bool finalizing = Py_IsFinalizing();
#else
        const bool finalizing = _Py_IsFinalizing();
#endif
        if (finalizing || !p->has_lane()) {
            delete p;
            return;
        }
        LaneGuard g(*p);
        delete p;
    }
};

}  // namespace

void register_cuda(py::module_& m, py::module_& testing) {
    py::class_<DevPool, std::unique_ptr<DevPool, PoolDeleter>>(m, "CudaPool")
        .def(py::init<std::string>(), py::arg("name"))
        .def_property_readonly("name", &DevPool::name)
        .def("alloc", on_lane(&DevPool::alloc), py::arg("nbytes"))
        .def("alloc_fresh", on_lane(&DevPool::alloc_fresh), py::arg("nbytes"))
        .def("pick_target", on_lane(&DevPool::add_pick_target), py::arg("id"), py::arg("n"),
             "Logits a greedy pick reads (n f32 in buffer id): a plan whose last step writes them ends with "
             "the argmax inside its graph.")
        .def("alloc_group", on_lane(&DevPool::alloc_group), py::arg("sizes"),
             "Buffers of these sizes in one block (a graph's inputs): write_many copies adjacent ones at once.")
        .def("free", on_lane(&DevPool::free), py::arg("id"))
        .def("size", &DevPool::size, py::arg("id"))
        .def("count", &DevPool::count)
        .def("bytes_total", &DevPool::bytes_total)
        .def("write", [](DevPool& p, int id, py::array data, size_t offset) {
                LaneGuard g(p);
                if (!(data.flags() & py::array::c_style)) throw std::invalid_argument("write needs a C-contiguous array");
                p.write(id, data.data(), (size_t)data.nbytes(), offset);
            }, py::arg("id"), py::arg("data"), py::arg("offset") = 0,
            "Stream-ordered H2D through the buffer's pinned mirror.")
        .def("write_many", [](DevPool& p, const std::vector<int>& ids, const std::vector<py::array>& data) {
                LaneGuard g(p);
                if (ids.size() != data.size()) throw std::invalid_argument("write_many: as many arrays as buffer ids");
                std::vector<const void*> src(ids.size());
                std::vector<size_t> nb(ids.size());
                for (size_t k = 0; k < ids.size(); ++k) {
                    if (!(data[k].flags() & py::array::c_style))
                        throw std::invalid_argument("write_many needs C-contiguous arrays");
                    src[k] = data[k].data();
                    nb[k] = (size_t)data[k].nbytes();
                }
                p.write_many(ids, src, nb);
            }, py::arg("ids"), py::arg("data"),
            "Whole-buffer writes; adjacent members of one group (alloc_group) in one H2D.")
        .def("read", [](DevPool& p, int id, const std::string& dtype, py::ssize_t count, size_t offset) {
                LaneGuard g(p);
                py::dtype dt(dtype);
                size_t nbytes = (size_t)count * dt.itemsize();
                const void* src;
                {
                    py::gil_scoped_release nogil;
                    src = p.fetch(id, nbytes, offset);
                }
                py::array out(dt, std::vector<py::ssize_t>{count});
                std::memcpy(out.mutable_data(), src, nbytes);
                return out;
            }, py::arg("id"), py::arg("dtype"), py::arg("count"), py::arg("offset") = 0, "D2H + wait; a copy.")
        .def("view", [](py::object self, int id, const std::string& dtype, py::ssize_t count, size_t offset) {
                // Read-only window on the buffer's pinned mirror, filled by one D2H:
                // valid until this buffer's next host access.
                DevPool& p = self.cast<DevPool&>();
                LaneGuard g(p);
                py::dtype dt(dtype);
                const void* src;
                {
                    py::gil_scoped_release nogil;
                    src = p.fetch(id, (size_t)count * dt.itemsize(), offset);
                }
                py::array out(dt, std::vector<py::ssize_t>{count}, std::vector<py::ssize_t>{(py::ssize_t)dt.itemsize()},
                              src, self);
                py::detail::array_proxy(out.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
                return out;
            }, py::arg("id"), py::arg("dtype"), py::arg("count"), py::arg("offset") = 0)
        .def("copy_within", [](DevPool& p, int id, size_t src_off, size_t dst_off, size_t nbytes) {
                LaneGuard g(p);
                const size_t lo = std::min(src_off, dst_off), hi = std::max(src_off, dst_off);
                if (hi - lo < nbytes) throw std::invalid_argument("copy_within: the ranges overlap");
                p.check_range(id, src_off, nbytes);
                p.check_range(id, dst_off, nbytes);
                uint8_t* base = (uint8_t*)p.data(id);
                MC_CHECK(cudaMemcpyAsync(base + dst_off, base + src_off, nbytes, cudaMemcpyDeviceToDevice, lane().stream));
                ++ctx().c.d2d;
            }, py::arg("id"), py::arg("src_off"), py::arg("dst_off"), py::arg("nbytes"),
            "Stream-ordered D2D inside one buffer (KV cells from one sequence's range to another's; "
            "the ranges must not overlap).");

    m.def("cuda_validate", [](const Plan& plan, DevPool& pool, PyWeightStore& ws) {
            LaneGuard g(pool);
            validate_plan(plan, pool, ws.store, mirror_of(ws));
        }, py::arg("plan"), py::arg("pool"), py::arg("weights"),
        "Check a plan against a CUDA pool and upload the weights it uses (once per handle).");
    m.def("cuda_run", [](const Plan& plan, DevPool& pool, PyWeightStore& ws, size_t begin, int64_t end) {
            LaneGuard g(pool);
            DevWeights& dw = mirror_of(ws);
            py::gil_scoped_release nogil;
            run_plan(plan, pool, ws.store, dw, begin, end < 0 ? (size_t)-1 : (size_t)end);
        }, py::arg("plan"), py::arg("pool"), py::arg("weights"), py::arg("begin") = 0, py::arg("end") = -1,
        "Enqueue plan steps [begin, end) on the pool's CUDA stream (a graph replay once warm); does not wait.");
    m.def("cuda_step", [](const Plan& plan, DevPool& pool, PyWeightStore& ws, int tok_id, int pos_id, int cell_id,
                          int32_t tok, int32_t pos, int32_t cell) {
            LaneGuard g(pool);
            DevWeights& dw = mirror_of(ws);
            py::gil_scoped_release nogil;
            const int32_t v[3] = {tok, pos, cell};
            pool.write_many({tok_id, pos_id, cell_id}, {&v[0], &v[1], &v[2]}, {4, 4, 4});
            run_plan(plan, pool, ws.store, dw, 0, (size_t)-1);
        }, py::arg("plan"), py::arg("pool"), py::arg("weights"), py::arg("tok_buf"), py::arg("pos_buf"),
        py::arg("cell_buf"), py::arg("token"), py::arg("position"), py::arg("cell"),
        "A decode step in one call: write_many of its three one-int inputs, then cuda_run of the whole plan.");
    m.def("cuda_launches", [](const Plan& plan, DevPool& pool, PyWeightStore& ws, py::object after, bool timed) {
            LaneGuard g(pool);
            DevWeights& dw = mirror_of(ws);
            std::function<void(const LaunchInfo&, size_t)> cb;
            if (!after.is_none())
                cb = [&after](const LaunchInfo& L, size_t k) {
                    py::gil_scoped_acquire gil;
                    after((int64_t)k, L.name, L.steps);
                };
            std::vector<LaunchInfo> r;
            {
                py::gil_scoped_release nogil;
                r = run_launches(plan, pool, ws.store, dw, timed, cb);
            }
            py::list out;
            for (const auto& L : r)
                out.append(py::make_tuple(L.name, L.steps, timed ? py::object(py::float_(L.ms)) : py::object(py::none())));
            return out;
        }, py::arg("plan"), py::arg("pool"), py::arg("weights"), py::arg("after") = py::none(), py::arg("timed") = false,
        "A whole run launched directly, one launch at a time (tracing and profiling: the kernels a replay runs, "
        "step merges included, bitwise a replay's results): [(kernel, plan steps, ms)]. after(k, kernel, steps) "
        "follows launch k; timed (without after): ms from events between the launches, read once after the last, "
        "else None.");
    testing.def("cuda_plan_info", [](const Plan& plan) {
            py::dict d;
            d["captured"] = plan_captured(plan);
            d["graph_nodes"] = plan_graph_nodes(plan);
            d["launches"] = plan_launches(plan);
            d["gemm_pipelined"] = plan_gemm_pipelined(plan);
            d["gemm_inputs_reused"] = plan_gemm_inputs_reused(plan);
            return d;
        }, py::arg("plan"));

    m.def("argmax", [](DevPool& pool, int id, int64_t n, int /*n_threads*/) {
            LaneGuard g(pool);
            pool.check_range(id, 0, (size_t)n * 4);
            Context& c = ctx();
            Lane& l = lane();
            PickSlot& pk = pick_slot();
            int32_t r;
            {
                py::gil_scoped_release nogil;
                // The plan that wrote these logits may have taken the argmax in its graph.
                // Else it is taken now, and the slot then answers for these logits.
                if (!(pk.pool == &pool && pk.buf == id && pk.n == n)) {
                    argmax((const float*)pool.data(id), n, pk.dev, l.err_dev);
                    pk.pool = &pool;
                    pk.buf = id;
                    pk.n = n;
                }
                MC_CHECK(cudaMemcpyAsync(pk.host, pk.dev, 4, cudaMemcpyDeviceToHost, l.stream));
                ++c.c.d2h;
                c.c.d2h_bytes += 4;
                sync_stream();
                r = *pk.host;
            }
            if (r < 0 && r != kArgmaxNonFinite) {
                raise_device_error();
                throw std::runtime_error("CUDA argmax: error code " + std::to_string(r));
            }
            return (int64_t)r;
        }, py::arg("pool"), py::arg("id"), py::arg("n"), py::arg("n_threads") = 1,
        "Device argmax (first index on ties): one 4-byte readback and one wait. -1 when any of "
        "the n values is NaN or Inf (the caller raises, naming the step).");

    m.def("argmax_rows", [](DevPool& pool, int id, int64_t n, int rows) {
            if (rows < 1 || rows > kArgmaxMaxRows)
                throw py::value_error("argmax_rows: rows must be in 1.." + std::to_string(kArgmaxMaxRows));
            LaneGuard g(pool);
            pool.check_range(id, 0, (size_t)n * rows * 4);
            Context& c = ctx();
            Lane& l = lane();
            // Answers of a block's rows: one device array, one pinned readback of rows ints.
            l.rows_out.grow(kArgmaxMaxRows * sizeof(int32_t));
            int32_t* dev = (int32_t*)l.rows_out.dev;
            int32_t* host = (int32_t*)l.rows_out.pin;
            std::vector<int32_t> r(rows);
            {
                py::gil_scoped_release nogil;
                argmax((const float*)pool.data(id), n, dev, l.err_dev, rows);
                MC_CHECK(cudaMemcpyAsync(host, dev, rows * sizeof(int32_t), cudaMemcpyDeviceToHost, l.stream));
                ++c.c.d2h;
                c.c.d2h_bytes += rows * sizeof(int32_t);
                sync_stream();
                std::copy(host, host + rows, r.begin());
            }
            for (int32_t v : r)
                if (v < 0 && v != kArgmaxNonFinite) {
                    raise_device_error();
                    throw std::runtime_error("CUDA argmax: error code " + std::to_string(v));
                }
            return r;
        }, py::arg("pool"), py::arg("id"), py::arg("n"), py::arg("rows"),
        "Device argmax of each of `rows` consecutive rows of n values (first index on ties), in one "
        "launch and one readback of rows ints; -1 for a row holding NaN or Inf.");

    m.attr("top_k_max") = kTopKMax;
    m.def("top_k_rows", [](DevPool& pool, int id, int64_t n, int rows, int k,
                           py::array_t<int32_t, py::array::c_style | py::array::forcecast> gather) {
            if (rows < 1 || rows > kArgmaxMaxRows)
                throw py::value_error("top_k_rows: rows must be in 1.." + std::to_string(kArgmaxMaxRows));
            if (k < 1 || k > kTopKMax || k > n)
                throw py::value_error("top_k_rows: k must be in 1..min(n, " + std::to_string(kTopKMax) + ")");
            if (gather.ndim() != 2 || gather.shape(0) != rows || gather.shape(1) > kTopKMax)
                throw py::value_error("top_k_rows: gather must be rows x g ids, g <= " + std::to_string(kTopKMax));
            const int g = (int)gather.shape(1);
            const int32_t* gi = gather.data();
            for (int64_t i = 0; i < (int64_t)rows * g; ++i)
                if (gi[i] < -1 || gi[i] >= n) throw py::value_error("top_k_rows: a gather id outside the row");
            LaneGuard lg(pool);
            pool.check_range(id, 0, (size_t)n * rows * 4);
            Context& c = ctx();
            Lane& l = lane();
            const size_t words = topk_row_words(k, g);
            std::vector<int32_t> res((size_t)rows * words);
            {
                py::gil_scoped_release nogil;
                // The lane's buffers, sized for the largest call so far (every call ends with
                // a wait, so a smaller one is idle when it is replaced); the scratch is zero
                // when allocated.
                const size_t need_s = topk_scratch_bytes(n, rows, k);
                const size_t need_g = (size_t)rows * std::max(g, 1) * 4, need_o = res.size() * 4;
                if (need_s > l.topk_scratch_bytes) {
                    if (l.topk_scratch) MC_CHECK(cudaFree(l.topk_scratch));
                    l.topk_scratch = dev_alloc(need_s);
                    MC_CHECK(cudaMemsetAsync(l.topk_scratch, 0, need_s, l.stream));
                    l.topk_scratch_bytes = need_s;
                }
                l.rows_in.grow(need_g);
                l.rows_out.grow(need_o);
                int32_t *gdev = (int32_t*)l.rows_in.dev, *gpin = (int32_t*)l.rows_in.pin;
                int32_t *odev = (int32_t*)l.rows_out.dev, *opin = (int32_t*)l.rows_out.pin;
                if (g > 0) {
                    std::memcpy(gpin, gi, (size_t)rows * g * 4);
                    MC_CHECK(cudaMemcpyAsync(gdev, gpin, (size_t)rows * g * 4, cudaMemcpyHostToDevice, l.stream));
                    ++c.c.h2d;
                    c.c.h2d_bytes += (size_t)rows * g * 4;
                }
                top_k((const float*)pool.data(id), n, rows, k, gdev, g, l.topk_scratch, odev, k, g, l.err_dev);
                MC_CHECK(cudaMemcpyAsync(opin, odev, need_o, cudaMemcpyDeviceToHost, l.stream));
                ++c.c.d2h;
                c.c.d2h_bytes += need_o;
                sync_stream();
                std::copy(opin, opin + res.size(), res.begin());
            }
            py::list out;
            for (int r = 0; r < rows; ++r) {
                const int32_t* o = res.data() + (size_t)r * words;
                if (o[0] < 0) {
                    raise_device_error();
                    throw std::runtime_error("CUDA top_k: error code " + std::to_string(o[0]));
                }
                if (o[0] > 0) {
                    out.append(py::none());
                    continue;
                }
                py::array_t<int64_t> ids(k);
                py::array_t<float> vals(k), gv(g);
                std::copy(o + 1, o + 1 + k, ids.mutable_data());
                std::memcpy(vals.mutable_data(), o + 1 + k, (size_t)k * 4);
                std::memcpy(gv.mutable_data(), o + 1 + 2 * k, (size_t)g * 4);
                out.append(py::make_tuple(ids, vals, gv));
            }
            return out;
        }, py::arg("pool"), py::arg("id"), py::arg("n"), py::arg("rows"), py::arg("k"), py::arg("gather"),
        "Sampling's candidates on the device, for each of `rows` consecutive rows of n values: "
        "(ids, values, gathered) with the k best ids best first (ties: lower index first, as top_k), "
        "their values and the row's values at the row's gather ids (-1: none, 0.0); None for a row "
        "holding NaN or Inf. Two launches, one readback, one wait.");

    m.def("mask_rows", [](DevPool& pool, int id, int64_t n, int rows,
                          py::array_t<int32_t, py::array::c_style | py::array::forcecast> which,
                          py::array_t<int32_t, py::array::c_style | py::array::forcecast> words) {
            const int64_t nw = (n + 31) / 32;
            const int m = (int)which.size();
            if (which.ndim() != 1 || m < 1 || m > rows || m > kArgmaxMaxRows)
                throw py::value_error("mask_rows: 1.." + std::to_string(std::min(rows, kArgmaxMaxRows)) + " row ids");
            if (words.ndim() != 2 || words.shape(0) != m || words.shape(1) != nw)
                throw py::value_error("mask_rows: words must be (row ids) x ceil(n / 32)");
            for (int j = 0; j < m; ++j)
                if (which.data()[j] < 0 || which.data()[j] >= rows) throw py::value_error("mask_rows: a row id outside the rows");
            LaneGuard g(pool);
            pool.check_range(id, 0, (size_t)n * rows * 4);
            Context& c = ctx();
            Lane& l = lane();
            py::gil_scoped_release nogil;
            // Row ids then words, staged through the lane's pinned buffer; the event says the
            // last call's copy out of it is done before it is written again (or replaced).
            const size_t need = ((size_t)m + (size_t)m * nw) * 4;
            if (!l.mask_copied) MC_CHECK(cudaEventCreateWithFlags(&l.mask_copied, cudaEventDisableTiming));
            MC_CHECK(cudaEventSynchronize(l.mask_copied));
            l.mask.grow(need);
            int32_t *dev = (int32_t*)l.mask.dev, *pin = (int32_t*)l.mask.pin;
            std::memcpy(pin, which.data(), (size_t)m * 4);
            std::memcpy(pin + m, words.data(), (size_t)m * nw * 4);
            MC_CHECK(cudaMemcpyAsync(dev, pin, need, cudaMemcpyHostToDevice, l.stream));
            MC_CHECK(cudaEventRecord(l.mask_copied, l.stream));
            ++c.c.h2d;
            c.c.h2d_bytes += need;
            mask_rows((float*)pool.data(id), n, m, dev, (const uint32_t*)(dev + m));
            forget_pick();  // an argmax a graph took is of the unmasked row
        }, py::arg("pool"), py::arg("id"), py::arg("n"), py::arg("rows"), py::arg("which"), py::arg("words"),
        "Token masks applied in place to rows `which` of `rows` consecutive rows of n values: the "
        "ids whose bit (words[j], little-endian bits of ceil(n/32) words) is 0 get a value below "
        "every logit, so the picks that follow choose allowed ids only. No wait.");

    // Boundary copies for every pair that involves a device pool.
    m.def("copy_buffer", [](DevPool& src, int src_id, DevPool& dst, int dst_id, size_t nbytes) {
            LaneGuard g(dst.own_lane(), src.own_lane());
            src.check_range(src_id, 0, nbytes);
            dst.check_range(dst_id, 0, nbytes);
            Lane &d = *dst.own_lane(), &s = *src.own_lane();
            // On dst's stream, where its readers are ordered; from another pool's, after
            // what src's stream wrote so far, and before anything src's stream does next.
            auto handoff = [](Lane& from, Lane& to) {
                if (!from.handoff) MC_CHECK(cudaEventCreateWithFlags(&from.handoff, cudaEventDisableTiming));
                MC_CHECK(cudaEventRecord(from.handoff, from.stream));
                MC_CHECK(cudaStreamWaitEvent(to.stream, from.handoff, 0));
            };
            if (&s != &d) handoff(s, d);
            MC_CHECK(cudaMemcpyAsync(dst.data(dst_id), src.data(src_id), nbytes, cudaMemcpyDeviceToDevice, d.stream));
            if (&s != &d) handoff(d, s);
            ++ctx().c.d2d;
            forget_pick();
        }, py::arg("src"), py::arg("src_id"), py::arg("dst"), py::arg("dst_id"), py::arg("nbytes"));
    m.def("copy_buffer", [](DevPool& src, int src_id, cpu::Pool& dst, int dst_id, size_t nbytes) {
            LaneGuard g(src);
            check_host_range(dst, dst_id, nbytes);
            const void* p;
            {
                py::gil_scoped_release nogil;
                p = src.fetch(src_id, nbytes, 0);
            }
            std::memcpy(dst.data(dst_id), p, nbytes);
        }, py::arg("src"), py::arg("src_id"), py::arg("dst"), py::arg("dst_id"), py::arg("nbytes"));
    m.def("copy_buffer", [](cpu::Pool& src, int src_id, DevPool& dst, int dst_id, size_t nbytes) {
            LaneGuard g(dst);
            check_host_range(src, src_id, nbytes);
            dst.write(dst_id, src.data(src_id), nbytes, 0);
        }, py::arg("src"), py::arg("src_id"), py::arg("dst"), py::arg("dst_id"), py::arg("nbytes"));

    m.attr("CUDA_ROW_EXACT_MAX_TOKENS") = py::int_(kRowExactMaxTokens);
    m.def("cuda_device_count", []() {
            std::string why;
            int n = device_count(&why);
            return py::make_tuple(n, why);
        }, "(number of visible CUDA devices, reason when 0)");
    m.def("cuda_device_name", &device_name);
    testing.def("cuda_profile", []() {
            py::dict d;
            for (const auto& [k, e] : take_profile()) d[py::str(k)] = py::make_tuple(e.ms, e.count, e.bytes);
            return d;
        }, "{launch kind: (ms, count, weight bytes)} timed under MINFER_CUDA_PROFILE=1; clears the totals.");
    m.def("cuda_sync", []() {
            ctx();
            for (const std::shared_ptr<Lane>& l : live_lanes()) {
                LaneGuard g(l);  // never inside another thread's capture on it
                py::gil_scoped_release nogil;
                sync_stream();
                raise_device_error();
            }
        }, "Waits for every lane's work so far (every context's, and the default lane's); raises the "
           "device error any of them flagged.");
    testing.def("cuda_counters", []() {
            const Counters& k = ctx().c;
            py::dict d;
            d["launches"] = k.launches.load();
            d["graph_launches"] = k.graph_launches.load();
            d["captures"] = k.captures.load();
            d["h2d"] = k.h2d.load();
            d["d2h"] = k.d2h.load();
            d["d2d"] = k.d2d.load();
            d["h2d_bytes"] = k.h2d_bytes.load();
            d["d2h_bytes"] = k.d2h_bytes.load();
            d["syncs"] = k.syncs.load();
            d["allocs"] = k.allocs.load();
            d["staged"] = k.staged.load();
            d["x4"] = k.x4.load();
            d["pair"] = k.pair.load();
            d["mmq"] = k.mmq.load();
            return d;
        });
    testing.def("cuda_replay_probe", [](const Plan& plan, DevPool& pool, int input_id, int reps) {
            LaneGuard g(pool);
            // The input's H2D as a decode step makes it: from its pinned mirror (made by
            // a write), its whole buffer.
            const size_t n = pool.size(input_id);
            const void* src = pool.fetch(input_id, n, 0);
            py::gil_scoped_release nogil;
            return replay_probe(plan, pool.data(input_id), src, n, reps);
        }, py::arg("plan"), py::arg("pool"), py::arg("input_id"), py::arg("reps") = 128,
        "Medians (us) of {launch, sync}, {H2D, launch, sync}, {H2D, sync} and launches-ahead per replay.");
    testing.def("cuda_d2h_probe", [](size_t nbytes, int reps) {
            py::gil_scoped_release nogil;
            return d2h_probe(nbytes, reps);
        }, py::call_guard<LaneGuard>(), py::arg("nbytes"), py::arg("reps") = 64,
        "Medians (us) of an nbytes D2H + wait: copy engine, then SM copies with 132, 264, 528 blocks.");
    testing.def("cuda_timeline", [](bool reset) -> py::object {
            // None unless built with MINFER_CUDA_TIMELINE (cuda/timeline.h).
            if (!cuda::tl::built()) return py::none();
            const auto recs = cuda::tl::read(reset);
            py::list out;
            for (const auto& r : recs) {
                py::array_t<uint64_t> a({(py::ssize_t)(r.size() / cuda::tl::kWords), (py::ssize_t)cuda::tl::kWords});
                std::copy(r.begin(), r.end(), a.mutable_data());
                out.append(a);
            }
            return out;
        }, py::arg("reset") = true,
        "The in-kernel timeline's records per kind ([marks..., t0 ns, t1 ns, blocks, sm]), or None.");
    testing.def("cuda_reset_counters", []() { ctx().c.reset(); });
    testing.def("cuda_stream_id", [](DevPool& pool) { return (uintptr_t)pool.own_lane()->stream; }, py::arg("pool"),
                "The handle of the stream the pool's work runs on (its lane's), as an int.");
    // Blocks of at least n token columns take the tensor-core matmul (k_mmq.cu); returns
    // the old n. Tests set a large n to compare with the matvec's column launches.
    testing.def("cuda_set_mmq_min_cols", [](int n) {
        const int old = mmq_min_cols();
        mmq_min_cols() = n;
        return old;
    });
    // Launches of 2 to 8 columns of rows of at least n units take the four-rows-a-block
    // layout (k_matvec_x4); returns the old n.
    testing.def("cuda_set_x4_cols_units", [](int n) {
        const int old = x4_cols_min_units();
        x4_cols_min_units() = n;
        return old;
    });
    testing.def("cuda_weight_bytes", [](PyWeightStore& ws) { return mirror_of(ws).bytes; });
    testing.def("cuda_mem_info", []() {
            ctx();
            size_t fr = 0, tot = 0;
            MC_CHECK(cudaMemGetInfo(&fr, &tot));
            return py::make_tuple(fr, tot);
        });
    testing.def("cuda_copy_bandwidth", [](size_t nbytes, int reps) {
            py::gil_scoped_release nogil;
            return copy_bandwidth(nbytes, reps);
        }, py::call_guard<LaneGuard>(), py::arg("nbytes") = (size_t)1 << 30, py::arg("reps") = 10,
        "Device-to-device copy bandwidth in bytes/s (read + write), measured with CUDA events.");
}

}  // namespace minfer
