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

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, start_timeout: float = 60.0):
        import uvicorn

        self.host, self.start_timeout = host, start_timeout
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
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


def serve(engine, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          max_queue: int = 32, log_level: str = "info") -> None:
    """Serve until interrupted (the caller closes the engine)."""
    import uvicorn

    uvicorn.run(create_app(engine, model_name=model_name, max_queue=max_queue), host=host, port=port,
                log_level=log_level, timeout_graceful_shutdown=5)
