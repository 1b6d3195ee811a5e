"""The Metal backend's registry entry (id 1, priority 300). Metal is Apple-only and not
compiled into this build, so naming it is a clear refusal."""

from minfer.graph.backend import METAL_ID, unavailable_entry

ENTRY = unavailable_entry("metal", METAL_ID, 300)
