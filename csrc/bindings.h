// Per-backend halves of minfer._core. bindings.cpp binds the shared plan format and
// calls each compiled backend's register function; a backend binds its own pool,
// weight registration, run and host I/O, plus test-only hooks into _core.testing.
#pragma once
#include <pybind11/pybind11.h>

namespace minfer {

void register_cpu(pybind11::module_& m);
void register_cpu_testing(pybind11::module_& testing);

}  // namespace minfer
