"""`specter serve`: an OpenAI-compatible HTTP server over one engine.

    app = create_app(engine)               # FastAPI app; run it with uvicorn
    with ServerThread(app) as url: ...     # on a background thread (tests, benchmarks), loopback
"""
from __future__ import annotations

import threading
import time

from .app import create_app

__all__ = ["create_app", "ServerThread", "serve"]


class ServerThread:
    """uvicorn on a daemon thread, on a free port of `host`; the context value is the base URL."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0, **options):
        """options: http.config's (request_timeout, and uvicorn's own: timeout_keep_alive ...)."""
        import uvicorn

        from . import http

        self.host, self.start_timeout = host, start_timeout
        self.server = uvicorn.Server(http.config(app, host, port, log_level="warning", timeout_graceful_shutdown=2,
                                                 **options))
        self.thread = threading.Thread(target=self.server.run, name="specter-server", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(engine, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          max_queue: int = 32, log_level: str = "info", **options) -> None:
    """Serve until SIGINT/SIGTERM (the caller closes the engine), then shut down gracefully: no new
    connections or generations, queued requests answered 503, the running generation given
    `shutdown_grace` seconds before it is stopped (its stream still ends with a final chunk and
    [DONE]), and return normally. `options`: create_app's keywords, plus `request_timeout` (see
    specter.server.http) and uvicorn's `timeout_keep_alive`."""
    from . import http
    from .app import SHUTDOWN_GRACE

    uv = {k: options.pop(k) for k in ("request_timeout", "timeout_keep_alive") if k in options}
    app = create_app(engine, model_name=model_name, max_queue=max_queue, **options)
    grace = options.get("shutdown_grace", SHUTDOWN_GRACE)
    config = http.config(app, host, port, log_level=log_level, timeout_graceful_shutdown=grace + 10, **uv)
    if not loopback(host) and not options.get("api_keys"):  # after Config: uvicorn's logging is set up
        import logging

        logging.getLogger("uvicorn.error").warning(
            "serving on %s without an API key: anyone who can reach this address can use the model; pass "
            "--api-key (or set SPECTER_API_KEY), or bind to 127.0.0.1", host)
    _server_class()(config).run()


FORCED_END_S = 5.0  # seconds a forced exit waits for responses already ending (server.shutdown)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with the app told to drain on the first SIGINT/SIGTERM (and to stop its
        generation on a second SIGINT, uvicorn's forced exit), and a normal return after the shutdown
        (uvicorn re-raises the signal, which would kill the process)."""

        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            state = self.config.app.state
            loop = getattr(state, "loop", None)  # set by the app's lifespan startup
            if first and loop is not None:
                loop.call_soon_threadsafe(state.drain)
            elif self.force_exit:  # a second SIGINT: no waiting, and the engine thread stops too
                state.abort()
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

        async def shutdown(self, sockets=None) -> None:
            """uvicorn's, and on a forced exit the app's own shutdown too (uvicorn skips it: the engine was
            not closed, and the lifespan task, cancelled at the loop's end, logged a CancelledError
            traceback); quick, as the generation was aborted. Then the responses still ending are given
            FORCED_END_S: an aborted stream has sent its last chunk and [DONE] but may not have returned
            yet (on a busy machine), and a task the loop's end cancels logs "Exception in ASGI application"."""
            import asyncio

            await super().shutdown(sockets)
            if self.force_exit and self.config.lifespan != "off" and not getattr(self, "_app_shut", False):
                self._app_shut = True  # (once: a second Ctrl-C may come while uvicorn's own call awaits)
                try:
                    await asyncio.wait_for(self.lifespan.shutdown(), 10)
                except asyncio.TimeoutError:
                    pass
            ending = [t for t in getattr(self.server_state, "tasks", ()) if not t.done()]
            if self.force_exit and ending:
                await asyncio.wait(ending, timeout=FORCED_END_S)

    return Server
