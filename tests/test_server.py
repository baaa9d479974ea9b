"""`specter serve` through the real `openai` client (sync and async), on loopback servers started
inside the test: one on the speculative path with a chat template, one small resident one for the
queue bound, chats without a template and seeded sampling."""
import asyncio
import json
import shutil
import socket
import time

import pytest

# the server's packages and the client's: optional where only the engine is installed (the GPU image)
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
for _name in ("fastapi", "sse_starlette", "uvicorn", "prometheus_client"):
    pytest.importorskip(_name)

import specter
from specter.server import ServerThread, create_app
from specter.server.metrics import Metrics
from specter.server.scheduler import Scheduler

pytestmark = pytest.mark.skipif(not (specter.default_model_path() / "model.safetensors").exists(),
                                reason="the bundled default model is not built")

PROMPT = "def fibonacci(n):"
TEMPLATE = ("{% for m in messages %}"
            "{% if loop.first and m['role'] == 'assistant' %}{{ raise_exception('start with a user message') }}{% endif %}"
            "<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "class Stack:"}]


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    """The bundled model plus a chat template, on the speculative policy with half the experts resident."""
    path = tmp_path_factory.mktemp("chat_model") / "model"
    shutil.copytree(specter.default_model_path(), path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    engine = specter.load(path, device="cpu", policy="specter", residency=0.5, k_max=8)
    with ServerThread(create_app(engine, model_name="tiny", max_queue=8)) as url:
        yield engine, url
    engine.close()


@pytest.fixture(scope="module")
def aux():
    """The bundled model as shipped (no chat template), resident, with room for one waiting request."""
    engine = specter.load(None, device="cpu", policy="resident")
    with ServerThread(create_app(engine, max_queue=1)) as url:
        yield engine, url
    engine.close()


def client(url, cls=openai.OpenAI):
    return cls(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_idle(url):
    """Until the server has let go of every client that left (bounded: 10 s)."""
    for _ in range(1000):
        health = httpx.get(url + "/health").json()
        if health["queue_depth"] == health["running"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"the server still works for clients that left: {health}")


def stream_text(stream) -> tuple[str, str | None, object]:
    """Joined text, finish_reason and usage of a completions or chat stream."""
    text, finish, use = [], None, None
    for chunk in stream:
        use = chunk.usage or use
        for c in chunk.choices:
            text.append(c.text if hasattr(c, "text") else (c.delta.content or ""))
            finish = c.finish_reason or finish
    return "".join(text), finish, use


# ------------------------------------------------------------------------------------------ basics
def test_models_health_and_metrics(main):
    engine, url = main
    c = client(url)
    assert [m.id for m in c.models.list()] == ["tiny"]
    assert c.models.retrieve("tiny").id == "tiny"
    assert httpx.get(url + "/health").json()["status"] == "ok"
    body = httpx.get(url + "/metrics").text
    for name in ("specter_tokens_per_second", "specter_ttft_seconds", "specter_tpot_seconds", "specter_expert_hit_rate",
                 "specter_h2d_bytes_total", "specter_acceptance_rate", "specter_queue_depth"):
        assert name in body, name


def test_metrics_count_what_a_request_did(main):
    engine, url = main
    names = ("specter_generated_tokens_total", "specter_h2d_bytes_total", "specter_expert_hits_total",
             "specter_ttft_seconds_count", "specter_accepted_tokens_total")
    before = {n: metric(url, n) for n in names}
    r = client(url).completions.create(model="tiny", prompt="class Stack:", max_tokens=12, temperature=0)
    st = r.model_extra["specter"]
    after = {n: metric(url, n) - before[n] for n in names}
    assert after == {"specter_generated_tokens_total": r.usage.completion_tokens, "specter_h2d_bytes_total":
                     st["h2d_bytes"], "specter_expert_hits_total": st["expert_hits"], "specter_ttft_seconds_count": 1,
                     "specter_accepted_tokens_total": st["accepted_tokens"]}
    assert st["h2d_bytes"] > 0  # half the experts resident: copies happened, and /metrics saw them
    assert 'specter_requests_total{endpoint="/v1/completions",status="200"}' in httpx.get(url + "/metrics").text


def test_metrics_count_coded_tier_hits_as_the_summary_line_does():
    """A coded-tier hit (--compress-experts) is a miss of the slots but no PCIe copy: /metrics's device hit
    rate counts it as bench's device_hit_rate and the summary line do; the slot hit rate does not."""
    from specter.server.metrics import Metrics

    m = Metrics()
    m.observe(dict(generated_tokens=2, ttft_s=0.1, tpot_s=0.1, expert_hits=1, expert_misses=157, tier_hits=113))
    value = m.registry.get_sample_value
    assert value("specter_expert_tier_hits_total") == 113 and value("specter_expert_hits_total") == 1
    assert value("specter_expert_hit_rate") == 1 / 158
    assert value("specter_expert_device_hit_rate") == 114 / 158


def test_completion_is_the_python_api_text(main):
    engine, url = main
    want = engine.generate(PROMPT, max_new_tokens=16, temperature=0.0)
    r = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.stats["finish_reason"] in ("stop", "length")
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == want.stats["prompt_tokens"]
    assert r.model_extra["specter"]["policy"] == "specter" and r.model_extra["specter"]["new_tokens"] == 16


def test_stream_text_is_the_non_stream_text(main):
    engine, url = main
    c = client(url)
    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    text, finish, use = stream_text(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                                         stream=True, stream_options={"include_usage": True}))
    assert text == whole.choices[0].text and finish == whole.choices[0].finish_reason
    assert use.completion_tokens == whole.usage.completion_tokens


def test_chat_with_the_checkpoint_template_sync_and_async(main):
    engine, url = main
    want = engine.generate(CHAT, max_new_tokens=16, temperature=0.0).text
    r = client(url).chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want

    async def streamed():
        s = await client(url, openai.AsyncOpenAI).chat.completions.create(
            model="tiny", messages=CHAT, max_completion_tokens=16, temperature=0, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

    assert asyncio.run(streamed()) == want


def test_stop_sequences(main):
    engine, url = main
    c = client(url)
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    stop = full.strip()[len(full.strip()) // 2:][:3]
    assert stop and stop in full
    want = full[:full.find(stop)]
    for stops in (stop, ["\x00never", stop]):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0, stop=stops)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
        s = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0, stop=stops, stream=True)
        assert stream_text(s)[:2] == (want, "stop")


def test_usage_counts_the_token_that_completes_a_stop(main):
    """A stop string in the first token gave text "", completion_tokens 0, and /metrics neither counted the
    token nor observed the TTFT (a QA pass). The model generated that token: completion_tokens counts the
    tokens through the one that completes the stop (as vLLM's), the Python API's `generated_tokens`."""
    engine, url = main
    c = client(url)
    want = engine.generate(PROMPT, max_new_tokens=8, temperature=0.0)
    first = engine.decode(want.token_ids[:1])
    stop = first  # the first token's text: the output is "", its one token generated
    assert stop
    names = ("specter_generated_tokens_total", "specter_ttft_seconds_count")
    before = {n: metric(url, n) for n in names}
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stop=stop)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "stop"
    st = r.model_extra["specter"]
    assert r.usage.completion_tokens == st["generated_tokens"] == 1 and st["new_tokens"] == 0
    assert {n: metric(url, n) - before[n] for n in names} == {names[0]: 1, names[1]: 1}
    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)  # no stop: as before
    assert whole.usage.completion_tokens == whole.model_extra["specter"]["new_tokens"] == 8


def test_concurrent_requests_give_their_one_at_a_time_texts(main):
    engine, url = main
    prompts = [PROMPT, "import os\n", "class Stack:", "def add(a, b):"]

    async def one(c, i, p):
        r = await c.completions.create(model="tiny", prompt=p, max_tokens=12 + 4 * i, temperature=0)
        return r.choices[0].text

    async def run(concurrent: bool):
        c = client(url, openai.AsyncOpenAI)
        if concurrent:
            return await asyncio.gather(*(one(c, i, p) for i, p in enumerate(prompts)))
        return [await one(c, i, p) for i, p in enumerate(prompts)]

    assert asyncio.run(run(True)) == asyncio.run(run(False))


def test_a_dropped_stream_stops_its_generation_and_the_next_request_is_served(main):
    engine, url = main
    c = client(url)
    want = c.completions.create(model="tiny", prompt="import os\n", max_tokens=8, temperature=0).choices[0].text
    tokens, cancelled = metric(url, "specter_generated_tokens_total"), metric(url, "specter_requests_cancelled_total")
    long = 1500
    with c.completions.create(model="tiny", prompt=PROMPT, max_tokens=long, temperature=0, stream=True) as s:
        for _, _chunk in zip(range(3), s):
            pass
    r = c.completions.create(model="tiny", prompt="import os\n", max_tokens=8, temperature=0)
    assert r.choices[0].text == want  # an abandoned speculative generation leaves nothing behind
    assert metric(url, "specter_requests_cancelled_total") == cancelled + 1
    dropped = metric(url, "specter_generated_tokens_total") - tokens - r.usage.completion_tokens
    assert 0 < dropped < long // 3  # stopped within a few cycles of the disconnect, not at max_tokens


# --------------------------------------------------------------------------------- bad requests
BAD = [  # (request fields, status, param)
    (dict(prompt=5), 400, "prompt"),
    (dict(temperature="hot"), 400, "temperature"),
    (dict(temperature=-0.5), 400, "temperature"),
    (dict(temperature=3), 400, "temperature"),  # OpenAI's range is [0, 2]
    (dict(top_p=0), 400, "top_p"),
    (dict(top_p=1.5), 400, "top_p"),
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(max_tokens=1.5), 400, "max_tokens"),
    (dict(max_tokens=2048), 400, "max_tokens"),          # prompt + max_tokens past the 2048-token context
    (dict(prompt=[1] * 2048), 400, "prompt"),            # the prompt alone fills the context, whatever max_tokens
    (dict(model="gpt-4o"), 404, "model"),
    (dict(n=2), 400, "n"),
    (dict(best_of=3), 400, "best_of"),
    (dict(best_of=0), 400, "best_of"),                   # not "best_of > 1 is not supported"
    (dict(echo=True), 400, "echo"),
    (dict(logprobs=2), 400, "logprobs"),
    (dict(suffix="x"), 400, "suffix"),
    (dict(logit_bias={"5": 10}), 400, "logit_bias"),
    (dict(stop=""), 400, "stop"),
    (dict(stop=[5]), 400, "stop"),
    (dict(stop=[f"s{i}" for i in range(17)]), 400, "stop"),  # each is searched for after every chunk: bounded
    (dict(stop="x" * 1001), 400, "stop"),
    (dict(seed="1"), 400, "seed"),
    (dict(stream="yes"), 400, "stream"),
    (dict(prompt=["a", "b"]), 400, "prompt"),
    (dict(prompt=[99999]), 400, "prompt"),                # a token id outside the vocabulary
    (dict(prompt=[]), 400, "prompt"),
    (dict(prompt=""), 400, "prompt"),
    (dict(extra_body={"best_effort": 1}), 400, "best_effort"),
]
BAD_CHAT = [
    (dict(messages=[]), 400, "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, None),
    (dict(messages=CHAT, tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (dict(messages=CHAT, max_completion_tokens=-1), 400, "max_completion_tokens"),
    (dict(messages=CHAT, max_completion_tokens=2048), 400, "max_completion_tokens"),  # past the context
    (dict(messages=[{"role": "assistant", "content": "hi"}]), 400, "messages"),  # the template's raise_exception
]


def test_every_bad_request_gets_an_openai_error_and_the_server_keeps_serving(main):
    engine, url = main
    c = client(url)
    for fields, status, param in BAD:
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=4) | fields
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(**kw)
        assert e.value.status_code == status, fields
        err = e.value.response.json()["error"]
        assert err["message"] and err["type"], fields
        if param is not None:
            assert err["param"] == param, (fields, err)
    for fields, status, param in BAD_CHAT:
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(**(dict(model="tiny", max_tokens=4) | fields))
        assert e.value.status_code == status, fields
        if param is not None:
            assert e.value.response.json()["error"]["param"] == param, fields
    for value, param in (("Infinity", "temperature"), ("1e400", "temperature"), ("NaN", "temperature")):
        body = b'{"prompt": "x", "max_tokens": 4, "%s": %s}' % (param.encode(), value.encode())  # JSON as Python reads it
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (value, r.json())
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x", "repetition_penalty": Infinity}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.json()
    for param in ("top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x", "%s": NaN}' % param.encode(),
                       headers={"content-type": "application/json"})  # (said "less than or equal to 1")
        assert r.status_code == 400 and "finite number" in r.json()["error"]["message"], r.json()
    for body, said in ((b"{not json", "not valid JSON"), (b"[1, 2]", "not a JSON object"), (b"", "is empty"),
                       (b'"x"', "not a JSON object")):
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and said in r.json()["error"]["message"], (body, r.json())
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.json()
    assert httpx.get(url + "/v1/nothing").status_code == 404
    assert httpx.get(url + "/v1/completions").status_code == 405
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 4


# ---------------------------------------------------------------------------- the resident server
def test_sampling_penalties_reach_the_engine(aux):
    engine, url = aux
    c = client(url)
    extra = dict(repetition_penalty=1.3, min_p=0.05)  # not OpenAI fields: extensions, as vLLM has them
    kw = dict(presence_penalty=0.8, frequency_penalty=0.5, temperature=0.9, seed=3)
    want = engine.generate(PROMPT, max_new_tokens=16, **kw, **extra).text
    assert want != engine.generate(PROMPT, max_new_tokens=16, temperature=0.9, seed=3).text  # they matter here
    r = c.completions.create(model="default_model", prompt=PROMPT, max_tokens=16, extra_body=extra, **kw)
    assert r.choices[0].text == want
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="default_model", prompt=PROMPT, max_tokens=4, presence_penalty=3)
    assert e.value.response.json()["error"]["param"] == "presence_penalty"


def test_chat_without_a_template_is_a_clear_400(aux):
    engine, url = aux
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="default_model", messages=CHAT)
    assert "chat template" in e.value.response.json()["error"]["message"]


def test_seeded_sampling_is_reproducible_and_is_the_python_api_draw(aux):
    engine, url = aux
    c = client(url)
    kw = dict(model="default_model", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95)
    a, b = (c.completions.create(seed=7, **kw).choices[0].text for _ in range(2))
    want = engine.generate(PROMPT, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7).text
    assert a == b == want


def test_a_full_queue_answers_503_with_retry_after(aux):
    engine, url = aux
    c = client(url)
    kw = dict(model="default_model", prompt=PROMPT, max_tokens=1500, temperature=0, stream=True)
    with c.completions.create(**kw) as running:
        next(iter(running))                             # generating
        # queued (max_queue=1); a queued stream gets its status line when the engine takes it, so a raw socket
        waiting = socket.create_connection(httpx.URL(url).netloc.decode().split(":"), timeout=30)
        body = json.dumps(kw).encode()
        waiting.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        with waiting:
            for _ in range(1000):  # bounded: 10 s
                if httpx.get(url + "/health").json()["queue_depth"] == 1:
                    break
                time.sleep(0.01)
            with pytest.raises(openai.APIStatusError) as e:
                c.completions.create(model="default_model", prompt=PROMPT, max_tokens=4)
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
            assert e.value.response.json()["error"]["code"] == "queue_full"
            assert httpx.get(url + "/health").json()["queue_depth"] == 1
    wait_idle(url)  # both clients are gone: the server notices within a cycle
    r = c.completions.create(model="default_model", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


def test_a_client_that_gives_up_on_a_non_streamed_request_cancels_it(aux):
    engine, url = aux
    cancelled = metric(url, "specter_requests_cancelled_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=dict(prompt=PROMPT, max_tokens=1500, temperature=0), timeout=0.5)
    wait_idle(url)
    assert metric(url, "specter_requests_cancelled_total") == cancelled + 1


def test_the_queue_serves_requests_in_arrival_order(aux):
    engine, _ = aux
    finished = []

    async def run():
        scheduler = Scheduler(engine, 4, Metrics())
        jobs = [scheduler.submit(engine.encode(PROMPT), dict(max_new_tokens=n, temperature=0.0)) for n in (24, 2, 12, 1)]

        async def wait(i):
            while (await jobs[i].events.get())[0] != "done":
                pass
            finished.append(i)

        await asyncio.gather(*(wait(i) for i in (3, 2, 1, 0)))
        scheduler.close()

    asyncio.run(run())
    assert finished == [0, 1, 2, 3]  # shorter requests that came later did not jump the queue


def test_closing_the_scheduler_stops_the_generation_in_flight(aux):
    engine, _ = aux
    metrics = Metrics()

    async def run():
        scheduler = Scheduler(engine, 4, metrics)
        job = scheduler.submit(engine.encode(PROMPT), dict(max_new_tokens=1500, temperature=0.0))
        assert (await job.events.get())[0] == "piece"  # generating
        scheduler.close()                               # what the server's shutdown does

    asyncio.run(run())
    # close() returned after the engine thread did: the generation was stopped, not run to 1500 tokens
    assert metrics.registry.get_sample_value("specter_requests_cancelled_total") == 1
    assert 0 < metrics.registry.get_sample_value("specter_generated_tokens_total") < 500


# ------------------------------------------------------------------------- the model's own settings
def test_a_request_without_sampling_fields_gets_the_model_defaults(tmp_path):
    """As vLLM's --generation-config auto: no sampling field -> the model's generation_config.json;
    any field -> the request's own settings, OpenAI's defaults for the rest."""
    path = tmp_path / "model"
    shutil.copytree(specter.default_model_path(), path)
    gen = dict(do_sample=True, temperature=0.8, top_p=0.9, repetition_penalty=1.2, eos_token_id=0)
    (path / "generation_config.json").write_text(json.dumps(gen))
    engine = specter.load(path, device="cpu", policy="resident")
    try:
        with ServerThread(create_app(engine, model_name="m")) as url:
            c = client(url)
            kw = dict(model="m", prompt=PROMPT, max_tokens=16, seed=5)
            want = engine.generate(PROMPT, max_new_tokens=16, seed=5)
            assert want.stats["sampling_from"] == "model"
            assert c.completions.create(**kw).choices[0].text == want.text
            greedy = engine.generate(PROMPT, max_new_tokens=16, temperature=0.0).text
            assert want.text != greedy
            assert c.completions.create(**kw, temperature=0).choices[0].text == greedy
            hot = engine.generate(PROMPT, max_new_tokens=16, seed=5, temperature=1.0, top_p=0.5).text
            assert c.completions.create(**kw, top_p=0.5).choices[0].text == hot  # temperature: OpenAI's 1
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------- the CLI
def test_cli_serve_wires_the_engine_options_into_uvicorn(monkeypatch):
    import uvicorn

    from specter.cli import main

    seen = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.update(config=self.config))
    # uvicorn's logging setup would point its handlers at this test's captured stderr, closed after it
    monkeypatch.setattr(uvicorn.Config, "configure_logging", lambda self: None)
    assert main(["serve", "--device", "cpu", "--policy", "resident", "--port", "8123", "--max-queue", "3",
                 "--model-name", "m"]) == 0
    config = seen["config"]
    assert (config.host, config.port) == ("127.0.0.1", 8123)
    assert config.app.state.scheduler.max_queue == 3 and config.app.state.scheduler.engine.policy == "resident"
    assert main(["serve", "--max-queue", "-1"]) == 2
