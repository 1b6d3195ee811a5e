// _core.testing.cuda_pack_rows: the CUDA backend's weight-row packing (cuda/layout.h),
// host code built into every core, so the layout is tested without a GPU.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "bindings.h"
#include "cuda/layout.h"

namespace py = pybind11;

namespace minfer {

void register_cuda_layout_testing(py::module_& testing) {
    testing.def(
        "cuda_pack_rows",
        [](int32_t type, py::array_t<uint8_t, py::array::c_style | py::array::forcecast> raw, int64_t rows,
           int64_t in_dim) {
            if (!cuda::packed_layout(type)) throw std::invalid_argument("cuda_pack_rows: not a packed type");
            if (rows < 1 || raw.size() % rows) throw std::invalid_argument("cuda_pack_rows: raw is not rows whole rows");
            const size_t row_bytes = (size_t)raw.size() / (size_t)rows;
            const size_t stride = cuda::device_row_bytes(type, row_bytes);
            py::array_t<uint8_t> out({(py::ssize_t)rows, (py::ssize_t)stride});
            cuda::pack_rows(type, raw.data(), row_bytes, rows, in_dim, out.mutable_data());
            return out;
        },
        py::arg("type"), py::arg("raw"), py::arg("rows"), py::arg("in_dim"),
        "GGUF rows (rows x row_bytes) -> the device layout (rows x device row stride)");
}

}  // namespace minfer
