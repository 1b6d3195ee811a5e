"""Architectures minfer runs. load_model dispatches on general.architecture."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minfer.errors import UnsupportedModelError

if TYPE_CHECKING:
    from minfer.io.gguf_file import GGUFFile
    from minfer.models.base import ModelDef


def _registry() -> dict[str, type]:
    from minfer.models.gemma import Gemma2Model, Gemma3Model
    from minfer.models.llama import LlamaModel
    from minfer.models.phi3 import Phi3Model
    from minfer.models.qwen2 import Qwen2Model
    from minfer.models.qwen3 import Qwen3Model
    from minfer.models.qwen2moe import Qwen2MoeModel  # mixture of experts (models/moe.py)
    from minfer.models.qwen3moe import Qwen3MoeModel

    return {"qwen2": Qwen2Model, "qwen3": Qwen3Model, "llama": LlamaModel, "gemma2": Gemma2Model, "gemma3": Gemma3Model,
            "phi3": Phi3Model,
            "qwen2moe": Qwen2MoeModel, "qwen3moe": Qwen3MoeModel}


SUPPORTED_ARCHITECTURES = ("qwen2", "qwen3", "llama", "gemma2", "gemma3", "phi3", "qwen2moe", "qwen3moe")


def load_model(gguf: GGUFFile) -> ModelDef:
    arch = gguf.metadata.get("general.architecture")
    if arch is None:
        raise UnsupportedModelError(
            f"{gguf.path}: the file has no general.architecture key, so it does not say which "
            f"model it holds (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    models = _registry()
    if arch not in models:
        raise UnsupportedModelError(
            f"{gguf.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return models[arch](gguf)
