"""The HTTP surface: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

A handler validates everything it can before the request queues (a bad request never waits for
the engine), hands token ids to the scheduler, and turns the job's pieces into one JSON body or
an SSE stream (OpenAI's chunk format, `data: [DONE]` last). Specter's stats ride along in an
extra field, "specter".
"""
from __future__ import annotations

import asyncio
import json
import math
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from ..errors import ContextLengthError, SpecterError
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, new_id, now, usage
from .scheduler import Job, QueueFull, Scheduler

# request fields that choose how tokens are drawn; a request that sets none of them gets the model's own
# settings, as vLLM's --generation-config auto does; one that sets any gets OpenAI's defaults for the rest
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
OPENAI_NEUTRAL = dict(temperature=1.0, top_p=1.0)
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


def create_app(engine, *, model_name: str | None = None, max_queue: int = 32) -> FastAPI:
    """An OpenAI-compatible app over one loaded engine (which the caller keeps and closes)."""
    metrics = Metrics()
    scheduler = Scheduler(engine, max_queue, metrics)
    name = model_name or engine.path.name
    created = now()

    @asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()

    app = FastAPI(title="Specter", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(CountRequests, metrics=metrics)

    # ------------------------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(SpecterError)
    async def _specter_error(request, e: SpecterError):
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        return JSONResponse(APIError(400, str(e), code=code).body(), 400)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errors = e.errors()
        if errors[0]["type"] == "json_invalid":
            why = errors[0].get("ctx", {}).get("error", errors[0]["msg"])
            return JSONResponse(APIError(400, f"the body is not valid JSON ({why})").body(), 400)
        param = _param(errors[0]["loc"])
        # a field with alternatives (str | list[int] ...) fails once per alternative: say them all
        msgs = dict.fromkeys(err["msg"] for err in errors if _param(err["loc"])[:len(param)] == param)
        text = " or ".join(msgs)
        return JSONResponse(APIError(400, f"{param}: {text}" if param else text, param=param or None).body(), 400)

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):  # still an OpenAI-shaped body; uvicorn logs the traceback
        return JSONResponse(APIError(500, f"internal error: {e!r}", type="server_error").body(), 500)

    @app.exception_handler(HTTPException)
    async def _http(request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), e.status_code)

    # ------------------------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "queue_depth": scheduler.waiting, "running": scheduler.running}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card():
        return {"id": name, "object": "model", "created": created, "owned_by": "specter",
                "max_model_len": engine.spec.max_position, "policy": engine.policy}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        ids = engine.encode(req.single_prompt())
        return await answer(request, req, ids, req.max_tokens or 16, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        if not getattr(engine.tokenizer, "chat_template", None):
            raise APIError(400, f"model {name!r} has no chat template, so it cannot chat; use /v1/completions "
                                f"with a plain prompt, or add a chat_template to its tokenizer_config.json",
                           param="messages", code="no_chat_template")
        try:
            ids = engine.encode([m.as_template_dict() for m in req.messages])
        except SpecterError:
            raise
        except Exception as e:  # the template's own checks (jinja's raise_exception: "roles must alternate" ...)
            raise APIError(400, f"the chat template of {name!r} refused these messages: {e}", param="messages",
                           code="invalid_messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens or max(engine.spec.max_position - len(ids), 1)
        return await answer(request, req, ids, max_tokens, chat=True)

    # ---------------------------------------------------------------------------- generation
    def check_model(model_id):
        if model_id is not None and model_id != name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found", type="not_found_error")

    def sampling(req, ids: list[int], max_tokens: int) -> dict:
        check_model(req.model)
        for param, why in req.unsupported():
            raise APIError(400, why, param=param, code="unsupported_parameter")
        context = engine.spec.max_position
        if len(ids) + max_tokens > context:
            raise APIError(400, f"this model's context is {context} tokens, but {len(ids) + max_tokens} were "
                                f"requested ({len(ids)} in the prompt, {max_tokens} to generate); shorten the "
                                f"prompt or lower max_tokens", param="max_tokens", code="context_length_exceeded")
        if req.stop and engine.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model ships none", param="stop")
        kw = dict(max_new_tokens=max_tokens, seed=req.seed, stop=req.stop)
        given = {f: getattr(req, f) for f in SAMPLING if getattr(req, f) is not None}
        if given:  # the request's own settings; OpenAI's defaults for the rest (temperature 1, top_p 1)
            kw.update(OPENAI_NEUTRAL, **given)
        return kw  # none: the engine applies the model's own (its generation_config.json; greedy if none)

    async def answer(request: Request, req, ids: list[int], max_tokens: int, chat: bool):
        kw = sampling(req, ids, max_tokens)
        try:
            job = scheduler.submit(ids, kw)
        except QueueFull:
            raise APIError(503, f"the server is busy: one request is generating and {scheduler.waiting} wait "
                                f"(--max-queue {max_queue}); retry shortly",
                           type="server_error", code="queue_full", headers={"Retry-After": "1"}) from None
        reply = Reply(name, len(ids), chat)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(reply.events(job, include_usage))
        return await reply.collect(job, request)

    return app


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
        return usage(self.prompt_tokens, stats.get("new_tokens", 0))

    async def collect(self, job: Job, request: Request):
        try:
            return await self._collect(job, request)
        finally:
            job.cancel()  # the client left, or the server is shutting down: stop the engine at its next cycle

    async def _collect(self, job: Job, request: Request):
        pieces = []
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), 0.25)
            except asyncio.TimeoutError:
                kind = None
            if await request.is_disconnected():
                return Response(status_code=499)  # nobody reads it; the status tells the request metric
            if kind == "piece":
                pieces.append(value)
            elif kind == "error":
                raise value if isinstance(value, SpecterError) else APIError(500, f"generation failed: {value!r}",
                                                                               type="server_error")
            elif kind == "done":
                choice = self._choice("".join(pieces), value["finish_reason"], whole=True)
                obj = "chat.completion" if self.chat else "text_completion"
                return JSONResponse({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                     "choices": [choice], "usage": self._usage(value), "specter": _jsonable(value)})

    async def events(self, job: Job, include_usage: bool):
        """SSE data: role (chat), text pieces, the finish (with Specter's stats), usage, [DONE]."""
        try:
            if self.chat:
                yield _dump(self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]))
            while True:
                kind, value = await job.events.get()
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
                    status = 400 if isinstance(value, SpecterError) else 500
                    yield _dump(APIError(status, str(value), type="invalid_request_error" if status == 400
                                         else "server_error").body())
                    return
        finally:
            job.cancel()  # the client went away (or we are done): stop the engine at its next cycle


def _param(loc) -> str:
    """Validation error location -> OpenAI's param ("messages.0.role"), without pydantic's union tags."""
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(p for p in parts if "[" not in p and p not in ("str", "int", "float", "bool", "dict", "list"))


def _dump(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _jsonable(stats: dict) -> dict:
    """Stats as JSON can carry them: NaN/inf (not JSON) become null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}
