"""The Metal backend's registry entry (id 1, priority 300). Metal is Apple-only and not
compiled into this build, so naming it is a clear refusal."""

from minfer.graph.registry import METAL_ID, uncompiled_entry

ENTRY = uncompiled_entry("metal", METAL_ID, 300)
