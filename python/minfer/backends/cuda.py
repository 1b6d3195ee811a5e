"""The CUDA backend's registry entry (id 2, priority 200). Its kernels are not compiled
into this build, so naming it is a clear refusal."""

from minfer.graph.registry import CUDA_ID, uncompiled_entry

ENTRY = uncompiled_entry("cuda", CUDA_ID, 200)
