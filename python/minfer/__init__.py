"""minfer: a local LLM inference engine. Python decides, C++ executes."""

__version__ = "0.1.0"

from minfer.errors import MinferError  # noqa: E402

__all__ = ["MinferError", "__version__"]
