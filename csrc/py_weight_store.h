// The Python-facing WeightStore: the format's WeightStore plus the numpy arrays (mmap
// views of the GGUF) it points into, kept alive as long as the store. Bound by the CPU
// bindings; a device backend hangs its mirror of the weights off it.
#pragma once
#include <pybind11/pybind11.h>

#include <memory>

#include "common/plan.h"

namespace minfer {

struct PyWeightStore {
    WeightStore store;
    pybind11::list keep;
    // A device backend's copy of the weights (uploaded once per handle, kept in GGUF
    // blocks); owned here so it lives and dies with the host store it mirrors.
    std::shared_ptr<void> device_mirror;
};

}  // namespace minfer
