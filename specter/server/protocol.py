"""The OpenAI wire format: strictly validated request bodies, error bodies, response pieces.

Requests are validated strictly (no "0.5" for 0.5, no unknown fields): a field we do not know or
cannot honour is refused with a 400 naming it, never silently ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ..sampling import SEED_MAX, SEED_MIN
from ..streaming import not_unicode

MAX_STOPS, MAX_STOP_CHARS = 16, 1000          # each stop string is searched for after every chunk: bounded


def _unicode(text: str) -> str:
    """JSON may carry a lone surrogate ("\\ud800"), which is no text: refuse it before a tokenizer meets it."""
    if (why := not_unicode(text)) is not None:
        raise ValueError(f"the text: {why} (escape pairs \\ud83d\\ude00 are fine)")
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share. None means "the default"."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)  # OpenAI's range
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)                          # extension (as vLLM): 0 = off
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)       # 64 bits, as OpenAI's
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # extension (as vLLM)
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # extension (as vLLM)
    logit_bias: dict[str, float] | None = None
    user: Text | None = None                                       # identifies the caller; not used

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if any(s == "" for s in stops):
            raise ValueError("a stop string must not be empty")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings a request, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters long, got one of "
                             f"{max(map(len, stops))}")
        return v

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for every field whose value asks for something Specter does not do."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", "n > 1 is not supported: the engine decodes one sequence per request (send n requests)"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        return out

    def invalid(self) -> list[tuple[str, str]]:
        """(field, why) for fields that contradict each other."""
        if self.stream_options is not None and not self.stream:
            return [("stream_options", "stream_options is only allowed when stream is true")]
        return []


class CompletionRequest(_Sampling):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    suffix: Text | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = Field(None, ge=1)

    def unsupported(self):
        out = super().unsupported()
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.logprobs is not None:  # 0 too: it asks for the chosen tokens' logprobs
            out.append(("logprobs", "logprobs are not supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of > 1 is not supported"))
        return out

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):  # a batch of prompts
            if len(p) != 1:
                raise APIError(400, f"a batch of {len(p)} prompts is not supported: send one prompt a request",
                               param="prompt")
            return p[0]
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def as_template_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self):
        out = super().unsupported()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "logprobs are not supported"))
        if self.response_format and self.response_format.get("type") != "text":
            out.append(("response_format", "only response_format {\"type\": \"text\"} is supported"))
        if self.tools or self.tool_choice not in (None, "none"):
            out.append(("tools", "tool calling is not supported"))
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            out.append(("max_completion_tokens", "max_tokens and max_completion_tokens disagree; give one"))
        return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
