"""minfer: a local LLM inference engine. Python decides, C++ executes."""

import os as _os

__version__ = "0.1.0"

# OpenMP workers spin only briefly after a plan run, then sleep: long enough to catch
# the next decode step (the Python between steps takes ~0.2 ms), short enough not to
# burn a core the rest of the time. (Read by libgomp when _core loads it; a user's
# own setting wins.)
_os.environ.setdefault("GOMP_SPINCOUNT", "100000")

# Developers can point at a separately built compiled core (a cmake build dir holding
# _core*.so) without reinstalling: MINFER_CORE_DIR=/tmp/build-x python -m pytest ...
if _os.environ.get("MINFER_CORE_DIR"):
    __path__.insert(0, _os.environ["MINFER_CORE_DIR"])  # noqa: F821  (package __path__)

from minfer.errors import MinferError  # noqa: E402

__all__ = ["LLM", "Completion", "MinferError", "Token", "__version__", "load"]


def __getattr__(name: str):
    # The API pulls in numpy and the compiled core: only when it is asked for, so that
    # `import minfer` stays cheap for the CLI's argument checks. Imported by name: every
    # module imports this package, and a static import here would put the API (the top
    # layer) under each of them in the layering contract.
    if name in ("load", "LLM", "Completion", "Token"):
        import importlib

        return getattr(importlib.import_module("minfer.api"), name)
    raise AttributeError(f"module 'minfer' has no attribute {name!r}")
