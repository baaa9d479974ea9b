"""`specter serve` on the open network (issue 27): no 500 for a valid request, queue accounting that
follows the clients, bounded input that never stalls the event loop, API keys and exposure, graceful
shutdown, connection limits. Loopback servers on the bundled model, the real `openai` client and raw
HTTP; one server runs as a subprocess to receive SIGTERM."""
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

# the server's packages and the client's: optional where only the engine is installed (the GPU image)
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
for _name in ("fastapi", "sse_starlette", "uvicorn", "prometheus_client"):
    pytest.importorskip(_name)

import specter
from specter.server import ServerThread, create_app

pytestmark = pytest.mark.skipif(not (specter.default_model_path() / "model.safetensors").exists(),
                                reason="the bundled default model is not built")

PROMPT = "def fibonacci(n):"
MODEL = "default_model"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def engine():
    engine = specter.load(None, device="cpu", policy="resident")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine):
    """The server as `specter serve` builds it by default, with room for one waiting request."""
    with ServerThread(create_app(engine, max_queue=1)) as url:
        yield url


def client(url, **kw):
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=60, **kw)


def health(url) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def until(what, seconds: float = 10.0):
    """Poll `what()` until true (bounded); the last value."""
    deadline = time.monotonic() + seconds
    while not (value := what()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def wait_idle(url):
    assert until(lambda: (h := health(url))["queue_depth"] == h["running"] == 0), health(url)


def address(url) -> tuple[str, int]:
    u = httpx.URL(url)
    return u.host, u.port


def send_raw(url, data: bytes, timeout: float = 30) -> socket.socket:
    s = socket.create_connection(address(url), timeout=timeout)
    s.sendall(data)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    with s:
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk


def post_bytes(body: bytes, path: str = "/v1/completions", headers: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\n%s"
            b"Content-Length: %d\r\n\r\n" % (path.encode(), headers, len(body))) + body


def status_and_json(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), head.lower()


def greedy(engine, n=8) -> str:
    return engine.generate(PROMPT, max_new_tokens=n, temperature=0.0).text


def sse_data(text: str) -> list[str]:
    return [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]


# -------------------------------------------------------------------- 5: no 500 for a valid request
def test_a_tiny_temperature_is_greedy_and_a_tiny_top_p_keeps_the_likeliest_token(engine, url):
    c, want = client(url), greedy(engine)
    for kw in (dict(temperature=1e-40), dict(temperature=1e-300), dict(temperature=0.8, top_p=1e-300),
               dict(temperature=1.0, top_p=1e-45)):
        r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=1, **kw)
        assert r.choices[0].text == want, kw
        s = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=1, stream=True, **kw)
        assert "".join(ch.choices[0].text for ch in s if ch.choices) == want, kw


def test_seeds_are_64_bit_and_a_larger_one_is_a_400(url):
    c = client(url)
    for seed in (2 ** 64 - 1, -(2 ** 63), 0):
        assert c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1, seed=seed).usage
    for seed in (2 ** 64, 2 ** 70, -(2 ** 63) - 1):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1, seed=seed)
        assert e.value.response.json()["error"]["param"] == "seed"


@pytest.mark.parametrize("body", [
    b'{"prompt": "ab\\ud800cd", "max_tokens": 4}',
    b'{"prompt": ["\\udfff"], "max_tokens": 4}',
    b'{"prompt": "ok", "max_tokens": 4, "stop": ["\\ud83d"]}',
])
def test_a_lone_surrogate_is_a_400_naming_the_field(url, body):
    status, err, head = status_and_json(read_all(send_raw(url, post_bytes(body))))
    assert status == 400, err
    assert "surrogate" in err["error"]["message"] and err["error"]["param"].split(".")[0] in ("prompt", "stop")


def test_logprobs_zero_and_stream_options_without_stream_are_refused(url):
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=0)
    assert e.value.response.json()["error"]["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream_options={"include_usage": True})
    assert e.value.response.json()["error"]["param"] == "stream_options"


@pytest.fixture
def server_log():
    """What the server logs to uvicorn's error log (uvicorn's own handlers do not reach caplog)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _logged(records, match, within_s: float = 10.0) -> bool:
    """Whether a matching record is (or within `within_s` becomes) in `records`."""
    deadline = time.monotonic() + within_s
    while not any(match(rec) for rec in list(records)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _failing_stream(pieces_first: int):
    def stream(prompt, *a, **kw):
        for _ in range(pieces_first):
            yield "x"
        raise RuntimeError("secret internals at /srv/models/x.py")
    return stream


def test_a_failed_generation_is_a_500_that_keeps_its_text_in_the_log_and_closes_the_connection(
        engine, url, monkeypatch, server_log):
    monkeypatch.setattr(engine, "stream", _failing_stream(0))
    with httpx.Client(timeout=30) as http:
        for stream in (False, True):  # the stream has not started: a plain 500 either way
            r = http.post(url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=4, stream=stream))
            assert r.status_code == 500
            assert r.headers["connection"] == "close"
            err = r.json()["error"]
            assert "secret" not in r.text and "RuntimeError" not in r.text and err["type"] == "server_error"
    assert _logged(server_log, lambda rec: rec.exc_info and "secret internals" in str(rec.exc_info[1]))
    assert _logged(server_log, lambda rec: re.search(r"[0-9a-f]{12}", rec.getMessage()))  # the body's reference


def test_a_handler_bug_is_a_500_without_its_text(engine, url, monkeypatch, server_log):
    def broken(prompt):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(engine, "encode", broken)
    r = httpx.post(url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=4), timeout=30)
    assert r.status_code == 500 and r.headers["connection"] == "close"
    assert "secret" not in r.text and r.json()["error"]["code"] == "internal_error"
    # the traceback may be logged after the response has gone out (uvicorn logs the re-raised error)
    assert _logged(server_log, lambda rec: rec.exc_info and "secret internals" in str(rec.exc_info[1]))


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(engine, url, monkeypatch):
    monkeypatch.setattr(engine, "stream", _failing_stream(2))
    with httpx.stream("POST", url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=8, stream=True),
                      timeout=30) as r:
        assert r.status_code == 200
        data = sse_data(r.read().decode())
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["type"] == "server_error" and "secret" not in data[-2]
    with pytest.raises(openai.APIError):  # the openai client sees the error, not a silent end
        for _ in client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, stream=True):
            pass


# ------------------------------------------------------------------ 2: queue accounting follows clients
def test_clients_that_time_out_while_queued_leave_the_queue_at_once(url):
    c = client(url)
    with c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True) as running:
        next(iter(running))                              # generating
        for _ in range(2):                               # each waits (max_queue=1), gives up after 0.5 s
            try:
                httpx.post(url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=4), timeout=0.5)
            except httpx.ReadTimeout:
                pass
            assert until(lambda: health(url)["queue_depth"] == 0, 2), "a client that left still holds its place"
        # so the next one queues (no 503) and is served once the running stream ends
        result = {}
        t = threading.Thread(target=lambda: result.update(r=httpx.post(
            url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=4), timeout=60)))
        t.start()
        assert until(lambda: health(url)["queue_depth"] == 1)
    t.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 4
    wait_idle(url)


def test_the_503_says_how_many_generate_and_wait(url):
    c = client(url)
    with c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True) as running:
        next(iter(running))
        with send_raw(url, post_bytes(json.dumps(dict(prompt=PROMPT, max_tokens=4)).encode())):  # waits
            assert until(lambda: health(url)["queue_depth"] == 1)
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 503
    assert "1 request generating and 1 waiting" in e.value.response.json()["error"]["message"]
    wait_idle(url)


def test_max_tokens_default_bounds_requests_without_max_tokens(engine, tmp_path):
    path = tmp_path / "model"
    import shutil

    shutil.copytree(specter.default_model_path(), path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    chat_engine = specter.load(path, device="cpu", policy="resident")
    try:
        with ServerThread(create_app(chat_engine, model_name="m", max_tokens_default=5)) as url:
            c = client(url)
            r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                          extra_body={"min_p": 0.0})
            assert r.usage.completion_tokens <= 5
            r = c.completions.create(model="m", prompt=PROMPT, temperature=0)
            assert r.usage.completion_tokens <= 5
            r = c.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=9)
            assert r.usage.completion_tokens == 9    # a request's own max_tokens still wins
            # a default never asks past the context: 3 tokens of room take 3 (a request's own asking more is a 400)
            r = c.completions.create(model="m", prompt=[1] * (chat_engine.context - 3), temperature=0)
            assert r.usage.completion_tokens == 3
    finally:
        chat_engine.close()


# ------------------------------------------------------------------------- 1: bounded, non-blocking input
class HealthWatch:
    """Polls /health on a thread while a block runs; `worst` is the slowest answer (seconds)."""

    def __init__(self, url):
        self.url, self.worst, self.count, self.stop = url, 0.0, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=30) as http:
            while not self.stop.is_set() and self.count < 2000:
                t0 = time.monotonic()
                assert http.get(self.url + "/health").status_code == 200
                self.worst, self.count = max(self.worst, time.monotonic() - t0), self.count + 1
                time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


def test_a_body_over_the_limit_is_413_and_health_answers_meanwhile(url):
    big = json.dumps(dict(prompt="x " * (3 * 2 ** 20), max_tokens=4)).encode()  # 6 MB: over the 4 MiB default
    with HealthWatch(url) as watch:
        s = send_raw(url, post_bytes(big))
        status, err, head = status_and_json(read_all(s))
        time.sleep(0.2)
    assert watch.count > 0 and watch.worst < 1.0, watch.worst
    assert status == 413 and err["error"]["code"] == "request_too_large" and b"connection: close" in head
    # a chunked body (no Content-Length) is counted as it arrives
    chunks = (b"x" * 65536 for _ in range(100))  # 6.4 MB
    r = httpx.post(url + "/v1/completions", content=chunks, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413


def test_a_prompt_far_beyond_the_context_is_refused_without_tokenizing_it(engine, url, monkeypatch):
    calls = []
    encode = engine.encode
    monkeypatch.setattr(engine, "encode", lambda p: calls.append(1) or encode(p))
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x" * 1_000_000, max_tokens=4)   # 1 MB: under the body limit
    assert e.value.response.json()["error"]["code"] == "context_length_exceeded" and not calls
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=[1] * 100_000, max_tokens=4)
    assert e.value.response.json()["error"]["code"] == "context_length_exceeded" and not calls


def test_a_chat_of_more_messages_than_the_context_has_tokens_is_refused_before_it_is_parsed(url):
    messages = [{"role": "user", "content": "a"}] * 100_000   # 3 MB: under the body limit
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=dict(messages=messages, max_tokens=4), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "at most 2048" in r.json()["error"]["message"]                     # the context, not the template
    assert time.monotonic() - t0 < 5


def test_tokenizing_happens_off_the_event_loop(engine, url, monkeypatch):
    """A slow tokenizer (a large prompt) holds up only its own request: /health answers meanwhile."""
    encode = engine.encode

    def slow(prompt):
        time.sleep(2.0)
        return encode(prompt)

    monkeypatch.setattr(engine, "encode", slow)
    result = {}
    with HealthWatch(url) as watch:
        t = threading.Thread(target=lambda: result.update(r=httpx.post(
            url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=2), timeout=60)))
        t.start()
        t.join(60)
    assert result["r"].status_code == 200
    assert watch.count > 5 and watch.worst < 1.0, watch.worst


# ----------------------------------------------------------------------------- 4: API keys, exposure
def test_api_keys_guard_the_v1_routes(engine):
    with ServerThread(create_app(engine, api_keys=["k-one", "k-two"])) as url:
        for key in ("k-one", "k-two"):
            assert [m.id for m in client(url, api_key=key).models.list()] == [MODEL]
            r = client(url, api_key=key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert r.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError) as e:
            client(url, api_key="k-three").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert e.value.response.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=2))
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in r.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    with ServerThread(create_app(engine, api_keys=["k"], protect_all=True)) as url:
        assert httpx.get(url + "/health").status_code == 401
        assert httpx.get(url + "/health", headers={"Authorization": "Bearer k"}).status_code == 200


def test_docs_are_off_unless_asked_for_and_allowed_hosts_refuse_others(engine):
    with ServerThread(create_app(engine)) as url:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(url + path).status_code == 404
    with ServerThread(create_app(engine, docs=True, allowed_hosts=["127.0.0.1", "api.example.com"])) as url:
        assert httpx.get(url + "/docs").status_code == 200
        assert httpx.get(url + "/health", headers={"Host": "api.example.com"}).status_code == 200
        r = httpx.get(url + "/v1/models", headers={"Host": "evil.example"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"


def test_cli_api_keys_from_flags_or_environment_and_a_warning_off_loopback(monkeypatch, caplog):
    import uvicorn

    from specter.cli import main

    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(self.config))
    # uvicorn's logging setup would point its handlers at this test's captured stderr, closed after it
    monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda self: None)
    monkeypatch.setenv("SPECTER_API_KEY", "env-a, env-b")
    assert main(["serve", "--device", "cpu", "--policy", "resident", "--host", "0.0.0.0"]) == 0
    assert "without an API key" not in caplog.text
    assert main(["serve", "--device", "cpu", "--policy", "resident", "--api-key", "flag", "--max-request-bytes",
                 "1000", "--timeout-keep-alive", "3", "--limit-concurrency", "50"]) == 0
    monkeypatch.delenv("SPECTER_API_KEY")
    assert main(["serve", "--device", "cpu", "--policy", "resident", "--host", "0.0.0.0"]) == 0
    assert "without an API key" in caplog.text
    caplog.clear()
    assert main(["serve", "--device", "cpu", "--policy", "resident", "--host", "127.0.0.5"]) == 0  # loopback too
    assert "without an API key" not in caplog.text
    env, flag, bare, _ = seen  # (the CLI closed each engine when its serve() returned: inspect the apps)
    from specter.server.app import RequireKey

    def keys(app):
        return [k for m in app.user_middleware if m.cls is RequireKey for k in m.kwargs["keys"]]

    assert (keys(env.app), keys(flag.app), keys(bare.app)) == ([b"env-a", b"env-b"], [b"flag"], [])
    from specter.server.app import LimitBody

    def limit(app):
        return [m.kwargs["limit"] for m in app.user_middleware if m.cls is LimitBody]

    assert (limit(flag.app), limit(bare.app)) == ([1000], [4 * 2 ** 20])
    from specter.server.app import LimitConcurrency

    def most(app):
        return [m.kwargs["limit"] for m in app.user_middleware if m.cls is LimitConcurrency]

    assert (most(flag.app), most(bare.app)) == ([50], [])
    assert (flag.timeout_keep_alive, flag.limit_concurrency) == (3, None)  # the app's limit, not uvicorn's
    assert main(["serve", "--api-key", ""]) == 2


# ------------------------------------------------------------------------------- 3: graceful shutdown
@pytest.mark.parametrize("grace, max_tokens, finish, signals", [
    ("0", 2000, "abort", ["SIGTERM"]),         # no grace: stopped at once, and the last chunk says so
    ("60", 600, "length", ["SIGTERM"]),        # within the grace: the generation runs to its end
    ("60", 2000, "abort", ["SIGINT"] * 2),     # a second Ctrl-C: stopped at once, the app closed all the same
])
def test_sigterm_mid_stream_ends_the_stream_with_done_answers_the_queued_503_and_exits_0(grace, max_tokens, finish,
                                                                                          signals):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "specter", "serve", "--device", "cpu", "--policy", "resident",
                             "--port", "0", "--max-queue", "2", "--shutdown-grace", grace],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log = []
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            log.append(line)
            if m := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
        assert port, "".join(log)
        threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        queued, body = {}, dict(prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
                                stream_options={"include_usage": True})
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            data = [next(line for line in lines if line.startswith("data:"))]    # generating
            t = threading.Thread(target=lambda: queued.update(r=httpx.post(
                url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=4), timeout=60)))
            t.start()
            assert until(lambda: health(url)["queue_depth"] == 1)
            for sig in signals:
                proc.send_signal(getattr(signal, sig))
                time.sleep(0.5)
            data += [line for line in lines if line.startswith("data:")]      # a cut body raises here
        t.join(60)
        assert proc.wait(60) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    data = [d[len("data:"):].strip() for d in data]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [finish]
    made = chunks[-1]["usage"]["completion_tokens"]
    assert 0 < made < max_tokens if finish == "abort" else made == max_tokens
    r = queued["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert "Traceback" not in "".join(log), "".join(log)


def test_a_forced_exit_lets_a_response_that_is_ending_end_before_the_loop_does():
    """The two-SIGINT case above failed on a busy machine: the aborted stream had sent [DONE], but its
    response had not returned when the loop ended, and the task cancelled there logged a traceback. A
    forced exit now waits a few seconds for the responses still running (uvicorn waits for none)."""
    import asyncio

    import uvicorn

    from specter.server import _server_class

    async def app(scope, receive, send):
        pass

    server, ended = _server_class()(uvicorn.Config(app, lifespan="off")), []

    async def run():
        async def response():  # an aborted stream's response, returning a moment after the shutdown began
            await asyncio.sleep(1.0)
            ended.append(True)

        task = asyncio.create_task(response())
        server.server_state.tasks.add(task)
        server.servers, server.force_exit = [], True  # (started: its listening sockets, none here)
        await server.shutdown()
        return task

    task = asyncio.run(run())
    assert ended and not task.cancelled()


# ----------------------------------------------------------------------------- connections
@pytest.fixture(scope="module")
def strict_url(engine):
    """Short connection deadlines: 1 s to send anything, 2 s to send a whole request."""
    with ServerThread(create_app(engine), timeout_keep_alive=1, request_timeout=2) as url:
        yield url


def closed_within(s: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes `s` within `seconds` (sending `trickle` a byte every 0.2 s meanwhile)."""
    deadline = time.monotonic() + seconds
    s.settimeout(0.2)
    with s:
        while time.monotonic() < deadline:
            try:
                if s.recv(4096) == b"":
                    return True
            except socket.timeout:
                pass
            except ConnectionResetError:
                return True
            if trickle:
                try:
                    s.sendall(trickle[:1])
                except (BrokenPipeError, ConnectionResetError):
                    return True
                trickle = trickle[1:] or b"x"
    return False


def test_idle_and_slow_connections_are_closed(strict_url):
    assert closed_within(socket.create_connection(address(strict_url)), 6)          # sends nothing
    slow = socket.create_connection(address(strict_url))
    slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    assert closed_within(slow, 8, trickle=b"X-Slow: " + b"a" * 100)                # headers a byte at a time
    body = json.dumps(dict(prompt=PROMPT, max_tokens=2)).encode()
    slow = socket.create_connection(address(strict_url))
    slow.sendall(post_bytes(body)[:-10])
    assert closed_within(slow, 8, trickle=b" " * 5)                                # a body that stalls


def test_a_request_that_arrives_in_time_is_not_cut_by_the_deadlines(strict_url):
    """The deadlines are for receiving requests: a stream may outlast them, and so may a kept-alive connection
    that sends its next request in time."""
    stream = client(strict_url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 1000
    with httpx.Client(timeout=30) as http:
        for _ in range(3):
            assert http.get(strict_url + "/health").status_code == 200
            time.sleep(0.5)


@pytest.mark.parametrize("size", [70_000, 100_000, 200_000])  # whole in one read up to ~128 KiB: the app's check
def test_oversized_headers_get_431(url, size):
    raw = read_all(send_raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"))
    status, err, head = status_and_json(raw)
    assert status == 431 and err["error"]["code"] == "headers_too_large"
    assert httpx.get(url + "/health", headers={"X-Big": "a" * 60_000}).status_code == 200  # under 64 KiB


def test_limit_concurrency_answers_the_request_past_the_limit_503_in_json(engine):
    with ServerThread(create_app(engine, max_queue=4, limit_concurrency=2)) as url:
        c = client(url)
        with c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True) as running:
            next(iter(running))
            assert httpx.get(url + "/health").status_code == 200        # the second request at once: answered
            with send_raw(url, post_bytes(json.dumps(dict(prompt=PROMPT, max_tokens=4)).encode())):  # queued: 2
                assert until(lambda: health_or_none(url) is None)       # /health is the third: refused
                r = httpx.get(url + "/health")
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "too_many_requests"
                assert "2" in r.json()["error"]["message"]
        # each request, the refused ones too, gave its place back as it ended
        assert until(lambda: (h := health_or_none(url)) is not None and h["running"] == h["queue_depth"] == 0)
        assert httpx.get(url + "/health").status_code == 200


def health_or_none(url):
    r = httpx.get(url + "/health", timeout=10)
    return r.json() if r.status_code == 200 else None


def test_cuda_graphs_are_recorded_on_the_engine_thread_before_any_request():
    """Recordings are per thread: the scheduler has its one engine thread record the decoder's
    graphs first, so no request waits for them and none is recorded on a thread that never replays."""
    import asyncio
    from types import SimpleNamespace

    from specter.server.metrics import Metrics
    from specter.server.scheduler import Scheduler

    seen = []
    fake = SimpleNamespace(decoder=SimpleNamespace(record_graphs=lambda: seen.append(threading.current_thread().name)))

    async def start():
        return Scheduler(fake, max_queue=1, metrics=Metrics())
    scheduler = asyncio.run(start())
    scheduler.recorded.result(timeout=10)
    assert len(seen) == 1 and seen[0].startswith("specter-engine")
    scheduler.thread.shutdown()


def test_a_shorter_context_is_the_servers_max_model_len_and_its_bound():
    """An engine loaded with context=N: /v1/models says max_model_len N, and a request that cannot fit N
    tokens is a 400 naming the context, not a 500."""
    engine = specter.load(None, device="cpu", policy="resident", context=64)
    try:
        with ServerThread(create_app(engine)) as url:
            card = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
            assert card["max_model_len"] == 64
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": 100})
            assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    finally:
        engine.close()


def test_a_port_in_use_is_refused_before_the_load(monkeypatch, capsys):
    """`specter serve --port P` with P taken loaded the model first (minutes for a big one), then printed
    uvicorn's multi-line "address already in use" and exited 3. One line and status 2 now, before the load."""
    import specter.cli.serve as serve_cli
    from specter.cli import main

    def no_load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(serve_cli, "load_engine", no_load)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"specter: error: 127.0.0.1:{port} is in use: pick another --port, or stop what holds it"
    serve_cli.check_port("127.0.0.1", port)  # free again: no error


def test_a_model_without_a_tokenizer_is_refused_before_the_load(monkeypatch, capsys, tmp_path):
    """Every answer is text: a checkpoint without a tokenizer was loaded and served, then every request
    got a 400 naming stream_ids() (Python advice to an HTTP client). Refused before the load now, and by
    create_app."""
    import specter.cli.serve as serve_cli
    from specter.cli import main
    from specter.server.app import create_app
    from specter.testing import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, "qwen3_moe")  # config and weights, no tokenizer
    monkeypatch.setattr(serve_cli, "load_engine", lambda args: pytest.fail("the model was loaded"))
    assert main(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "0"]) == 2
    assert "ships no tokenizer, which `specter serve` (it answers with text) needs" in capsys.readouterr().err
    with pytest.raises(specter.TokenizerError, match="the server answers with text"):
        create_app(specter.load(tmp_path, device="cpu", policy="resident"))


def test_a_wrong_method_says_which_is_allowed_and_health_answers_head(url):
    """A GET on /v1/completions was a 405 without the Allow header HTTP requires (the error handler
    dropped it), and HEAD /health (a load balancer's probe) was a 405."""
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["type"]
    r = httpx.head(url + "/health")
    assert r.status_code == 200 and r.content == b""
