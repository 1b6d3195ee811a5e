// Per-backend halves of minfer._core. bindings.cpp binds the shared plan format and
// calls each compiled backend's register function; a backend binds its own pool,
// weight registration, run and host I/O, plus test-only hooks into _core.testing.
#pragma once
#include <pybind11/pybind11.h>

namespace minfer {

void register_cpu(pybind11::module_& m);
void register_cpu_testing(pybind11::module_& testing);
// csrc/cuda/bindings_layout.cpp (every build): the CUDA weight-row layout's packing, for
// tests that need no GPU.
void register_cuda_layout_testing(pybind11::module_& testing);
#ifdef MINFER_HAS_CUDA
// csrc/cuda/bindings_cuda.cpp: CudaPool, cuda_validate/cuda_run, device argmax, copies
// between host and device pools; counters and profiles into _core.testing.
void register_cuda(pybind11::module_& m, pybind11::module_& testing);
#endif

}  // namespace minfer
