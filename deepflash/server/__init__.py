"""OpenAI-compatible HTTP server: `deepflash serve`, or `deepflash.server.app.create_app` for an Engine in hand.

app.py routes requests, worker.py runs them one at a time on the engine, protocol.py speaks the OpenAI
wire format, errors.py maps failures to OpenAI error bodies, metrics.py exports Prometheus metrics.
Only the command is imported here, so that the CLI starts without loading FastAPI.
"""

from .command import register

__all__ = ["register"]
