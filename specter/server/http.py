"""uvicorn's configuration for `specter serve`: its h11 protocol with connection deadlines and a 431.

uvicorn closes a keep-alive connection that idles between requests (timeout_keep_alive) and caps
request headers (h11_max_incomplete_event_size), but a connection that never sends anything, or
sends its request a byte at a time, is kept forever, and oversized headers get a generic 400. This
protocol closes a connection that sends nothing within timeout_keep_alive of opening, or whose
request is not all received within `request_timeout` of its first byte (slow headers or a slow
body), and answers oversized headers 431 (those h11 holds incomplete over the cap; headers that
arrive whole are measured by the app, app.LimitHeaders).
"""
from __future__ import annotations

import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import MAX_HEADER_BYTES  # request line + headers; larger ones get 431 (here, or app.LimitHeaders)

REQUEST_TIMEOUT = 60.0  # seconds to receive a whole request (headers and body)


class Protocol(H11Protocol):
    request_timeout = REQUEST_TIMEOUT
    _deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # nothing sent yet: the idle deadline uvicorn otherwise sets only after a response
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:  # a request begins
            self._deadline = self.loop.call_later(self.request_timeout, self._request_too_slow)
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):      # received whole (or failed)
            self._disarm()

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _request_too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.logger.info("closing a connection whose request took longer than %.0f s to arrive",
                             self.request_timeout)
            self.transport.close()  # a handler waiting for the body sees a disconnect

    def send_400_response(self, msg: str) -> None:
        limit = self.config.h11_max_incomplete_event_size
        if limit is None or len(self.conn.trailing_data[0]) <= limit:
            return super().send_400_response(msg)
        body = json.dumps({"error": {"message": f"the request line and headers are larger than this server accepts "
                                                f"({limit} bytes)", "type": "invalid_request_error", "param": None,
                                     "code": "headers_too_large"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=431, headers=headers, reason=b"Request Header Fields Too Large"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def config(app, host: str, port: int, *, request_timeout: float = REQUEST_TIMEOUT, **kw) -> "uvicorn.Config":
    """uvicorn.Config with this protocol; `kw`: uvicorn's own settings (timeout_keep_alive, limit_concurrency...)."""
    protocol = type("Protocol", (Protocol,), {"request_timeout": request_timeout})
    kw.setdefault("h11_max_incomplete_event_size", MAX_HEADER_BYTES)
    return uvicorn.Config(app, host=host, port=port, http=protocol, **kw)
