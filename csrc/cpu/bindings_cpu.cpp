// The CPU backend's half of minfer._core: host buffer pools, weights registered by
// reference (zero-copy views of the GGUF mmap), plan validation and execution, and the
// host-side helpers of the decode loop.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>
#include <stdexcept>

#include "bindings.h"
#include "common/plan.h"
#include "cpu/executor.h"
#include "cpu/ops.h"
#include "cpu/pool.h"
#include "cpu/quants.h"
#include "cpu/quants_k.h"
#include "cpu/quantize.h"
#include "cpu/repack.h"
#include "cpu/repack_k.h"
#include "cpu/step_stats.h"
#include "cpu/thread_pin.h"
#include "cpu/work_split.h"
#include "py_weight_store.h"

namespace py = pybind11;

namespace minfer {

using namespace minfer::cpu;

namespace {

py::dtype dtype_of(const std::string& name) { return py::dtype(name); }

// Whether an array's memory is an mmap.mmap of a file opened read-only (the GGUF), by
// walking its base objects (ndarray views, memoryviews) to the owner.
bool is_file_mapping(const py::array& a) {
    static const py::object mmap_type = py::module_::import("mmap").attr("mmap");
    py::object o = a.attr("base");
    for (int i = 0; i < 32 && !o.is_none(); ++i) {
        if (py::isinstance(o, mmap_type)) return true;
        if (PyMemoryView_Check(o.ptr())) o = o.attr("obj");
        else if (py::isinstance<py::array>(o)) o = o.attr("base");
        else return false;
    }
    return false;
}

void check_range(const Pool& pool, int id, size_t offset, size_t nbytes) {
    size_t sz = pool.size(id);
    if (offset > sz || nbytes > sz - offset)
        throw std::out_of_range("pool " + pool.name() + ": buffer " + std::to_string(id) + " holds " +
                                std::to_string(sz) + " bytes; access of " + std::to_string(nbytes) + " at offset " +
                                std::to_string(offset));
}

py::dict cpu_features() {
    py::dict d;
#if defined(__AVX512F__)
    d["avx512f"] = true;
#else
    d["avx512f"] = false;
#endif
#if defined(__AVX512VNNI__)
    d["avx512_vnni"] = true;
#else
    d["avx512_vnni"] = false;
#endif
#if defined(__AVX2__)
    d["avx2"] = true;
#else
    d["avx2"] = false;
#endif
#if defined(__FMA__)
    d["fma"] = true;
#else
    d["fma"] = false;
#endif
#if defined(__F16C__)
    d["f16c"] = true;
#else
    d["f16c"] = false;
#endif
#if defined(__ARM_NEON)
    d["neon"] = true;
#else
    d["neon"] = false;
#endif
    d["simd_path"] = simd_path_name();
    return d;
}

// minfer quantize (python/minfer/tools/quantize.py): f32 rows <-> GGUF blocks, threaded.
int32_t quant_type_arg(const py::object& t) {
    int32_t id = py::isinstance<py::str>(t) ? qz::type_from_name(t.cast<std::string>()) : t.cast<int32_t>();
    if (id < 0) throw std::invalid_argument("unknown tensor type " + py::str(t).cast<std::string>());
    return id;
}

void register_quantize(py::module_& m) {
    m.def("quantize", [](const py::object& type, py::array_t<float, py::array::c_style | py::array::forcecast> x,
                         int n_threads) {
            const int32_t t = quant_type_arg(type);
            if (!qz::can_quantize(t)) throw std::invalid_argument(std::string("cannot quantize to ") + qz::type_name(t));
            if (x.ndim() != 2) throw std::invalid_argument("quantize: x must be 2-D (rows, row length)");
            const int64_t nrows = x.shape(0), n = x.shape(1);
            const size_t rb = qz::row_bytes(t, n);
            if (rb == 0)
                throw std::invalid_argument("quantize: row length " + std::to_string(n) + " is not a multiple of the " +
                                            qz::type_name(t) + " block size " + std::to_string(qz::type_block(t)));
            py::array_t<uint8_t> out({(py::ssize_t)nrows, (py::ssize_t)rb});
            {
                py::gil_scoped_release nogil;
                qz::quantize_rows(t, x.data(), nrows, n, out.mutable_data(), n_threads);
            }
            return out;
        }, py::arg("type"), py::arg("x"), py::arg("n_threads") = 1,
        "f32 rows [rows, n] -> uint8 [rows, row bytes] of TYPE (a name like 'Q4_K' or a GGUF type id), "
        "bit for bit as ggml's reference quantizers; rows split over n_threads threads.");
    m.def("dequantize", [](const py::object& type, py::array_t<uint8_t, py::array::c_style> raw, int64_t n,
                           int n_threads) {
            const int32_t t = quant_type_arg(type);
            if (!qz::can_dequantize(t)) throw std::invalid_argument(std::string("cannot dequantize ") + qz::type_name(t));
            const size_t rb = qz::row_bytes(t, n);
            if (rb == 0)
                throw std::invalid_argument("dequantize: row length " + std::to_string(n) + " is not a multiple of the " +
                                            qz::type_name(t) + " block size " + std::to_string(qz::type_block(t)));
            if ((size_t)raw.nbytes() % rb)
                throw std::invalid_argument("dequantize: " + std::to_string(raw.nbytes()) + " bytes is not a whole number of " +
                                            std::to_string(rb) + "-byte rows");
            const int64_t nrows = (int64_t)((size_t)raw.nbytes() / rb);
            py::array_t<float> out({(py::ssize_t)nrows, (py::ssize_t)n});
            {
                py::gil_scoped_release nogil;
                qz::dequantize_rows(t, raw.data(), nrows, n, out.mutable_data(), n_threads);
            }
            return out;
        }, py::arg("type"), py::arg("raw"), py::arg("n"), py::arg("n_threads") = 1,
        "GGUF blocks of TYPE (rows of n elements, bytes in any shape) -> f32 [rows, n], as ggml dequantizes.");
}

}  // namespace

void register_cpu(py::module_& m) {
    py::class_<Pool>(m, "Pool")
        .def(py::init<std::string>(), py::arg("name"))
        .def_property_readonly("name", &Pool::name)
        .def("alloc", &Pool::alloc, py::arg("nbytes"))
        .def("alloc_fresh", &Pool::alloc_fresh, py::arg("nbytes"))
        .def("free", &Pool::free, py::arg("id"))
        .def("size", &Pool::size, py::arg("id"))
        .def("count", &Pool::count)
        .def("bytes_total", &Pool::bytes_total)
        .def("write", [](Pool& p, int id, py::array data, size_t offset) {
                if (!(data.flags() & py::array::c_style)) throw std::invalid_argument("write needs a C-contiguous array");
                size_t nbytes = (size_t)data.nbytes();
                check_range(p, id, offset, nbytes);
                std::memcpy(p.data(id) + offset, data.data(), nbytes);
            }, py::arg("id"), py::arg("data"), py::arg("offset") = 0)
        .def("read", [](const Pool& p, int id, const std::string& dtype, py::ssize_t count, size_t offset) {
                py::dtype dt = dtype_of(dtype);
                size_t nbytes = (size_t)count * dt.itemsize();
                check_range(p, id, offset, nbytes);
                py::array out(dt, std::vector<py::ssize_t>{count});
                std::memcpy(out.mutable_data(), p.data(id) + offset, nbytes);
                return out;
            }, py::arg("id"), py::arg("dtype"), py::arg("count"), py::arg("offset") = 0)
        .def("view", [](py::object self, int id, const std::string& dtype, py::ssize_t count, size_t offset) {
                // Zero-copy, read-only window: valid until the buffer is next written
                // (the next run). Saves a copy of the logits on every decode step.
                Pool& p = self.cast<Pool&>();
                py::dtype dt = dtype_of(dtype);
                check_range(p, id, offset, (size_t)count * dt.itemsize());
                py::array out(dt, std::vector<py::ssize_t>{count}, std::vector<py::ssize_t>{(py::ssize_t)dt.itemsize()},
                              p.data(id) + offset, self);
                py::detail::array_proxy(out.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
                return out;
            }, py::arg("id"), py::arg("dtype"), py::arg("count"), py::arg("offset") = 0)
        .def("copy_within", [](Pool& p, int id, size_t src_off, size_t dst_off, size_t nbytes) {
                check_range(p, id, src_off, nbytes);
                check_range(p, id, dst_off, nbytes);
                std::memmove(p.data(id) + dst_off, p.data(id) + src_off, nbytes);
            }, py::arg("id"), py::arg("src_off"), py::arg("dst_off"), py::arg("nbytes"),
            "Bytes moved inside one buffer (KV cells from one sequence's range to another's).");

    m.def("copy_buffer", [](const Pool& src, int src_id, Pool& dst, int dst_id, size_t nbytes) {
            check_range(src, src_id, 0, nbytes);
            check_range(dst, dst_id, 0, nbytes);
            std::memcpy(dst.data(dst_id), src.data(src_id), nbytes);
        }, py::arg("src"), py::arg("src_id"), py::arg("dst"), py::arg("dst_id"), py::arg("nbytes"),
        "Copy nbytes from one pool buffer to another (a split-boundary transfer).");

    py::class_<PyWeightStore>(m, "WeightStore")
        .def(py::init<>())
        .def("add", [](PyWeightStore& s, const std::string& name, py::array data, int type, int64_t ne0, int64_t ne1) {
                if (!(data.flags() & py::array::c_style)) throw std::invalid_argument("weight " + name + ": data must be C-contiguous");
                if (!weight_type_supported(type))
                    throw std::invalid_argument("weight " + name + ": unsupported tensor type " + std::to_string(type));
                Weight w{(const uint8_t*)data.data(), (size_t)data.nbytes(), type, ne0, ne1, 0, name};
                w.file_backed = is_file_mapping(data);
                int h = s.store.add(std::move(w));
                s.keep.append(data);
                return h;
            }, py::arg("name"), py::arg("data"), py::arg("type"), py::arg("ne0"), py::arg("ne1"),
            "Register a weight by reference (zero copy); returns its handle.")
        .def("__len__", [](const PyWeightStore& s) { return s.store.count(); });

    m.def("validate", [](const Plan& plan, const Pool& pool, const PyWeightStore& ws) {
            validate_plan(plan, pool, ws.store);
        }, py::arg("plan"), py::arg("pool"), py::arg("weights"));

    m.def("run", [](const Plan& plan, Pool& pool, const PyWeightStore& ws, int n_threads, size_t begin, int64_t end) {
            py::gil_scoped_release nogil;
            run_plan(plan, pool, ws.store, n_threads, begin, end < 0 ? (size_t)-1 : (size_t)end);
        }, py::arg("plan"), py::arg("pool"), py::arg("weights"), py::arg("n_threads"), py::arg("begin") = 0,
        py::arg("end") = -1, "Execute plan steps [begin, end) on one pool, GIL released.");

    m.def("step", [](const Plan& plan, Pool& pool, const PyWeightStore& ws, int n_threads, int tok_id, int pos_id,
                     int cell_id, int32_t tok, int32_t pos, int32_t cell) {
            const int ids[3] = {tok_id, pos_id, cell_id};
            const int32_t v[3] = {tok, pos, cell};
            for (int k = 0; k < 3; ++k) {
                check_range(pool, ids[k], 0, sizeof(int32_t));
                std::memcpy(pool.data(ids[k]), &v[k], sizeof(int32_t));
            }
            py::gil_scoped_release nogil;
            run_plan(plan, pool, ws.store, n_threads, 0, (size_t)-1);
        }, py::arg("plan"), py::arg("pool"), py::arg("weights"), py::arg("n_threads"), py::arg("tok_buf"),
        py::arg("pos_buf"), py::arg("cell_buf"), py::arg("token"), py::arg("position"), py::arg("cell"),
        "A decode step in one call: its three one-int inputs written, then the whole plan run, GIL released.");

    m.def("prepare", [](const Plan& plan, const PyWeightStore& ws, int n_threads) {
            py::gil_scoped_release nogil;
            prepare_weights(plan, ws.store, n_threads);
        }, py::arg("plan"), py::arg("weights"), py::arg("n_threads"),
        "Repack the plan's matmul weights now (its first run would), GIL released.");
    m.def("argmax", [](const Pool& pool, int id, int64_t n, int n_threads) {
            // Greedy decoding's argmax over the logits, split across threads the way the
            // matmul split its rows, so each thread scans the half its own core wrote
            // (reading it all from one core costs ~200 us of cache-line transfers).
            check_range(pool, id, 0, (size_t)n * 4);
            const float* x = (const float*)pool.data(id);
            py::gil_scoped_release nogil;
            return argmax_f32(x, n, n_threads);
        }, py::arg("pool"), py::arg("id"), py::arg("n"), py::arg("n_threads"));
    m.def("argmax_rows", [](const Pool& pool, int id, int64_t n, int rows, int n_threads) {
            // A verified speculative block's picks, row by row as argmax above (-1 for a
            // row holding NaN or Inf).
            if (rows < 1) throw std::invalid_argument("argmax_rows: rows must be >= 1");
            check_range(pool, id, 0, (size_t)n * rows * 4);
            const float* x = (const float*)pool.data(id);
            std::vector<int64_t> picks(rows);
            {
                py::gil_scoped_release nogil;
                for (int r = 0; r < rows; ++r) picks[r] = argmax_f32(x + (size_t)r * n, n, n_threads);
            }
            return picks;
        }, py::arg("pool"), py::arg("id"), py::arg("n"), py::arg("rows"), py::arg("n_threads"));
    m.def("top_k", [](py::array_t<float, py::array::c_style> row, int64_t k) -> py::object {
            // Sampling's candidates: sorting a 152k-entry vocabulary to keep 40 of it
            // took milliseconds in NumPy, longer than a GPU decode step.
            if (row.ndim() != 1) throw std::invalid_argument("top_k: needs a 1-D float32 row");
            if (k < 1) throw std::invalid_argument("top_k: k must be >= 1");
            const int64_t n = row.shape(0);
            py::array_t<int64_t> ids(std::min(k, n));
            const float* x = row.data();
            int64_t* out = ids.mutable_data();
            bool finite;
            {
                py::gil_scoped_release nogil;
                finite = top_k_finite(x, n, k, out);
            }
            return finite ? py::object(ids) : py::none();
        }, py::arg("row"), py::arg("k"),
        "Indices of the min(k, n) largest values, best first (ties: lower index first); None when a value "
        "is NaN or Inf.");
    m.def("weight_type_supported", &weight_type_supported);
    register_quantize(m);
}

void register_cpu_testing(py::module_& t) {
    t.def("dequantize_row", [](int type, py::array_t<uint8_t, py::array::c_style> src, int64_t n) {
            size_t rb = type_row_bytes(type, n);
            if (rb == 0 || (size_t)src.size() < rb) throw std::invalid_argument("dequantize_row: bad type/size");
            py::array_t<float> out(n);
            {
                py::gil_scoped_release nogil;
                dequantize_row(type, src.data(), out.mutable_data(), n);
            }
            return out;
        }, py::arg("type"), py::arg("src"), py::arg("n"));
    t.def("cpu_features", &cpu_features);
    t.def("set_kernel_path", [](const std::string& p) {
            if (p == "scalar") set_kernel_path(KernelPath::Scalar);
            else if (p == "simd") set_kernel_path(KernelPath::Simd);
            else throw std::invalid_argument("kernel path must be 'scalar' or 'simd'");
        });
    t.def("kernel_path", []() { return kernel_path() == KernelPath::Scalar ? "scalar" : "simd"; });
    // Whether the SIMD matmul of this build reads weights of a type from a repacked copy
    // (cpu/repack.h), so tests know which kernel they pin.
    t.def("repack_packable", [](int type) { return repack::packable(type); }, py::arg("type"));
    t.def("repack_token_tile", &repack::token_tile);
    // K-quant prefill on the AMX tiles (cpu/repack_k.h): whether this build and OS run it,
    // and a switch so tests can compare it with the vector kernel, bitwise.
    t.def("cpu_amx_available", &repack::k::amx_available);
    t.def("cpu_set_amx", &repack::k::set_amx, py::arg("on"));
    t.def("cpu_amx_calls", &repack::k::amx_calls);
    // Q8_K activation bytes of x (a multiple of 256 floats) from the SIMD or the scalar
    // quantizer: the two must agree byte for byte.
    t.def("quantize_q8_K", [](py::array_t<float, py::array::c_style> x, bool simd) {
            const int64_t n = (int64_t)x.size();
            if (n % QK_K) throw std::invalid_argument("quantize_q8_K: length must be a multiple of 256");
            py::array_t<uint8_t> out((py::ssize_t)type_row_bytes(T_Q8_K, n));
            kq::quantize_row_q8_K(x.data(), (block_q8_K*)out.mutable_data(), n, simd);
            return out;
        }, py::arg("x"), py::arg("simd"));
    // Thread placement (cpu/thread_pin.h): the order workers take the caller's CPUs in,
    // and the CPUs each thread of an n-thread team may use right now (OpenMP keeps its
    // workers between regions, so this shows what the last run left them with).
    t.def("cpu_pin_order", &pin::cpu_order);
    t.def("thread_masks", [](int n_threads) {
            py::gil_scoped_release nogil;
            return pin::team_masks(n_threads);
        }, py::arg("n_threads"));
    // Per-op thread time of the plan runs since the last reset, when the process runs
    // with MINFER_CPU_STATS=1 (cpu/step_stats.h; bench/cpu_balance.py reads it).
    t.def("cpu_stats", [](bool reset) {
            const stats::Totals tot = stats::take(reset);
            py::dict ops;
            for (const auto& [name, o] : tot.ops) {
                py::dict d;
                d["steps"] = o.steps;
                d["work_s"] = o.work_s;
                d["crit_s"] = o.crit_s;
                d["wait_s"] = o.wait_s;
                d["stolen"] = o.stolen;
                ops[py::str(name)] = d;
            }
            py::dict out;
            out["enabled"] = stats::enabled();
            out["runs"] = tot.runs;
            out["threads"] = tot.threads;
            out["wall_s"] = tot.wall_s;
            out["barriers"] = tot.barriers;
            out["ops"] = ops;
            return out;
        }, py::arg("reset") = true);
    // The stealing walk of the repacked matmul (cpu/work_split.h) on nth threads, thread
    // `slow` starting delay_ms late: per thread the (r0, r1, t0, t1, stolen) rectangles it
    // computed, in order.
    t.def("steal_walk", [](int64_t out, int64_t nt, int64_t tile, int nth, int slow, double delay_ms) {
            std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, bool>>> got(nth);
            std::unique_ptr<std::atomic<uint64_t>[]> state(new std::atomic<uint64_t>[nth]);
            for (int i = 0; i < nth; ++i) state[i].store(0);
            py::gil_scoped_release nogil;
            #pragma omp parallel num_threads(nth)
            {
                const int ith = omp_get_thread_num();
                if (ith == slow) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(delay_ms));
                steal_walk(out, nt, tile, ith, nth, state.get(),
                           [&](const Rect& R, bool stolen) { got[ith].emplace_back(R.r0, R.r1, R.t0, R.t1, stolen); });
            }
            return got;
        }, py::arg("out"), py::arg("nt"), py::arg("tile"), py::arg("nth"), py::arg("slow") = -1,
        py::arg("delay_ms") = 0.0);
    // The repacked matmul's work split (cpu/work_split.h), for every thread of nth: lists
    // of (r0, r1, t0, t1), so tests can check coverage and balance at any thread count.
    t.def("matmul_split", [](int64_t out, int64_t nt, int64_t tile, int nth) {
            std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>> all(nth);
            for (int i = 0; i < nth; ++i) {
                Rect r[3];
                const int k = matmul_split(out, nt, tile, i, nth, r);
                for (int j = 0; j < k; ++j) all[i].emplace_back(r[j].r0, r[j].r1, r[j].t0, r[j].t1);
            }
            return all;
        }, py::arg("out"), py::arg("nt"), py::arg("tile"), py::arg("nth"));
}

}  // namespace minfer
