"""`minfer serve`: an OpenAI-compatible HTTP server over one model.

app.py (routes, SSE), scheduler.py (slots and continuous batching on one thread),
protocol.py (request validation, OpenAI error bodies), metrics.py (Prometheus text),
runner.py (uvicorn with connection timeouts and a clean exit on SIGTERM/SIGINT).
"""

from minfer.server.runner import ServeConfig, build, serve

__all__ = ["ServeConfig", "build", "serve"]
