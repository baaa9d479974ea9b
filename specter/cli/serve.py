"""`specter serve`: the OpenAI-compatible HTTP server (specter/server) over one engine."""
from __future__ import annotations

import errno
import os
import re
import socket

from .. import pipeline
from ..errors import ConfigError
from .options import check_tokenizer, load_engine, model_args, pipeline_args, positive_int


def add_parsers(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                      "/v1/models, /health, /metrics)")
    model_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    sv.add_argument("--max-queue", type=int, default=32,
                    help="requests that may wait for the engine; more get 503 + Retry-After (default 32)")
    sv.add_argument("--model-name", default=None, help="model id clients send (default: the model directory's name)")
    sv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="require `Authorization: Bearer KEY` on /v1 routes (repeat for several keys; default: "
                         "SPECTER_API_KEY, comma-separated, else none)")
    sv.add_argument("--api-key-all-routes", action="store_true",
                    help="require the key on /health and /metrics too")
    sv.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                    help="comma-separated host names the Host header may name (its port aside), e.g. "
                         "api.example.com,*.example.com (default: any)")
    sv.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json (default: off)")
    sv.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                    help="largest request body; larger ones get 413 (default 4 MiB; 0 = no limit)")
    sv.add_argument("--max-tokens-default", type=positive_int, default=None, metavar="N",
                    help="tokens a request without max_tokens may generate (default: 16 for completions, the "
                         "rest of the context for chat)")
    sv.add_argument("--shutdown-grace", type=float, default=None, metavar="S",
                    help="on SIGINT/SIGTERM, seconds the running generation may go on before it is stopped "
                         "(default 10)")
    sv.add_argument("--timeout-keep-alive", type=float, default=5, metavar="S",
                    help="close a connection idle this long between requests (default 5)")
    sv.add_argument("--request-timeout", type=float, default=60, metavar="S",
                    help="close a connection whose request (headers and body) takes longer than this to arrive "
                         "(default 60)")
    sv.add_argument("--limit-concurrency", type=positive_int, default=None, metavar="N",
                    help="most requests answered at once, on any route (a stream until it ends); more get 503 "
                         "(default: no limit)")
    pipeline_args(sv)
    sv.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    if args.max_queue < 0 or not 0 <= args.port <= 65535:
        raise ConfigError("--max-queue must be >= 0 and --port in [0, 65535]")
    if args.max_request_bytes is not None and args.max_request_bytes < 0:
        raise ConfigError("--max-request-bytes must be >= 0 (0 = no limit)")
    if args.shutdown_grace is not None and not args.shutdown_grace >= 0:
        raise ConfigError("--shutdown-grace must be a number of seconds >= 0")
    if not (args.timeout_keep_alive > 0 and args.request_timeout > 0):
        raise ConfigError("--timeout-keep-alive and --request-timeout must be a number of seconds > 0")
    keys = args.api_key if args.api_key else [k.strip() for k in os.environ.get("SPECTER_API_KEY", "").split(",")]
    keys = [k for k in keys if k]
    if args.api_key and len(keys) < len(args.api_key):
        raise ConfigError("--api-key must not be empty")
    options = dict(api_keys=keys, protect_all=args.api_key_all_routes, docs=args.docs,
                   max_tokens_default=args.max_tokens_default, timeout_keep_alive=args.timeout_keep_alive,
                   request_timeout=args.request_timeout, limit_concurrency=args.limit_concurrency)
    if args.allowed_hosts:
        options["allowed_hosts"] = hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
        if ported := [h for h in hosts if re.fullmatch(r"[^\[\]:]+:\d+", h)]:  # the Host header's port is not matched
            raise ConfigError(f"--allowed-hosts takes host names without a port (a request's port is not compared): "
                              f"give {','.join(h.rsplit(':', 1)[0] for h in ported)}, not {','.join(ported)}")
    if args.max_request_bytes is not None:
        options["max_request_bytes"] = args.max_request_bytes or None
    if args.shutdown_grace is not None:
        options["shutdown_grace"] = args.shutdown_grace
    # the server's packages (fastapi, uvicorn) are needed by this command only: imported when it runs, so
    # every other command works without them (tests/test_device_check.py's bare environment)
    from ..server import serve

    check_tokenizer(args, "`specter serve` (it answers with text)")  # before the load
    if pipeline.launched():  # rank 0 serves HTTP over the pipeline's engine, the other ranks follow it
        return pipeline.run(args, lambda engine: _serve(serve, engine, args, options), serving=True)
    if args.pipeline_backend is not None or args.pipeline_timeout is not None:
        raise ConfigError("--pipeline-backend and --pipeline-timeout apply under torchrun only "
                          "(torchrun --nproc-per-node N -m specter serve ...)")
    check_port(args.host, args.port)  # before the load: a port in use fails at once, not after minutes of loading
    engine = load_engine(args)
    try:
        serve(engine, host=args.host, port=args.port, model_name=args.model_name, max_queue=args.max_queue,
              **options)
    finally:
        engine.close()
    return 0


def check_port(host: str, port: int) -> None:
    """A ConfigError when `host`:`port` cannot be bound (in use, or not this machine's address), as uvicorn
    would find after the load; the socket is closed again at once (uvicorn binds it, with SO_REUSEADDR)."""
    if port == 0:  # any free port
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror or e})"
        raise ConfigError(f"{host}:{port} {why}: pick another --port, or stop what holds it") from None


def _serve(serve, engine, args, options) -> int:
    serve(engine, host=args.host, port=args.port, model_name=args.model_name, max_queue=args.max_queue, **options)
    return 0
