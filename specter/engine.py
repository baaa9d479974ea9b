"""The engine: load once, then generate / stream / stream_ids / astream.

A policy is a *decoder*: an object whose `run(prompt_ids, params, max_new)` yields lists of
committed token ids (one token a step for plain decoding, several a cycle for speculation) and
whose `stats()` reports what it did. The engine owns everything around it: prompts and
tokenizers, validation, stop conditions, detokenisation, timing, and turns: one engine runs one
generation at a time (they share the slot pool, the planner and the KV cache), so concurrent
callers wait for their turn in arrival order and get exactly the text they would get alone.

`driver` (set by the builder: "async" on CUDA, "sync" on CPU) says how a decoder's generation is
driven (specter/sansio.py): "sync" blocks on each wait; "async" runs the decoder's `arun` on an event
loop -- the caller's for `astream`, one of the generation thread's own for the blocking API.
"""
from __future__ import annotations

import asyncio
import bisect
import threading
import time
from contextlib import asynccontextmanager, contextmanager
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
# ("caller", "model": the model's generation_config.json, "none": greedy, as nothing was set); how
# expert bytes reach the device, `h2d_path` ("pinned store", "staging buffers (2 x N MiB)", "emulated
# (host memory)" on CPU; None when nothing is copied); `cuda_graphs` (speculative engines under CUDA
# graphs: recordings, recorded, bytes, warmups, threads so far; None without graphs)
STATS_DEFAULTS = dict(ttft_s=0.0, tpot_s=0.0, new_tokens=0, cycles=0, accepted_per_cycle=None, acceptance_rate=None,
                      draft_efficiency=None, k_histogram={}, expert_hits=0, expert_misses=0, prefetch_issued=0,
                      prefetch_used=0, prefetch_cancelled=0, prefetch_recall=None, route_coverage=None, h2d_bytes=0, stall_s=0.0,
                      decode_stall_s=0.0, draft_s=0.0, verify_s=0.0, drafted_tokens=0,
                      accepted_tokens=0, rejections=0, compiled=[], h2d_path=None, cuda_graphs=None)


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
        self._owner: tuple | None = None  # (thread, task or None) running the current generation
        self._abandoned: set[int] = set()  # tickets of coroutines cancelled while they waited

    @property
    def waiting(self) -> int:
        """Generations queued behind the running one."""
        with self._cv:
            return self._next - self._serving - (self._owner is not None) - len(self._abandoned)

    def _take(self, task=None) -> int:
        """A ticket. Refused to a thread (a task) already holding the turn: waiting would deadlock it
        (a blocking call on a loop thread whose coroutine holds the turn waits for that thread too)."""
        me = (threading.get_ident(), task)
        if self._owner is not None and (self._owner == me or (task is None and self._owner[0] == me[0])):
            raise ConfigError("this thread is already generating on this engine (a stream it has not "
                              "finished); finish or close that stream before starting another")
        ticket, self._next = self._next, self._next + 1
        return ticket

    def _release(self) -> None:
        """The turn passes to the next ticket still waiting; called with the lock held."""
        self._owner = None
        self._serving += 1
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._cv.notify_all()

    @asynccontextmanager
    async def aturn(self):
        """`turn` for a coroutine: its wait polls, so the loop runs meanwhile; same arrival order as
        the threads'. A coroutine cancelled while it waits gives its ticket up."""
        task = asyncio.current_task()
        with self._cv:
            ticket = self._take(task)
        try:
            await sansio.poll(lambda: self._serving == ticket, spin=0.0, every=5e-3)  # a turn takes a while
        except BaseException:
            with self._cv:
                if self._serving == ticket:  # served just as it was cancelled: pass the turn on
                    self._release()
                else:
                    self._abandoned.add(ticket)
            raise
        with self._cv:
            self._owner = (threading.get_ident(), task)
        try:
            yield
        finally:
            with self._cv:
                self._release()

    @contextmanager
    def turn(self):
        with self._cv:
            ticket = self._take()
            self._cv.wait_for(lambda: self._serving == ticket)
            self._owner = (threading.get_ident(), None)
        try:
            yield
        finally:
            with self._cv:
                self._release()


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
        self.driver = "sync"  # or "async": how generations are driven (the builder sets it per device)
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
        """`stream` for asyncio code; leaving the loop early, or cancelling the task, ends the generation
        at its next cycle. driver "async": the generation runs on the caller's loop (its waits are
        awaited; compute between them runs on the loop's thread). driver "sync": in a thread of its
        own, so neither waiting for the engine's turn nor computing blocks the loop."""
        if self.driver == "async" and hasattr(self.decoder, "arun"):
            async for piece in self._astream_here(prompt, max_new_tokens, **kwargs):
                yield piece
            return
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

    async def _astream_here(self, prompt, max_new_tokens: int = 128, *, stop=None, stats: dict | None = None,
                            **sampling) -> AsyncIterator[str]:
        """astream on the caller's loop (driver "async"): `_pieces` over the decoder's `arun`."""
        self._need_tokenizer("there is no text to stream; use stream_ids() or generate()")
        stats = {} if stats is None else stats
        ids, params, stops = self._prepare(prompt, max_new_tokens, stop, sampling, stats)
        printer = _Printer(self, stops)
        async with self.turns.aturn():
            d = _Decoding(self, ids, max_new_tokens, stops)
            run = self.decoder.arun(ids, params, max_new_tokens)
            try:
                async for chunk in run:
                    if (piece := printer.feed(*d.feed(chunk))) is not None and piece[1]:
                        yield piece[1]
                    if d.done:
                        break
            finally:
                await run.aclose()
            d.finish(stats)
        if (piece := printer.end()) is not None and piece[1]:
            yield piece[1]

    def _pieces(self, prompt, max_new_tokens, stop, sampling, stats, cancel) -> Iterator[tuple[list[int], str]]:
        """(new token ids, new text) as they become final: nothing that a stop string could still cut."""
        printer = _Printer(self, stop_list(stop))
        for new, text in self._generation(prompt, max_new_tokens, stop, sampling, {} if stats is None else stats,
                                          cancel):
            if (piece := printer.feed(new, text)) is not None:
                yield piece
        if (piece := printer.end()) is not None:  # the end: nothing is held back any more
            yield piece

    def _prepare(self, prompt, max_new_tokens, stop, sampling, stats: dict) -> tuple[list[int], SamplingParams, list]:
        """Validated (prompt ids, sampling params, stop strings); `stats` gets the sampling settings."""
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
        return ids, params, stops

    def _generation(self, prompt, max_new_tokens, stop, sampling, stats: dict, cancel
                    ) -> Iterator[tuple[list[int], str | None]]:
        """Validates, waits for the engine's turn, decodes. Yields (new ids so far, their text or None
        without a tokenizer) after each committed chunk, both cut at a stop string; fills `stats`."""
        ids, params, stops = self._prepare(prompt, max_new_tokens, stop, sampling, stats)
        with self.turns.turn():
            if cancel is not None and cancel.is_set():  # cancelled while waiting for the turn
                stats.update(STATS_DEFAULTS, finish_reason="cancelled", prompt_tokens=len(ids), policy=self.policy)
                return
            d = _Decoding(self, ids, max_new_tokens, stops)
            run = self._run(ids, params, max_new_tokens)
            try:
                for chunk in run:
                    yield d.feed(chunk)
                    if d.done:
                        break
                    if cancel is not None and cancel.is_set():
                        d.finish_reason = "cancelled"
                        break
            finally:
                run.close()
            d.finish(stats)

    def _run(self, ids: list[int], params: SamplingParams, max_new_tokens: int) -> Iterator[list[int]]:
        """The decoder's committed chunks, by the engine's driver. "async" from blocking code: on an
        event loop of this thread's own (unless one already runs in it: then blocking)."""
        if self.driver == "async" and hasattr(self.decoder, "arun") and not _loop_running():
            return sansio.blocking(self.decoder.arun(ids, params, max_new_tokens))
        return self.decoder.run(ids, params, max_new_tokens)

    def _tokens_for(self, new: list[int], n_chars: int) -> int:
        """The fewest leading tokens whose text reaches `n_chars` characters (the text up to a stop)."""
        return bisect.bisect_left(range(len(new) + 1), n_chars, key=lambda j: len(self.decode(new[:j])))

    def _tokens_within(self, new: list[int], n_chars: int) -> int:
        """The most leading tokens whose text fits in `n_chars` characters."""
        return bisect.bisect_right(range(len(new) + 1), n_chars, key=lambda j: len(self.decode(new[:j]))) - 1

    def close(self) -> None:
        if hasattr(self.decoder, "close"):
            self.decoder.close()


class _Decoding:
    """One generation's bookkeeping, whichever driver runs it: committed chunks in, (new ids so far,
    their text or None without a tokenizer) out, both cut at EOS, max_new_tokens or a stop string;
    then its stats."""

    def __init__(self, engine: Engine, ids: list[int], max_new_tokens: int, stops: list[str]):
        self.engine, self.prompt_tokens, self.max_new, self.stops = engine, len(ids), max_new_tokens, stops
        self.eos = set(engine.spec.eos_token_ids)
        self.longest = max(map(len, stops), default=0)
        engine.decoder.reset_stats()
        self.new: list[int] = []
        self.text: str | None = None
        self.checked = 0  # text before this offset holds no stop string
        self.done, self.finish_reason = False, "length"
        self.t0, self.t_first, self.prefill_stall = time.perf_counter(), None, 0.0

    def feed(self, chunk: list[int]) -> tuple[list[int], str | None]:
        eng = self.engine
        if self.t_first is None:
            self.t_first = time.perf_counter()
            self.prefill_stall = eng.decoder.stats().get("stall_s", 0.0)
        new = self.new
        for t in chunk:
            new.append(t)
            if t in self.eos or len(new) >= self.max_new:
                self.done, self.finish_reason = True, "stop" if t in self.eos else "length"
                break
        text = eng.decode(new) if eng.tokenizer is not None else None
        if self.stops:
            start = max(0, self.checked - self.longest + 1)
            hit = min((i for s in self.stops if (i := text.find(s, start)) >= 0), default=-1)
            self.checked = len(text)
            if hit >= 0:
                text, new = text[:hit], new[:eng._tokens_for(new, hit)]
                self.done, self.finish_reason = True, "stop"
        self.new, self.text = new, text
        return new, text

    def finish(self, stats: dict) -> None:
        t_end = time.perf_counter()
        t_first = t_end if self.t_first is None else self.t_first
        stats.update(STATS_DEFAULTS)
        stats.update(self.engine.decoder.stats())
        stats.update(
            decode_stall_s=stats["stall_s"] - self.prefill_stall,  # copies waited on after the first token
            ttft_s=t_first - self.t0,
            tpot_s=(t_end - t_first) / max(len(self.new) - 1, 1),
            new_tokens=len(self.new),
            prompt_tokens=self.prompt_tokens,
            total_s=t_end - self.t0,
            policy=self.engine.policy,
            finish_reason=self.finish_reason,  # OpenAI's: "stop" (EOS or a stop string), "length", or "cancelled"
        )


class _Printer:
    """(new ids, text) as a generation goes -> the pieces that are final: nothing a stop string could
    still cut, no incomplete UTF-8 sequence."""

    def __init__(self, engine: Engine, stops: list[str]):
        self.engine, self.stops = engine, stops
        self.sent = self.printed = 0
        self.new: list[int] = []
        self.text: str | None = None

    def feed(self, new: list[int], text: str | None) -> tuple[list[int], str] | None:
        self.new, self.text = new, text
        if text is None:  # no tokenizer (and so no stop strings)
            ids_end, text_end = len(new), 0
        else:
            text_end = len(text) - held_back(text, self.stops)
            if text[:text_end].endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                return None
            ids_end = len(new) if text_end == len(text) else self.engine._tokens_within(new, text_end)
        if ids_end > self.sent or text_end > self.printed:
            piece = new[self.sent:ids_end], (text or "")[self.printed:text_end]
            self.sent, self.printed = max(self.sent, ids_end), max(self.printed, text_end)
            return piece
        return None

    def end(self) -> tuple[list[int], str] | None:
        """What is left once the generation is over: nothing is held back any more."""
        if len(self.new) > self.sent or len(self.text or "") > self.printed:
            return self.new[self.sent:], (self.text or "")[self.printed:]
        return None


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
