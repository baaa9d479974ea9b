"""The HTTP surface: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

A handler validates everything it can before the request queues (a bad request never waits for
the engine), hands token ids to the scheduler, and turns the job's pieces into one JSON body or
an SSE stream (OpenAI's chunk format, `data: [DONE]` last). Specter's stats ride along in an
extra field, "specter".

Input is bounded before it costs anything (LimitBody: the body; check_length: a prompt that cannot
fit the context), and tokenizing runs off the event loop. A response's status waits until the
engine takes the request (a queued client that leaves, or a shutdown, never starts a stream), so
an error before the first token is a real status; after it, an error event and `[DONE]`.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import math
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from pydantic import Field
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..errors import ContextLengthError, SpecterError, TokenizerError
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, Message, new_id, now, usage
from .scheduler import Job, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("uvicorn.error")  # uvicorn's own error log, so its handlers print it
SSE_GRACE = "shutdown_grace_period" in inspect.signature(EventSourceResponse.__init__).parameters

# request fields that choose how tokens are drawn; a request that sets none of them gets the model's own
# settings, as vLLM's --generation-config auto does; one that sets any gets OpenAI's defaults for the rest
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
OPENAI_NEUTRAL = dict(temperature=1.0, top_p=1.0)
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
MAX_REQUEST_BYTES = 4 * 2 ** 20   # default body limit: several times a typical 128k-token prompt
MAX_HEADER_BYTES = 64 * 1024      # request line + headers; larger ones get 431
SHUTDOWN_GRACE = 10.0             # default seconds a running generation may go on after SIGINT/SIGTERM


def create_app(engine, *, model_name: str | None = None, max_queue: int = 32,
               max_request_bytes: int | None = MAX_REQUEST_BYTES, max_tokens_default: int | None = None,
               api_keys=(), protect_all: bool = False, allowed_hosts=None, docs: bool = False,
               shutdown_grace: float = SHUTDOWN_GRACE, limit_concurrency: int | None = None) -> FastAPI:
    """An OpenAI-compatible app over one loaded engine (which the caller keeps and closes).

    max_request_bytes: larger bodies get 413 (None: no limit). max_tokens_default: what a request
    without max_tokens may generate (None: 16 for completions, the rest of the context for chat).
    api_keys: if any, every /v1 route (every route with protect_all) wants `Authorization: Bearer KEY`.
    allowed_hosts: Host header patterns (starlette's TrustedHostMiddleware); None: any. docs: serve
    /docs and /openapi.json. shutdown_grace: seconds a running generation may go on once app.state.drain()
    is called (`serve` calls it on SIGINT/SIGTERM). limit_concurrency: requests answered at once, on any
    route (a stream until its end); more get 503 (None: no limit)."""
    if engine.tokenizer is None:  # every answer is text (token-id prompts too)
        raise TokenizerError(f"the server answers with text, and {engine.path} ships no tokenizer; copy the model's "
                             f"tokenizer files next to its config.json (specter generate --prompt-ids runs it "
                             f"without one)")
    metrics = Metrics()
    scheduler = Scheduler(engine, max_queue, metrics)
    name = model_name or engine.path.name
    created = now()
    context = engine.context
    max_chars = context * _longest_token(engine.tokenizer)   # a longer text cannot fit the context
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specter-tokenize")  # off the event loop

    @asynccontextmanager
    async def lifespan(app):
        app.state.loop = asyncio.get_running_loop()
        yield
        scheduler.close()
        tokenizing.shutdown(wait=False, cancel_futures=True)

    def drain():
        """Shutdown: no new generations, queued ones 503, the running one stopped after shutdown_grace."""
        scheduler.drain(shutdown_grace)

    if docs:
        app = FastAPI(title="Specter", lifespan=lifespan)
    else:
        app = FastAPI(title="Specter", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.drain = scheduler, metrics, drain
    app.state.abort = scheduler.abort_now
    keys = [k.encode() for k in api_keys if k]
    if keys:
        app.add_middleware(RequireKey, keys=keys, protect_all=protect_all)
    if max_request_bytes:
        app.add_middleware(LimitBody, limit=max_request_bytes)
    if limit_concurrency:
        app.add_middleware(LimitConcurrency, limit=limit_concurrency)
    app.add_middleware(LimitHeaders, limit=MAX_HEADER_BYTES)
    app.add_middleware(CountRequests, metrics=metrics)
    if allowed_hosts:
        app.add_middleware(AllowedHosts, allowed_hosts=list(allowed_hosts))

    # ------------------------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    def broken() -> APIError | None:
        """A layer pipeline (torchrun) that cannot go on: 503 for every request until it is restarted."""
        why = getattr(engine.decoder, "broken", None)
        if not why:
            return None
        said = why if "the pipeline is broken" in why else f"the pipeline is broken ({why})"  # (group.py's says it)
        return APIError(503, f"{said}; restart the server", type="server_error", code="pipeline_broken")

    @app.exception_handler(SpecterError)
    async def _specter_error(request, e: SpecterError):
        if (down := broken()) is not None:  # the generation failed because a rank did
            return JSONResponse(down.body(), 503)
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        return JSONResponse(APIError(400, str(e), code=code).body(), 400)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errors = e.errors()
        if errors[0]["type"] == "json_invalid":
            why = errors[0].get("ctx", {}).get("error", errors[0]["msg"])
            return JSONResponse(APIError(400, f"the body is not valid JSON ({why})").body(), 400)
        if tuple(errors[0]["loc"]) == ("body",):  # no body, or not an object (or not sent as JSON)
            what = "empty" if errors[0]["type"] == "missing" else "not a JSON object"
            return JSONResponse(APIError(400, f"the request body is {what}: send the request as a JSON object, "
                                              f"with Content-Type: application/json").body(), 400)
        # a value our own validator refused (lone surrogates ...) says why; the alternatives it was not are noise
        errors = [err for err in errors if err["type"] == "value_error"] or errors
        param = _param(errors[0]["loc"])
        # a field with alternatives (str | list[int] ...) fails once per alternative: say them all
        msgs = dict.fromkeys(err["msg"].removeprefix("Value error, ") for err in errors
                             if _param(err["loc"])[:len(param)] == param)
        text = " or ".join(msgs)
        return JSONResponse(APIError(400, f"{param}: {text}" if param else text, param=param or None).body(), 400)

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        # an OpenAI-shaped body without the exception's text (starlette re-raises it after this answer, and
        # uvicorn logs the traceback); the connection closes, as its state is unknown
        return JSONResponse(internal_error().body(), 500, headers={"Connection": "close"})

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        if e.status_code == 413:
            return JSONResponse(APIError(413, f"the request body is larger than this server accepts "
                                              f"({max_request_bytes} bytes, --max-request-bytes); send a shorter "
                                              f"prompt", code="request_too_large").body(), 413,
                                headers={"Connection": "close"})
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), e.status_code,
                            headers=e.headers)  # (a 405's Allow: the methods the path takes)

    # ------------------------------------------------------------------------------- routes
    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: load balancers' probes)
    async def health():
        if (down := broken()) is not None:
            return JSONResponse({"status": "pipeline broken", "model": name, "error": down.body()["error"]}, 503)
        return {"status": "ok", "model": name, "queue_depth": scheduler.waiting, "running": scheduler.running}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card():
        return {"id": name, "object": "model", "created": created, "owned_by": "specter",
                "max_model_len": engine.context, "policy": engine.policy}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_request(req)
        prompt = req.single_prompt()
        check_length(len(prompt), "tokens" if isinstance(prompt, list) else "characters", param="prompt")
        ids = await encode(prompt, param="prompt")
        room = max(context - len(ids), 1)  # a default never asks past the context; a request's own max_tokens may
        max_tokens = req.max_tokens or min(max_tokens_default or 16, room)
        return await answer(request, req, ids, max_tokens, chat=False)

    class Chat(ChatRequest):
        # every message costs the template at least one token: more messages than the context holds cannot
        # fit, and are refused before pydantic builds them (a 4 MiB body of tiny messages held the loop 0.5 s)
        messages: list[Message] = Field(min_length=1, max_length=context)

    async def chat(req, request: Request):
        check_request(req)
        if not getattr(engine.tokenizer, "chat_template", None):
            raise APIError(400, f"model {name!r} has no chat template, so it cannot chat; use /v1/completions "
                                f"with a plain prompt, or add a chat_template to its tokenizer_config.json",
                           param="messages", code="no_chat_template")
        messages = [m.as_template_dict() for m in req.messages]
        check_length(sum(len(m["content"]) for m in messages), "characters", param="messages")
        ids = await encode(messages, param="messages", code="invalid_messages")  # the template's refusal too
        room = max(context - len(ids), 1)
        max_tokens = req.max_completion_tokens or req.max_tokens or min(max_tokens_default or room, room)
        return await answer(request, req, ids, max_tokens, chat=True)

    chat.__annotations__.update(req=Chat)  # this app's own model (a string annotation would name the module's)
    app.post("/v1/chat/completions")(chat)

    # ------------------------------------------------------------------------------- input
    def check_request(req):
        """What needs no tokens: the model, unsupported and contradictory fields."""
        check_model(req.model)
        for param, why in req.unsupported():
            raise APIError(400, why, param=param, code="unsupported_parameter")
        for param, why in req.invalid():
            raise APIError(400, why, param=param)

    def check_length(n: int, unit: str, param: str):
        """Refuse a prompt that cannot fit the context before tokenizing it (no token is shorter than one
        character, none longer than the vocabulary's longest)."""
        bound = context if unit == "tokens" else max_chars
        if n > bound:
            raise APIError(400, f"this model's context is {context} tokens, and a prompt of {n} {unit} cannot fit "
                                f"in it (at most {bound} {unit} could); shorten the prompt", param=param,
                           code="context_length_exceeded")

    async def encode(prompt, param: str, code: str | None = None) -> list[int]:
        """Token ids, tokenized (or templated) on a thread of its own so that the event loop, /health and
        running streams never wait for another request's input; the engine's refusal (an empty prompt, a
        token id outside the vocabulary, messages the chat template refuses) names `param`."""
        try:
            return await asyncio.get_running_loop().run_in_executor(tokenizing, engine.encode, prompt)
        except SpecterError as e:
            raise APIError(400, str(e), param=param, code=code) from None

    # ---------------------------------------------------------------------------- generation
    def check_model(model_id):
        if model_id is not None and model_id != name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found", type="not_found_error")

    def sampling(req, ids: list[int], max_tokens: int, chat: bool) -> dict:
        if len(ids) >= context:
            raise APIError(400, f"this model's context is {context} tokens, and the prompt takes {len(ids)} of them, "
                                f"leaving none to generate; shorten the prompt", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        if len(ids) + max_tokens > context:
            which = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise APIError(400, f"this model's context is {context} tokens, but {len(ids) + max_tokens} were "
                                f"requested ({len(ids)} in the prompt, {max_tokens} to generate); shorten the "
                                f"prompt or lower {which}", param=which, code="context_length_exceeded")
        kw = dict(max_new_tokens=max_tokens, seed=req.seed, stop=req.stop)
        given = {f: getattr(req, f) for f in SAMPLING if getattr(req, f) is not None}
        if given:  # the request's own settings; OpenAI's defaults for the rest (temperature 1, top_p 1)
            kw.update(OPENAI_NEUTRAL, **given)
        return kw  # none: the engine applies the model's own (its generation_config.json; greedy if none)

    async def answer(request: Request, req, ids: list[int], max_tokens: int, chat: bool):
        kw = sampling(req, ids, max_tokens, chat)
        if (down := broken()) is not None:
            raise down
        try:
            job = scheduler.submit(ids, kw)
        except QueueFull:
            raise APIError(503, f"the server is busy: {scheduler.running} request generating and "
                                f"{scheduler.waiting} waiting, as many as --max-queue {max_queue} lets wait; "
                                f"retry shortly", type="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except ShuttingDown:
            raise shutting_down() from None
        reply = Reply(name, len(ids), chat)
        watch = Watch(job, request)
        streaming = False
        try:
            first = await watch.next()      # queued until the engine takes it: the status is not sent before
            if first is None:               # the client left while it waited
                return Response(status_code=499)  # nobody reads it; the status tells the request metric
            if first[0] == "error":
                raise reply.error(first[1])
            if req.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                watch.close()               # sse-starlette watches the connection from here on
                streaming = True

                async def client_left(message):
                    job.cancel()

                sse = dict(client_close_handler_callable=client_left)
                if SSE_GRACE:  # sse-starlette >= 3 ends streams on shutdown itself, unless given a grace period
                    sse["shutdown_grace_period"] = shutdown_grace + 5
                return EventSourceResponse(reply.events(job, first, include_usage), **sse)
            return await reply.collect(job, watch, first)
        finally:
            watch.close()
            if not streaming:
                job.cancel()  # the client left, or the answer is complete: stop the engine at its next cycle

    return app


def internal_error() -> APIError:
    ref = uuid.uuid4().hex[:12]
    log.error("internal error %s (the traceback follows or precedes this line)", ref)
    return APIError(500, f"internal server error (reference {ref} in the server log); the request may be retried",
                    type="server_error", code="internal_error")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another server or once it is back",
                    type="server_error", code="shutting_down", headers={"Connection": "close", "Retry-After": "5"})


def _longest_token(tokenizer) -> int:
    """An upper bound on the characters one token stands for: the vocabulary's longest entry as stored (byte-
    level and SentencePiece spellings are never shorter than their text)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


class Watch:
    """A job's events for a handler that also watches its connection: next() is the next event, or None
    once the client has disconnected."""

    def __init__(self, job: Job, request: Request):
        self.job = job
        self.gone = asyncio.ensure_future(self._disconnect(request.receive))

    @staticmethod
    async def _disconnect(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def next(self):
        if self.gone.done():
            return None
        get = asyncio.ensure_future(self.job.events.get())
        done, _ = await asyncio.wait((get, self.gone), return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        return None

    def close(self) -> None:
        self.gone.cancel()


class BodyTooLarge(HTTPException):
    def __init__(self):
        super().__init__(413, "Content Too Large")


class LimitBody:
    """ASGI middleware: a request body over `limit` bytes (by its Content-Length, before any of it is read,
    or as a chunked body arrives) ends in 413. The client's upload is then read and dropped, within
    bounds, before the connection closes: a client still sending would otherwise get a reset, not the 413."""

    DRAIN_BYTES, DRAIN_SECONDS = 64 * 2 ** 20, 5.0

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        over = length.isdigit() and int(length) > self.limit
        received, cut, done = 0, False, False

        async def limited():
            nonlocal received, cut, done
            if over:
                cut = True
                raise BodyTooLarge
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                done = not message.get("more_body", False)
                if received > self.limit:
                    cut = True
                    raise BodyTooLarge
            return message

        async def drained(message):
            if cut and not done and message["type"] == "http.response.body" and not message.get("more_body"):
                await send({**message, "more_body": True})
                await self._drain(receive)
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app(scope, limited, drained)

    async def _drain(self, receive) -> None:
        dropped = 0

        async def drop():
            nonlocal dropped
            while dropped < self.DRAIN_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                dropped += len(message.get("body", b""))

        try:
            await asyncio.wait_for(drop(), self.DRAIN_SECONDS)
        except asyncio.TimeoutError:
            pass


class LimitHeaders:
    """ASGI middleware: a request whose request line and headers take more than `limit` bytes gets 431.
    (The protocol answers 431 to headers that arrive in pieces over the limit, h11's incomplete-event cap;
    headers that arrive whole in one read pass it, up to about twice the limit, and are measured here.)"""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and header_bytes(scope) > self.limit:
            error = APIError(431, f"the request line and headers are larger than this server accepts ({self.limit} "
                                  f"bytes)", code="headers_too_large")
            return await JSONResponse(error.body(), 431, headers={"Connection": "close"})(scope, receive, send)
        await self.app(scope, receive, send)


def header_bytes(scope) -> int:
    """The request line and headers' size on the wire: `METHOD PATH?QUERY HTTP/1.1` and CRLF, `name: value`
    and CRLF a header, a blank line."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    line = len(scope["method"]) + 1 + len(path) + (len(query) + 1 if query else 0) + 1 + 10
    return line + sum(len(k) + 2 + len(v) + 2 for k, v in scope["headers"]) + 2


class LimitConcurrency:
    """ASGI middleware: at most `limit` requests answered at once (a stream counts until it ends); one
    more gets an OpenAI-style 503 with Retry-After (uvicorn's own limit counts connections, the refused one
    among them, and answers in plain text)."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.open = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.open >= self.limit:
            error = APIError(503, f"the server is answering {self.open} requests, as many as --limit-concurrency "
                                  f"{self.limit} allows; retry shortly", type="server_error", code="too_many_requests")
            return await JSONResponse(error.body(), 503, headers={"Retry-After": "1"})(scope, receive, send)
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1


class AllowedHosts:
    """starlette's TrustedHostMiddleware (a Host header not in `allowed_hosts` is refused: DNS rebinding),
    its plain-text refusal answered as an OpenAI-style 400 instead."""

    def __init__(self, app, allowed_hosts: list[str]):
        async def passed(scope, receive, send):
            scope["specter.host_allowed"] = True
            await app(scope, receive, send)

        self.app, self.hosts = TrustedHostMiddleware(passed, allowed_hosts=allowed_hosts, www_redirect=False), \
            allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def answer(message):
            if scope.get("specter.host_allowed"):
                return await send(message)
            if message["type"] == "http.response.start":  # the refusal: ours instead
                host = Headers(scope=scope).get("host", "")
                error = APIError(400, f"the Host header {host!r} is not one this server answers to "
                                      f"(--allowed-hosts {','.join(self.hosts)})", param=None, code="invalid_host")
                await JSONResponse(error.body(), 400)(scope, receive, send)

        await self.app(scope, receive, answer)


class RequireKey:
    """ASGI middleware: /v1 routes (or all) want `Authorization: Bearer KEY` with one of `keys`."""

    def __init__(self, app, keys: list[bytes], protect_all: bool):
        self.app, self.keys, self.protect_all = app, keys, protect_all

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (self.protect_all or path == "/v1" or path.startswith("/v1/")):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            token = token.strip().encode()
            # compare_digest against every key: the time taken tells nothing about which one nearly matched
            if scheme.lower() != "bearer" or not sum(hmac.compare_digest(token, k) for k in self.keys):
                why = ("no API key: send the header Authorization: Bearer YOUR_KEY (the openai client's api_key)"
                       if not token else "the API key is not one this server accepts")
                response = JSONResponse(APIError(401, why, code="invalid_api_key").body(), 401,
                                        headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class CountRequests:
    """ASGI middleware: count answers by route and status (reads only `send`, so disconnects still reach
    the handlers)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


class Reply:
    """One response, as a JSON body or as SSE chunks, in the endpoint's OpenAI format."""

    def __init__(self, model: str, prompt_tokens: int, chat: bool):
        self.model, self.prompt_tokens, self.chat = model, prompt_tokens, chat
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl"), now()

    def _chunk(self, choices: list, **extra) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def _choice(self, text: str | None, finish: str | None, *, whole: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish}
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def _usage(self, stats: dict) -> dict:
        return usage(self.prompt_tokens, stats.get("generated_tokens", 0))  # (the stop's token counts, as vLLM's)

    @staticmethod
    def error(e: Exception) -> Exception:
        """The exception a handler raises for a job's error event (a 500 for a bug: its text is logged only)."""
        if isinstance(e, (SpecterError, APIError)):
            return e
        if isinstance(e, ShuttingDown):
            return shutting_down()
        error = internal_error()
        error.headers = {"Connection": "close"}
        return error

    async def collect(self, job: Job, watch: Watch, first: tuple):
        pieces = []
        event = first
        while True:
            if event is None:
                return Response(status_code=499)  # nobody reads it; the status tells the request metric
            kind, value = event
            if kind == "piece":
                pieces.append(value)
            elif kind == "error":
                raise self.error(value)
            elif kind == "done":
                choice = self._choice("".join(pieces), value["finish_reason"], whole=True)
                obj = "chat.completion" if self.chat else "text_completion"
                return JSONResponse({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                     "choices": [choice], "usage": self._usage(value), "specter": _jsonable(value)})
            event = await watch.next()

    async def events(self, job: Job, first: tuple, include_usage: bool):
        """SSE data: role (chat), text pieces, the finish (with Specter's stats), usage, [DONE]; after an
        error (the engine's, or a bug here), an error event and [DONE]."""
        try:
            async for data in self._events(job, first, include_usage):
                yield data
        except Exception as e:  # a bug while streaming: the traceback to the log, the client a clean end
            log.error("streaming failed", exc_info=e)
            yield _dump(internal_error().body())
            yield "[DONE]"
        finally:
            job.cancel()  # the client went away (or we are done): stop the engine at its next cycle

    async def _events(self, job: Job, event: tuple, include_usage: bool):
        if self.chat:
            yield _dump(self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]))
        while True:
            kind, value = event
            if kind == "piece":
                yield _dump(self._chunk([self._choice(value, None)]))
            elif kind == "done":
                yield _dump(self._chunk([self._choice(None if self.chat else "", value["finish_reason"])],
                                           specter=_jsonable(value)))
                if include_usage:
                    yield _dump(self._chunk([], usage=self._usage(value)))
                yield "[DONE]"
                return
            else:
                error = self.error(value)
                body = error.body() if isinstance(error, APIError) else APIError(400, str(error)).body()
                yield _dump(body)
                yield "[DONE]"
                return
            event = await job.events.get()


def _param(loc) -> str:
    """Validation error location -> OpenAI's param ("messages.0.role"), without pydantic's union tags."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(p for p in parts if "[" not in p and p not in ("str", "int", "float", "bool", "dict", "list"))


def _dump(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _jsonable(stats: dict) -> dict:
    """Stats as JSON can carry them: NaN/inf (not JSON) become null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}
