"""The CUDA backend's registry entry (id 2, priority 200). Its kernels are not compiled
into this build, so naming it is a clear refusal."""

from minfer.graph.backend import CUDA_ID, unavailable_entry

ENTRY = unavailable_entry("cuda", CUDA_ID, 200)
