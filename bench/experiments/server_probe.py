"""Probe `specter serve` as an open-network client would (issue 27): values that used to end in a 500,
clients that leave the queue, large bodies and prompts (and /health meanwhile), keys and exposure,
connection limits, and SIGTERM mid-stream. Each probe prints one line; every wait is bounded.

    python bench/experiments/server_probe.py [--only 5,2,1,4,6,3] [--port 18470] [--pythonpath DIR]

The server is `python -m specter serve --device cpu --policy resident --max-queue 1` on loopback, a
subprocess; --pythonpath puts another checkout's `specter` first (e.g. an older tree, for a before/after).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

PROMPT = "def fibonacci(n):"


class Server:
    def __init__(self, port: int, pythonpath: str | None, *flags: str):
        env = dict(os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {}))
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.proc = subprocess.Popen([sys.executable, "-m", "specter", "serve", "--device", "cpu", "--policy",
                                      "resident", "--port", str(port), "--max-queue", "1", *flags], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.refused = None
        for _ in range(600):  # 60 s
            if self.proc.poll() is not None:
                self.refused = self.proc.stdout.read().strip().splitlines()[-1]
                return
            try:
                httpx.get(self.url + "/health", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise SystemExit("the server did not start within 60 s")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def post(self, body: dict, timeout: float = 60) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)

    def raw(self, data: bytes, timeout: float = 60) -> bytes:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        out = b""
        with s:
            try:
                s.sendall(data)
                while chunk := s.recv(65536):
                    out += chunk
            except (ConnectionResetError, BrokenPipeError, socket.timeout) as e:
                out += f"<{type(e).__name__}>".encode()
        return out


def raw_post(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


def brief(r) -> str:
    if isinstance(r, httpx.Response):
        return f"{r.status_code} {r.text[:140]!r}"
    head, _, body = r.partition(b"\r\n\r\n")
    return f"{head.split(b' ', 2)[1:2]} {body[:140]!r}"


def stream_lines(srv: Server, body: dict, timeout: float = 60) -> tuple[object, list[str]]:
    lines = []
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
        return r.status_code, lines
    except httpx.HTTPError as e:
        return type(e).__name__, lines


def probe_500s(srv: Server):
    base = dict(prompt=PROMPT, max_tokens=8)
    for name, extra in (("temperature 1e-40", dict(temperature=1e-40)),
                        ("top_p 1e-300", dict(temperature=0.8, top_p=1e-300)), ("seed 2**70", dict(seed=2 ** 70)),
                        ("logprobs 0", dict(logprobs=0)),
                        ("stream_options without stream", dict(stream_options={"include_usage": True}))):
        r = srv.post({**base, **extra})
        print(f"5 {name}: {r.status_code} connection={r.headers.get('connection')} {r.text[:110]!r}")
    print("5 lone surrogate:", brief(srv.raw(raw_post(b'{"prompt": "ab\\ud800cd", "max_tokens": 4}'))))
    status, lines = stream_lines(srv, {**base, "temperature": 1e-40, "stream": True})
    print(f"5 streamed temperature 1e-40: {status}, ends with [DONE]: {bool(lines) and lines[-1] == 'data: [DONE]'}, "
          f"error event: {any('error' in line for line in lines)}")


def probe_queue(srv: Server):
    run = threading.Thread(target=stream_lines, args=(srv, dict(prompt=PROMPT, max_tokens=1500, temperature=0,
                                                                stream=True)), daemon=True)
    run.start()
    time.sleep(1.0)
    for i in range(2):
        try:
            r = srv.post(dict(prompt=PROMPT, max_tokens=4), timeout=0.5)
            print(f"2 queued client {i}: {r.status_code} {r.json()['error']['message']!r}")
        except httpx.TimeoutException:
            print(f"2 queued client {i}: timed out after 0.5 s")
    time.sleep(0.3)
    print("2 /health after both left:", httpx.get(srv.url + "/health").json())
    try:
        r = srv.post(dict(prompt=PROMPT, max_tokens=4), timeout=1.0)
        print(f"2 the next request: {r.status_code}")
    except httpx.TimeoutException:
        print("2 the next request: queued (no 503; the client gave up after 1 s)")
    run.join(60)


def probe_input(srv: Server):
    worst, stop = [0.0], threading.Event()

    def poll():
        while not stop.is_set():
            t0 = time.monotonic()
            httpx.get(srv.url + "/health", timeout=60)
            worst[0] = max(worst[0], time.monotonic() - t0)
            time.sleep(0.05)

    watch = threading.Thread(target=poll)
    watch.start()
    for name, chars in (("10 MB body", 5 * 2 ** 20), ("3 MB prompt", 1536 * 1024)):
        body = json.dumps(dict(prompt="x " * chars, max_tokens=4)).encode()
        t0 = time.monotonic()
        out = srv.raw(raw_post(body))
        print(f"1 {name}: {brief(out)} in {time.monotonic() - t0:.2f} s")
    stop.set()
    watch.join(60)
    print(f"1 slowest /health meanwhile: {worst[0]:.2f} s")


def probe_exposure(srv: Server, port: int, pythonpath):
    print("4 /docs:", httpx.get(srv.url + "/docs").status_code)
    keyed = Server(port + 1, pythonpath, "--api-key", "k1", "--allowed-hosts", "127.0.0.1")
    try:
        if keyed.refused:
            print("4 --api-key k1 --allowed-hosts 127.0.0.1:", keyed.refused)
            return
        for name, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer nope"}),
                              ("key k1", {"Authorization": "Bearer k1"}),
                              ("key k1, Host: evil.example", {"Authorization": "Bearer k1", "Host": "evil.example"})):
            r = httpx.get(keyed.url + "/v1/models", headers=headers)
            print(f"4 /v1/models, {name}: {r.status_code} {r.text[:90]!r}")
    finally:
        keyed.close()


def probe_connections(srv: Server):
    print("6 200 KB header:", srv.raw(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")[:60])
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(20)
    t0 = time.monotonic()
    with s:
        try:
            s.recv(10)
            print(f"6 a connection that sends nothing: closed after {time.monotonic() - t0:.1f} s")
        except socket.timeout:
            print("6 a connection that sends nothing: still open after 20 s")


def probe_shutdown(srv: Server):
    got, queued = {}, {}
    a = threading.Thread(target=lambda: got.update(r=stream_lines(srv, dict(prompt=PROMPT, max_tokens=1500,
                                                                            temperature=0, stream=True))))
    a.start()
    time.sleep(1.0)
    b = threading.Thread(target=lambda: queued.update(r=srv.post(dict(prompt=PROMPT, max_tokens=4)).status_code))
    b.start()
    time.sleep(0.5)
    srv.proc.send_signal(signal.SIGTERM)
    a.join(60)
    b.join(60)
    try:
        rc = srv.proc.wait(60)
    except subprocess.TimeoutExpired:
        rc = "still running after 60 s"
    status, lines = got.get("r", (None, []))
    finish = [json.loads(line[5:])["choices"][0]["finish_reason"] for line in lines[:-1] if "finish_reason" in line]
    print(f"3 SIGTERM mid-stream: stream {status}, finish_reason {[f for f in finish if f]}, last "
          f"{lines[-1][:40] if lines else None!r}; the queued request: {queued.get('r')}; exit {rc}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="5,2,1,4,6,3")
    ap.add_argument("--port", type=int, default=18470)
    ap.add_argument("--pythonpath", default=None)
    args = ap.parse_args()
    srv = Server(args.port, args.pythonpath)
    try:
        for item in args.only.split(","):
            {"5": probe_500s, "2": probe_queue, "1": probe_input, "6": probe_connections, "3": probe_shutdown,
             "4": lambda s: probe_exposure(s, args.port, args.pythonpath)}[item](srv)
    finally:
        srv.close()


if __name__ == "__main__":
    main()
