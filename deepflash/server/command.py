"""`deepflash serve`: load the model pair and serve it over the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse

from ..errors import UserError

GRACEFUL_SHUTDOWN_S = 10  # on Ctrl-C, running requests get this long; then they are cancelled


def register(sub: argparse._SubParsersAction) -> None:
    from ..engine.runtime import add_engine_args

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--queue-size", type=int, default=16,
                       help="requests that may wait for the engine; beyond that clients get 503 + Retry-After")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from ..engine.runtime import engine_config, load_runtime
    from .app import create_app

    if args.queue_size < 1:
        raise UserError(f"--queue-size must be >= 1, got {args.queue_size}")
    rt = load_runtime(engine_config(args))
    app = create_app(rt.engine, rt.tokenizer, rt.model_name, queue_size=args.queue_size, draft_name=rt.draft_name)
    try:
        uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    finally:
        # a forced quit (second Ctrl-C) skips the app's shutdown; a worker left inside a torch call
        # while the interpreter exits aborts the process
        app.state.worker.stop()
