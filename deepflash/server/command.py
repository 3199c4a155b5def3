"""`deepflash serve`: load the model pair and serve it over the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..errors import UserError

GRACEFUL_SHUTDOWN_S = 10  # on Ctrl-C, running requests get this long; then they are cancelled


def register(sub: argparse._SubParsersAction) -> None:
    from ..engine.runtime import add_engine_args

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--queue-size", type=int, default=16,
                       help="requests that may wait for the engine; beyond that clients get 503 + Retry-After")
    cache = serve.add_argument_group("prefix cache (KV, states and drafter features reused across requests)")
    cache.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt from its first token")
    cache.add_argument("--prefix-cache-mb", type=float,
                       help="its device memory in MiB (default: one context's worth, counted in the memory plan)")
    cache.add_argument("--prefix-cache-host-mb", type=float,
                       help="host memory in MiB that blocks move to before they are dropped (default: 4x the device "
                            "budget, at most a quarter of the host's memory; none on a CPU device)")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from ..engine.runtime import engine_config, load_runtime
    from .app import create_app

    if args.queue_size < 1:
        raise UserError(f"--queue-size must be >= 1, got {args.queue_size}")
    # the prefix cache saves whole-context KV, which a KV budget does not keep on the device (--kv-budget's help)
    prefix_cache = not args.no_prefix_cache and args.kv_budget is None
    config = replace(engine_config(args), prefix_cache=prefix_cache, prefix_cache_mb=args.prefix_cache_mb,
                     prefix_cache_host_mb=args.prefix_cache_host_mb)
    rt = load_runtime(config.validated())
    app = create_app(rt.engine, rt.tokenizer, rt.model_name, queue_size=args.queue_size, draft_name=rt.draft_name)
    try:
        uvicorn.run(app, host=args.host, port=args.port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    finally:
        # a forced quit (second Ctrl-C) skips the app's shutdown; a worker left inside a torch call
        # while the interpreter exits aborts the process
        app.state.worker.stop()
