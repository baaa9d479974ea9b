"""The engine: load once, then generate / stream / stream_ids / astream.

A policy is a *decoder*: an object whose `run(prompt_ids, params, max_new)` yields lists of
committed token ids (one token a step for plain decoding, several a cycle for speculation) and
whose `stats()` reports what it did. The engine owns everything around it: prompts and
tokenizers, validation, stop conditions, detokenisation, timing, and turns: one engine runs one
generation at a time (they share the slot pool, the planner and the KV cache), so concurrent
callers wait for their turn in arrival order and get exactly the text they would get alone.
"""
from __future__ import annotations

import asyncio
import bisect
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator

import torch

from . import sansio
from .config import ModelSpec
from .errors import ConfigError, ContextLengthError, TokenizerError
from .generation_defaults import choose, describe
from .layers import KVCache
from .model import MoETransformer
from .moe import ExpertWeights
from .sampling import SamplingParams, sample

# every generation reports every key, one schema for all: counts are 0 where nothing happened, ratios
# None where they do not apply (acceptance without drafting, recall without prefetching); and what it
# sampled with: `sampling` ("greedy", "temperature 0.7, top-p 0.95, ...") and `sampling_from`
# ("caller", "model": the model's generation_config.json, "none": greedy, as nothing was set)
STATS_DEFAULTS = dict(ttft_s=0.0, tpot_s=0.0, new_tokens=0, cycles=0, accepted_per_cycle=None, acceptance_rate=None,
                      draft_efficiency=None, k_histogram={}, expert_hits=0, expert_misses=0, prefetch_issued=0,
                      prefetch_used=0, prefetch_cancelled=0, prefetch_recall=None, route_coverage=None, h2d_bytes=0, stall_s=0.0,
                      decode_stall_s=0.0, draft_s=0.0, verify_s=0.0, drafted_tokens=0, truncated_tokens=0,
                      accepted_tokens=0, rejections=0, compiled=[])

POLICIES = ("resident", "on-demand", "next-layer", "spec-lru", "specter")
BENCH_POLICIES = POLICIES + ("oracle",)  # oracle needs the whole run in advance: benchmarks only


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]            # new tokens only
    stats: dict = field(default_factory=dict)


class PlainDecoder:
    """Prefill, then one target step per token. `experts` decides where expert bytes come from."""

    def __init__(self, model: MoETransformer, experts, device, dtype):
        self.model, self.experts, self.device, self.dtype = model, experts, device, dtype

    def run(self, prompt: list[int], params: SamplingParams, max_new: int) -> Iterator[list[int]]:
        """Lists of one committed token id (blocking)."""
        return sansio.iterate(self._body(prompt, params, max_new))

    async def arun(self, prompt: list[int], params: SamplingParams, max_new: int) -> AsyncIterator[list[int]]:
        """`run` on the running event loop: the offload manager's copies are awaited."""
        async for chunk in sansio.aiterate(self._body(prompt, params, max_new)):
            yield chunk

    def _body(self, prompt: list[int], params: SamplingParams, max_new: int):
        spec = self.model.spec
        cache = KVCache(spec, len(prompt) + max_new, self.device, self.dtype)
        gen = params.generator(self.device)
        hist = params.history(prompt, self.device)  # what penalties look at
        tokens = torch.tensor(prompt, device=self.device)
        logits = yield from self.model.body(tokens, 0, cache, self.experts, logits_for="last")  # [1, V]
        pos = len(prompt)
        for _ in range(max_new):
            tok = sample(logits, params, gen, hist)  # [1]
            hist.commit([int(tok)])
            yield sansio.Emit([int(tok)])
            logits = yield from self.model.body(tok, pos, cache, self.experts)
            pos += 1

    def stats(self) -> dict:
        return dict(getattr(self.experts, "stats", lambda: {})())

    def reset_stats(self) -> None:
        if hasattr(self.experts, "reset_stats"):
            self.experts.reset_stats()

    def close(self) -> None:
        getattr(self.experts, "close", lambda: None)()


class Turns:
    """One generation at a time on an engine, served in arrival order (a ticket lock)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._next = self._serving = 0
        self._owner: int | None = None  # thread running the current generation

    @property
    def waiting(self) -> int:
        """Generations queued behind the running one."""
        with self._cv:
            return self._next - self._serving - (self._owner is not None)

    @contextmanager
    def turn(self):
        me = threading.get_ident()
        with self._cv:
            if self._owner == me:
                raise ConfigError("this thread is already generating on this engine (a stream it has not "
                                  "finished); finish or close that stream before starting another")
            ticket, self._next = self._next, self._next + 1
            self._cv.wait_for(lambda: self._serving == ticket)
            self._owner = me
        try:
            yield
        finally:
            with self._cv:
                self._owner = None
                self._serving += 1
                self._cv.notify_all()


def stop_list(stop) -> list[str]:
    """None, a string or a list of strings -> a list of non-empty stop strings (else a ConfigError)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stops):
        raise ConfigError("an empty stop string matches at once; remove it")
    return list(stops)


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop string (not yet printable)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


class Engine:
    def __init__(self, model: MoETransformer, experts: list[ExpertWeights], tokenizer, *, path: Path,
                 device: torch.device, dtype: torch.dtype, policy: str, decoder, generation_defaults: dict | None = None):
        self.model, self.expert_weights, self.tokenizer = model, experts, tokenizer
        self.path, self.device, self.dtype, self.policy = path, device, dtype, policy
        self.decoder = decoder
        self.turns = Turns()
        self._generation_defaults = dict(generation_defaults or {})
        SamplingParams(**self._generation_defaults)  # valid, or a ConfigError now rather than at each call

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    @property
    def generation_defaults(self) -> dict:
        """The model's own sampling keywords (from its generation_config.json; {} = greedy): what a
        generation that passes no sampling keyword uses. Override one of them with
        generate(..., **{**engine.generation_defaults, "temperature": 0.5})."""
        return dict(self._generation_defaults)

    def sampling_params(self, sampling: dict) -> tuple[SamplingParams, str]:
        """(params, source) for a call's sampling keywords: the caller's own when they give any (a seed
        alone does not count), else the model's defaults. source: "caller", "model" or "none"."""
        chosen, source = choose(sampling, self._generation_defaults)
        return SamplingParams.from_kwargs(chosen), source

    # ------------------------------------------------------------------------------- prompts
    def encode(self, prompt) -> list[int]:
        """A string, a list of token ids, or a chat (list of {"role", "content"} dicts)."""
        if isinstance(prompt, str):
            tok = self._need_tokenizer("a string prompt cannot be encoded; pass a list of token ids "
                                       "(CLI: --prompt-ids)")
            ids = tok(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            tok = self._need_tokenizer("a chat prompt cannot be rendered; pass a list of token ids")
            if not getattr(tok, "chat_template", None):
                raise TokenizerError(f"the tokenizer in {self.path} has no chat template, so chat messages cannot be "
                                     "rendered; pass a plain string prompt (CLI: drop --chat/--system)")
            ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})")
        else:
            raise ConfigError("prompt must be a string, a list of token ids, or a list of chat messages")
        if not ids:
            raise ConfigError("the prompt is empty: give at least one token")
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _need_tokenizer(self, consequence: str):
        if self.tokenizer is None:
            raise TokenizerError(f"{self.path} ships no tokenizer, so {consequence}")
        return self.tokenizer

    # ---------------------------------------------------------------------------- generation
    def generate(self, prompt, max_new_tokens: int = 128, *, stop=None, **sampling) -> GenerationOutput:
        """The whole continuation at once.

        sampling: temperature (0 = greedy), top_p, top_k, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, seed (see specter.sampling.SamplingParams). None of them (a seed alone
        included): the model's own settings, `generation_defaults`; any of them: exactly those, the
        others at their neutral values (temperature 0 = greedy). stop: a string or a list; the
        text ends before the first one, and token_ids end with the token that completes that text."""
        stats: dict = {}
        new, text = [], ""
        for new, text in self._generation(prompt, max_new_tokens, stop, sampling, stats, None):
            pass
        return GenerationOutput(text=text or "", token_ids=list(new), stats=stats)

    def stream(self, prompt, max_new_tokens: int = 128, *, stop=None, stats: dict | None = None,
               cancel: threading.Event | None = None, **sampling) -> Iterator[str]:
        """Text pieces as tokens are committed; they join to generate()'s text. Text that could be the
        start of a stop string is held back until it is known not to be. Pass a dict as `stats` to
        receive the stats; set `cancel` (from any thread) to end the generation at the next cycle.
        The engine is this stream's from its first piece until it is exhausted or closed."""
        self._need_tokenizer("there is no text to stream; use stream_ids() or generate()")
        for _, text in self._pieces(prompt, max_new_tokens, stop, sampling, stats, cancel):
            if text:
                yield text

    def stream_ids(self, prompt, max_new_tokens: int = 128, *, stop=None, stats: dict | None = None,
                   cancel: threading.Event | None = None, **sampling) -> Iterator[list[int]]:
        """Lists of new token ids as they are committed (no tokenizer needed); they join to
        generate()'s token_ids."""
        for ids, _ in self._pieces(prompt, max_new_tokens, stop, sampling, stats, cancel):
            if ids:
                yield ids

    async def astream(self, prompt, max_new_tokens: int = 128, **kwargs) -> AsyncIterator[str]:
        """`stream` for asyncio code. The generation runs in its own thread (so waiting for the engine's
        turn never blocks the event loop or its executor); leaving the loop early, or cancelling the
        task, ends the generation at its next cycle."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        end = object()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: nobody is listening
                cancel.set()

        def produce() -> None:
            try:
                for piece in self.stream(prompt, max_new_tokens, cancel=cancel, **kwargs):
                    put(piece)
            except BaseException as e:  # handed to the consumer, raised there
                put(e)
            put(end)

        threading.Thread(target=produce, name="specter-astream", daemon=True).start()
        try:
            while (item := await queue.get()) is not end:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancel.set()

    def _pieces(self, prompt, max_new_tokens, stop, sampling, stats, cancel) -> Iterator[tuple[list[int], str]]:
        """(new token ids, new text) as they become final: nothing that a stop string could still cut."""
        stops = stop_list(stop)
        stats = {} if stats is None else stats
        sent, printed = 0, 0
        new, text = [], None
        for new, text in self._generation(prompt, max_new_tokens, stop, sampling, stats, cancel):
            if text is None:  # no tokenizer (and so no stop strings)
                ids_end, text_end = len(new), 0
            else:
                text_end = len(text) - held_back(text, stops)
                if text[:text_end].endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                    continue
                ids_end = len(new) if text_end == len(text) else self._tokens_within(new, text_end)
            if ids_end > sent or text_end > printed:
                yield new[sent:ids_end], (text or "")[printed:text_end]
                sent, printed = max(sent, ids_end), max(printed, text_end)
        if len(new) > sent or len(text or "") > printed:  # the end: nothing is held back any more
            yield new[sent:], (text or "")[printed:]

    def _generation(self, prompt, max_new_tokens, stop, sampling, stats: dict, cancel
                    ) -> Iterator[tuple[list[int], str | None]]:
        """Validates, waits for the engine's turn, decodes. Yields (new ids so far, their text or None
        without a tokenizer) after each committed chunk, both cut at a stop string; fills `stats`."""
        params, source = self.sampling_params(sampling)
        stats.update(sampling=describe(params), sampling_from=source)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stops = stop_list(stop)
        if stops:
            self._need_tokenizer("stop strings cannot be matched; stop on max_new_tokens or the EOS token")
        ids = self.encode(prompt)
        limit = self.spec.max_position
        if len(ids) + max_new_tokens > limit:
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} "
                f"exceeds the model's context of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )
        with self.turns.turn():
            if cancel is not None and cancel.is_set():  # cancelled while waiting for the turn
                stats.update(STATS_DEFAULTS, finish_reason="cancelled", prompt_tokens=len(ids), policy=self.policy)
                return
            yield from self._decode(ids, max_new_tokens, params, stops, stats, cancel)

    def _decode(self, ids, max_new_tokens, params, stops, stats, cancel):
        eos = set(self.spec.eos_token_ids)
        longest = max(map(len, stops), default=0)
        self.decoder.reset_stats()
        new: list[int] = []
        checked = 0  # text before this offset holds no stop string
        finish = "length"
        t0 = time.perf_counter()
        t_first = None
        run = self.decoder.run(ids, params, max_new_tokens)
        try:
            for chunk in run:
                if t_first is None:
                    t_first = time.perf_counter()
                    prefill_stall = self.decoder.stats().get("stall_s", 0.0)
                done = False
                for t in chunk:
                    new.append(t)
                    if t in eos or len(new) >= max_new_tokens:
                        done, finish = True, "stop" if t in eos else "length"
                        break
                text = self.decode(new) if self.tokenizer is not None else None
                if stops:
                    start = max(0, checked - longest + 1)
                    hit = min((i for s in stops if (i := text.find(s, start)) >= 0), default=-1)
                    checked = len(text)
                    if hit >= 0:
                        text, new, done, finish = text[:hit], new[:self._tokens_for(new, hit)], True, "stop"
                yield new, text
                if done:
                    break
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
        finally:
            run.close()
        t_end = time.perf_counter()
        if t_first is None:
            t_first, prefill_stall = t_end, 0.0
        stats.update(STATS_DEFAULTS)
        stats.update(self.decoder.stats())
        stats.update(
            decode_stall_s=stats["stall_s"] - prefill_stall,  # copies waited on after the first token
            ttft_s=t_first - t0,
            tpot_s=(t_end - t_first) / max(len(new) - 1, 1),
            new_tokens=len(new),
            prompt_tokens=len(ids),
            total_s=t_end - t0,
            policy=self.policy,
            finish_reason=finish,  # OpenAI's: "stop" (EOS or a stop string), "length", or "cancelled"
        )

    def _tokens_for(self, new: list[int], n_chars: int) -> int:
        """The fewest leading tokens whose text reaches `n_chars` characters (the text up to a stop)."""
        return bisect.bisect_left(range(len(new) + 1), n_chars, key=lambda j: len(self.decode(new[:j])))

    def _tokens_within(self, new: list[int], n_chars: int) -> int:
        """The most leading tokens whose text fits in `n_chars` characters."""
        return bisect.bisect_right(range(len(new) + 1), n_chars, key=lambda j: len(self.decode(new[:j]))) - 1

    def close(self) -> None:
        if hasattr(self.decoder, "close"):
            self.decoder.close()
