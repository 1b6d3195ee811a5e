// minfer._core: the shared plan format, then one register_* per compiled backend.
// Kept deliberately small: Python decides (graph, fusion, allocation, splits), a
// backend executes a whole plan per call. Hooks only tests and benchmarks use live in
// the _core.testing submodule.
#include "bindings.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "common/plan.h"

namespace py = pybind11;
using namespace minfer;

PYBIND11_MODULE(_core, m) {
    m.doc() = "minfer compiled core: the plan format, and per backend its pools, weights and execution";

    py::class_<Plan>(m, "Plan")
        .def(py::init([](std::string name) { Plan p; p.name = std::move(name); return p; }), py::arg("name") = "")
        .def_readonly("name", &Plan::name)
        .def_readwrite("flags", &Plan::flags, "backend execution switches (CUDA: allowed step merges)")
        .def("add", [](Plan& p, int op, int node, const std::vector<int>& bufs, const std::vector<int64_t>& ip,
                       const std::vector<float>& fp, const std::vector<int>& w) {
                Step s;
                if (bufs.size() > 8 || ip.size() > 12 || fp.size() > 4 || w.size() > 4)
                    throw std::invalid_argument("plan step has too many fields");
                s.op = op;
                s.node = node;
                for (size_t i = 0; i < bufs.size(); ++i) s.buf[i] = bufs[i];
                for (size_t i = 0; i < ip.size(); ++i) s.ip[i] = ip[i];
                for (size_t i = 0; i < fp.size(); ++i) s.fp[i] = fp[i];
                for (size_t i = 0; i < w.size(); ++i) s.w[i] = w[i];
                p.add(s);
            }, py::arg("op"), py::arg("node"), py::arg("bufs"), py::arg("ip") = std::vector<int64_t>{},
            py::arg("fp") = std::vector<float>{}, py::arg("w") = std::vector<int>{})
        .def("__len__", [](const Plan& p) { return p.steps.size(); })
        .def("step_nodes", [](const Plan& p) {
                std::vector<int> v;
                for (const Step& s : p.steps) v.push_back(s.node);
                return v;
            });

    // Every op code of the format: a backend's lowering picks the ones it implements.
    py::dict ops;
    for (int op = OP_ADD; op <= OP_LAST; ++op)
        if (op_format(op)) ops[py::str(op_name(op))] = op;
    m.attr("OPS") = ops;

    py::module_ testing = m.def_submodule("testing", "hooks for tests and benchmarks only");
    register_cpu(m);
    register_cpu_testing(testing);
    register_cuda_layout_testing(testing);
#ifdef MINFER_HAS_CUDA
    m.attr("HAS_CUDA") = true;
    register_cuda(m, testing);
#else
    m.attr("HAS_CUDA") = false;
#endif
}
