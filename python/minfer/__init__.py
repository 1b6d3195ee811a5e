"""minfer: a local LLM inference engine. Python decides, C++ executes."""

import os as _os

__version__ = "0.1.0"

# Worker threads sleep between plan runs instead of spinning: between decode steps the
# main thread is in Python, and on a busy machine a spinning OpenMP team steals the
# cores the next step needs. Inside a run the executor's own barrier spins briefly.
# (Read by libgomp when _core loads it; a user's own setting wins.)
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Developers can point at a separately built compiled core (a cmake build dir holding
# _core*.so) without reinstalling: MINFER_CORE_DIR=/tmp/build-x python -m pytest ...
if _os.environ.get("MINFER_CORE_DIR"):
    __path__.insert(0, _os.environ["MINFER_CORE_DIR"])  # noqa: F821  (package __path__)

from minfer.errors import MinferError  # noqa: E402

__all__ = ["MinferError", "__version__"]
