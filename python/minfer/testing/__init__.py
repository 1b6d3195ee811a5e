"""Helpers for tests: synthetic models that exercise the real loading paths."""

from minfer.testing.synth import QWEN2_Q4_K_M_TYPES, ROLES, SynthConfig, write_model

__all__ = ["QWEN2_Q4_K_M_TYPES", "ROLES", "SynthConfig", "write_model"]
