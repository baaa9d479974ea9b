"""The engine: load once, then generate / stream / stream_ids / astream.

A policy is a *decoder*: an object whose `run(prompt_ids, params, max_new)` yields lists of
committed token ids (one token a step for plain decoding, several a cycle for speculation) and
whose `stats()` reports what it did. The engine owns everything around it: prompts and
tokenizers, validation, stop conditions, detokenisation, timing, and turns: one engine runs one
generation at a time (they share the slot pool, the planner and the KV cache), so concurrent
callers wait for their turn in arrival order and get exactly the text they would get alone.

A generation has one body, `Engine._decoding` around the decoder's `run`: the blocking API iterates
it on the calling thread, `astream` on a thread of its own (streaming.in_thread), the caller's loop
free meanwhile. Each driver validates first (`_prepare`), then takes the engine's turn:

    Turns        one generation at a time on an engine, in arrival order (a ticket lock; `aturn` for
                 coroutines, whose wait polls so the loop runs meanwhile)
Printable pieces and asyncio are in streaming.py; the sampling keywords' defaults in sampling.py.
"""
from __future__ import annotations

import asyncio
import atexit
import copy
import numbers
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator

import torch

from .config import ModelSpec
from .errors import ConfigError, ContextLengthError, TokenizerError
from .model import MoETransformer
from .moe import ExpertWeights
from .offload.link import poll
from .offload.threads import cuda_device
from .sampling import SamplingParams, choose, describe, fresh_seed
from .streaming import Printer, complete, in_thread, not_unicode, tokens_for


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]            # new tokens only
    stats: dict = field(default_factory=dict)


# every generation reports every key, one schema for all: counts are 0 where nothing happened (new_tokens: the
# output's token ids; generated_tokens: the tokens the model generated for it, through the one that completes a
# stop string, which the output leaves out), ratios None where they do not apply (acceptance without drafting;
# prefetch recall, the share of a verification's experts resident or in flight when it reached them, without a
# draft's prefetches); the seed a sampled generation drew with (`seed`, None when greedy); and what it
# sampled with: `sampling` ("greedy", "temperature 0.7, top-p 0.95, ...") and `sampling_from`
# ("caller", "model": the model's generation_config.json, "none": greedy, as nothing was set); how
# expert bytes reach the device, `h2d_path` ("pinned store", "staging buffers (2 x N MiB)", "emulated
# (host memory)" on CPU; None when nothing is copied); `time_scale` (CPU: the emulated link's seconds here
# per second on the profile's GPU, set once at load from this CPU's expert throughput, which
# $SPECTER_EXPERT_THROUGHPUT pins; None with no emulated link: CUDA, resident; a pipeline's: rank 0's, or
# the first copying rank's); `cuda_graphs` (speculative engines under CUDA graphs:
# recordings, recorded, bytes, warmups, threads so far; None without graphs)
DEFAULT_NEW_TOKENS = 128  # a generation's max_new_tokens when none is given (fewer where the context is shorter)
STATS_DEFAULTS = dict(ttft_s=0.0, tpot_s=0.0, new_tokens=0, generated_tokens=0, cycles=0, accepted_per_cycle=None,
                      acceptance_rate=None, draft_efficiency=None, k_histogram={}, expert_hits=0, expert_misses=0,
                      prefetch_issued=0, prefetch_used=0, prefetch_cancelled=0, prefetch_recall=None,
                      route_coverage=None, h2d_bytes=0, stall_s=0.0, decode_stall_s=0.0, draft_s=0.0, verify_s=0.0,
                      drafted_tokens=0, accepted_tokens=0, rejections=0, compiled=[], h2d_path=None, time_scale=None,
                      cuda_graphs=None, recall_hits=0, recall_total=0, cover_hits=0, cover_total=0, offloaded_bytes=0,
                      host_experts=0, host_bytes=0, host_stall_s=0.0, host_busy_s=0.0, host_threads=None, tier_hits=0,
                      tier_fills=0, tier_evictions=0, tier_decoded_bytes=0)


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

    def _give_up(self, ticket: int) -> None:
        """A waiter cancelled or interrupted gives its ticket up (served just then: passes the turn on);
        called with the lock held."""
        if self._serving == ticket:
            self._release()
        else:
            self._abandoned.add(ticket)

    def aturn(self) -> "_AsyncTurn":
        """`turn` for a coroutine: its wait polls, so the loop runs meanwhile; same arrival order as
        the threads'. A coroutine cancelled while it waits gives its ticket up."""
        return _AsyncTurn(self)

    @contextmanager
    def turn(self):
        """The calling thread's turn. Interrupted while it waits (a Ctrl-C), it gives its ticket up."""
        with self._cv:
            ticket = self._take()
            try:
                while self._serving != ticket:
                    self._cv.wait()
            except BaseException:
                self._give_up(ticket)
                raise
            self._owner = (threading.get_ident(), None)
        try:
            yield
        finally:
            with self._cv:
                self._release()


class _AsyncTurn:
    """Turns.aturn's context: a class, not an async generator (asynccontextmanager), because the end of
    asyncio.run closes every live async generator at once: an abandoned astream's turn would pass on
    while its generation's thread still decoded beside the next one."""

    def __init__(self, turns: Turns):
        self.turns = turns

    async def __aenter__(self) -> "_AsyncTurn":
        turns, task = self.turns, asyncio.current_task()
        for _ in range(4):  # an astream this task left with `break` is closed by a task the loop has scheduled:
            if turns._owner != (threading.get_ident(), task):  # let it begin (Turns.closing), then queue behind it
                break
            await asyncio.sleep(0)
        with turns._cv:
            ticket = turns._take(task)
        try:
            await poll(lambda: turns._serving == ticket, spin=0.0, every=5e-3)  # a turn takes a while
        except BaseException:
            with turns._cv:
                turns._give_up(ticket)
            raise
        with turns._cv:
            turns._owner = (threading.get_ident(), task)
        return self

    async def __aexit__(self, *exc) -> None:
        with self.turns._cv:
            self.turns._release()

    def closing(self) -> None:
        """The generation is closing on this loop (its thread finishing its cycle): another coroutine of the
        task that ran it may queue for the turn now, as a blocking call on this thread still may not."""
        with self.turns._cv:
            if self.turns._owner is not None:
                self.turns._owner = (self.turns._owner[0], "closing")


def _token_ids(prompt) -> list[int] | None:
    """`prompt` as token ids (ints), if it is a sequence of them: a list or tuple of ints (numpy's or
    torch's integer scalars too), or a 1-d integer tensor or numpy array; else None."""
    def ints(t: torch.Tensor, dim: int) -> bool:  # a tensor of integers (not bool) of `dim` dimensions
        return t.dim() == dim and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)

    def one(t) -> bool:  # one token id: an int, numpy's or a 0-d tensor's
        if isinstance(t, torch.Tensor):
            return ints(t, 0)
        return isinstance(t, numbers.Integral) and not isinstance(t, bool)

    if isinstance(prompt, torch.Tensor) or (hasattr(prompt, "__array__") and not isinstance(prompt, (list, tuple))):
        prompt = torch.as_tensor(prompt)
        return prompt.tolist() if ints(prompt, 1) else None
    if isinstance(prompt, (list, tuple)) and all(one(t) for t in prompt):
        return [int(t) for t in prompt]
    return None


def _stats_dict(stats) -> dict:
    """The caller's `stats` (a dict the stats are written into), or a new one for None."""
    if stats is None:
        return {}
    if not isinstance(stats, dict):
        raise ConfigError(f"stats must be a dict (the generation's stats are written into it) or None, got {stats!r}")
    return stats


def _check_text(text: str, what: str) -> None:
    """A ConfigError for text no tokenizer can take (a lone surrogate: streaming.not_unicode)."""
    if (why := not_unicode(text)) is not None:
        raise ConfigError(f"{what}: {why}")


class Engine:
    def __init__(self, model: MoETransformer, experts: list[ExpertWeights], tokenizer, *, path: Path,
                 device: torch.device, dtype: torch.dtype, policy: str, decoder,
                 generation_defaults: dict | None = None, plan=None, shared=None, context: int | None = None,
                 on_close: Callable[[], None] | None = None):
        self.model, self.expert_weights, self.tokenizer = model, experts, tokenizer
        self.context = context or model.spec.max_position  # most positions a generation holds (specter.load)
        decoder.context = self.context  # a kept KV cache grows up to it (speculative/decoder.py KeptCache)
        self.path, self.device, self.dtype, self.policy = path, device, dtype, policy
        self.decoder = decoder
        self.plan, self.shared = plan, shared  # the memory plan it was built to; the loaded checkpoint (builder.Loaded)
        self.turns = Turns()
        self.closed = False
        # an engine dropped without close(): its decoder's threads (links, host lane) stopped when it is collected
        self._on_close = on_close or (lambda: None)  # (builder.hold_threads: the process's CPU threads put back)
        self._finalizer = weakref.finalize(self, _close_dropped, decoder, self._on_close)
        self._finalizer.atexit = False  # (at exit offload/threads.py closes every owner)
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

    # ------------------------------------------------------------------------------- prompts
    def encode(self, prompt) -> list[int]:
        """A string, a list of token ids, or a chat (list of {"role", "content"} dicts)."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            _check_text(prompt, "the prompt")
            if tok is None:
                raise self._no_tokenizer("a string prompt cannot be encoded; pass a list of token ids "
                                         "(CLI: --prompt-ids; bench: --prompts FILE.json of token-id lists)")
            ids = tok(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            if tok is None:
                raise self._no_tokenizer("a chat prompt cannot be rendered; pass a list of token ids")
            if not getattr(tok, "chat_template", None):
                raise TokenizerError(f"the tokenizer in {self.path} has no chat template, so chat messages cannot be "
                                     "rendered; pass a plain string prompt (CLI: drop --chat/--system)")
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not m["role"] or not isinstance(m.get("content"), str):
                    raise ConfigError(f"chat message {i} must have a non-empty string 'role' and a string 'content', "
                                      f"got {m!r}")
                _check_text(m["content"], f"chat message {i}'s content")
            try:
                ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            except Exception as e:  # the template's own checks (jinja's raise_exception: "roles must alternate" ...)
                raise ConfigError(f"the model's chat template refused these messages ({type(e).__name__}: {e})") \
                    from None
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        elif (ids := _token_ids(prompt)) is not None:
            bad = [t for t in ids if not 0 <= t < self.model.spec.vocab_size]
            if bad:
                raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {self.model.spec.vocab_size})")
        else:
            what = type(prompt).__name__
            if isinstance(prompt, (list, tuple)) and prompt:
                what += " of " + ", ".join(sorted({type(t).__name__ for t in prompt}))
            raise ConfigError(f"prompt must be a string, token ids (ints: a list, a tuple, a 1-d tensor or array) or "
                              f"a list of chat messages; got {what}")
        if not ids:
            raise ConfigError("the prompt is empty: give at least one token")
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _no_tokenizer(self, consequence: str) -> TokenizerError:
        """The error for what this model cannot do without a tokenizer (raised where it is None)."""
        return TokenizerError(f"{self.path} ships no tokenizer, so {consequence}")

    # ---------------------------------------------------------------------------- generation
    def generate(self, prompt, max_new_tokens: int | None = None, *, stop=None, **sampling) -> GenerationOutput:
        """The whole continuation at once.

        sampling: temperature (0 = greedy), top_p, top_k, min_p, repetition_penalty, presence_penalty,
        frequency_penalty, seed (see specter.sampling.SamplingParams). None of them (a seed alone
        included): the model's own settings, `generation_defaults`; any of them: exactly those, the
        others at their neutral values (temperature 0 = greedy). stop: a string or a list; the
        text ends before the first one, and token_ids end with the token that completes that text.
        max_new_tokens None: DEFAULT_NEW_TOKENS, or what the context has room for after the prompt."""
        stats: dict = {}
        new, text = [], ""
        ids, params, stops, max_new_tokens = self._prepare(prompt, max_new_tokens, stop, sampling, stats)
        with self.turns.turn():
            for new, text in self._decoding(ids, params, max_new_tokens, stops, stats):
                pass
        return GenerationOutput(text=text or "", token_ids=list(new), stats=stats)

    def stream(self, prompt, max_new_tokens: int | None = None, *, stop=None, stats: dict | None = None,
               cancel: threading.Event | None = None, **sampling) -> Iterator[str]:
        """Text pieces as tokens are committed; they join to generate()'s text. Text that could be the
        start of a stop string is held back until it is known not to be. Pass a dict as `stats` to
        receive the stats; set `cancel` (from any thread) to end the generation at the next cycle.
        The engine is this stream's from its first piece until it is exhausted or closed. The arguments
        are checked here, at the call, not at the first piece."""
        if self.tokenizer is None:
            raise self._no_tokenizer("there is no text to stream; use stream_ids() or generate()")
        return (text for _, text in self._pieces(prompt, max_new_tokens, stop, sampling, stats, cancel) if text)

    def stream_ids(self, prompt, max_new_tokens: int | None = None, *, stop=None, stats: dict | None = None,
                   cancel: threading.Event | None = None, **sampling) -> Iterator[list[int]]:
        """Lists of new token ids as they are committed (no tokenizer needed); they join to
        generate()'s token_ids."""
        return (ids for ids, _ in self._pieces(prompt, max_new_tokens, stop, sampling, stats, cancel) if ids)

    def astream(self, prompt, max_new_tokens: int | None = None, *, stop=None, stats: dict | None = None,
                **sampling) -> AsyncIterator[str]:
        """`stream` for asyncio code: the engine's turn is awaited on the caller's loop, the generation
        runs on a thread of its own (streaming.in_thread), so the loop is free while it computes and
        waits. It does not wait for a slow reader (its pieces queue up), so a server's slow client does
        not hold the engine; leaving the loop early, or cancelling the task, ends the generation after
        the cycle it is in. The arguments are checked here, at the call."""
        if self.tokenizer is None:
            raise self._no_tokenizer("there is no text to stream; use stream_ids() or generate()")
        stats = _stats_dict(stats)
        return self._astream(*self._prepare(prompt, max_new_tokens, stop, sampling, stats), stats)

    async def _astream(self, ids: list[int], params: SamplingParams, stops: list, max_new_tokens: int,
                       stats: dict) -> AsyncIterator[str]:
        printer = Printer(self, stops)
        async with self.turns.aturn() as turn:
            run = in_thread(lambda: self._decoding(ids, params, max_new_tokens, stops, stats))
            try:
                async for new, text in run:
                    if (piece := printer.feed(new, text)) is not None and piece[1]:
                        yield piece[1]
            finally:
                turn.closing()
                await run.aclose()  # the turn is the generation thread's until it ends
        if (piece := printer.end()) is not None and piece[1]:
            yield piece[1]

    def _pieces(self, prompt, max_new_tokens, stop, sampling, stats, cancel) -> Iterator[tuple[list[int], str]]:
        """(new token ids, new text) as they become final: nothing that a stop string could still cut.
        The arguments are checked now; the engine is taken at the first piece."""
        stats = _stats_dict(stats)
        if cancel is not None and not callable(getattr(cancel, "is_set", None)):
            raise ConfigError(f"cancel must be a threading.Event (set it to end the generation), got {cancel!r}")
        return self._final_pieces(*self._prepare(prompt, max_new_tokens, stop, sampling, stats), stats, cancel)

    def _final_pieces(self, ids: list[int], params: SamplingParams, stops: list, max_new_tokens: int, stats: dict,
                      cancel) -> Iterator[tuple[list[int], str]]:
        printer = Printer(self, stops)
        with self.turns.turn():
            for new, text in self._decoding(ids, params, max_new_tokens, stops, stats, cancel):
                if (piece := printer.feed(new, text)) is not None:
                    yield piece
        if (piece := printer.end()) is not None:  # the end: nothing is held back any more
            yield piece

    def _prepare(self, prompt, max_new_tokens, stop, sampling, stats: dict) -> tuple[list[int], SamplingParams, list,
                                                                                     int]:
        """Validated (prompt ids, sampling params, stop strings: `stop` is None, a string or a list of
        non-empty strings, max_new_tokens as an int); `stats` gets the sampling settings."""
        if self.closed:
            raise ConfigError("this engine is closed (its copy threads and host lane are stopped); load another "
                              "with specter.load(...)")
        # the caller's sampling keywords when they give any (a seed alone does not count), else the model's
        params, source = choose(sampling, self._generation_defaults)
        if not params.greedy and params.seed is None:  # a fresh seed, in the stats: the generation can be repeated
            params = replace(params, seed=fresh_seed())
        stats.update(sampling=describe(params), sampling_from=source, seed=None if params.greedy else params.seed)
        given = max_new_tokens is not None
        if given and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral)
                      or max_new_tokens < 1):
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if stop is not None:
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
                raise ConfigError(f"stop must be a string or a list of strings, got {stop!r}")
            if "" in stops:
                raise ConfigError("an empty stop string matches at once; remove it")
            for s in stops:
                _check_text(s, f"stop string {s!r}")
        if stops and self.tokenizer is None:
            raise self._no_tokenizer("stop strings cannot be matched; stop on max_new_tokens or the EOS token")
        ids = self.encode(prompt)
        limit, model = self.context, self.model.spec.max_position
        # None: DEFAULT_NEW_TOKENS, or fewer where the context has room for fewer (the CLI's default)
        max_new_tokens = int(max_new_tokens) if given else max(1, min(DEFAULT_NEW_TOKENS, limit - len(ids)))
        if len(ids) + max_new_tokens > limit:
            whose = "the model's" if limit == model else "the engine's"
            more = self.model.spec.context_note if limit == model else \
                f" (the engine was loaded with context={limit}; the model's is {model})"
            fix = "shorten the prompt" + ("" if len(ids) >= limit or not given else
                                          " or lower max_new_tokens (--max-new-tokens)")
            n = f"{len(ids)} token{'s' * (len(ids) != 1)}"
            raise ContextLengthError(  # (a prompt that fills the context leaves no room for any new token)
                f"prompt ({n}) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} exceeds {whose} "
                f"context of {limit} tokens{more}; {fix}" if given else
                f"the prompt ({n}) leaves no room for a new token in {whose} context of {limit} tokens{more}; {fix}")
        return ids, params, list(stops), max_new_tokens

    def _decoding(self, ids: list[int], params: SamplingParams, max_new_tokens: int, stops: list[str],
                  stats: dict, cancel: threading.Event | None = None) -> Iterator[tuple[list[int], str | None]]:
        """_chunks, each of its steps on the engine's CUDA device (threads.cuda_device) on whichever thread
        iterates it; the caller's own code between chunks runs on the caller's device."""
        run = self._chunks(ids, params, max_new_tokens, stops, stats, cancel)
        try:
            while True:
                with cuda_device(self.device):
                    chunk = next(run, None)
                if chunk is None:
                    return
                yield chunk
        finally:  # its clean-up (the decoder's, recover()) on the engine's device too
            with cuda_device(self.device):
                run.close()

    def _recover(self, run) -> None:
        """After an error or a Ctrl-C part way through a layer: no slot is left reserved with no copy coming
        (the next generation would read that expert as zeros)."""
        run.close()
        getattr(getattr(self.decoder, "experts", None), "recover", lambda: None)()

    def _chunks(self, ids: list[int], params: SamplingParams, max_new_tokens: int, stops: list[str],
                stats: dict, cancel: threading.Event | None = None) -> Iterator[tuple[list[int], str | None]]:
        """One prepared generation (`_prepare`), run in the engine's turn, whichever driver iterates it:
        the decoder's committed chunks in; (new ids so far, their text or None without a tokenizer)
        out after each, both cut at EOS, max_new_tokens or a stop string; `stats` filled at the end.
        `cancel` (set from any thread) ends it after the chunk in progress."""
        dec, tok, eos = self.decoder, self.tokenizer, set(self.model.spec.eos_token_ids)
        longest = max(map(len, stops), default=0)
        if (cancel is not None and cancel.is_set()) or self.closed:  # cancelled (or closed) waiting for the turn
            stats.update(copy.deepcopy(STATS_DEFAULTS), finish_reason="cancelled", prompt_tokens=len(ids),
                         policy=self.policy, total_s=0.0)
            return
        dec.reset_stats()
        new, text, reason = [], None, "length"
        through = None  # a stop string's end: the tokens generated up to the one that completes it
        checked = 0  # text before this offset holds no stop string
        t0, t_first, prefill_stall = time.perf_counter(), None, 0.0
        run = dec.run(ids, params, max_new_tokens)
        try:
            for chunk in run:
                if t_first is None:
                    t_first = time.perf_counter()
                    prefill_stall = dec.stats().get("stall_s", 0.0)
                done, n = False, len(new)
                new = new + chunk  # a new list each chunk: a driver on another thread may still read the last
                for j in range(n, len(new)):
                    if new[j] in eos or j + 1 >= max_new_tokens:
                        done, reason, new = True, "stop" if new[j] in eos else "length", new[:j + 1]
                        break
                text = None if tok is None else tok.decode(new, skip_special_tokens=True)  # as decode()
                if stops:  # in the text that is final: an incomplete character's U+FFFD may still change
                    final = text if done else complete(text)
                    start = max(0, checked - longest + 1)
                    found = [(i + len(s), i) for s in stops if (i := final.find(s, start)) >= 0]
                    checked = len(final)
                    if found:  # the stop that ends first (then the longer): what one token at a time finds
                        end, hit = min(found)  # first, so a chunk of several tokens cuts where single ones would
                        through = tokens_for(self.decode, new, end)
                        text, new = text[:hit], new[:tokens_for(self.decode, new, hit)]
                        done, reason = True, "stop"
                yield new, text
                if done:
                    break
                if (cancel is not None and cancel.is_set()) or self.closed:  # (close(): from another thread, or a
                    reason = "cancelled"                                      # stream left suspended)
                    break
        except GeneratorExit:  # the caller left early (a break, aclose): the stats still say how it ended
            reason = "cancelled"
        except Exception:
            if not self.closed:
                self._recover(run)
                raise
            reason = "cancelled"  # close() from another thread stopped its links under this generation: it ends
        except BaseException:  # a Ctrl-C
            self._recover(run)
            raise
        finally:
            run.close()
        t_end = time.perf_counter()
        t_first = t_end if t_first is None else t_first
        stats.update(copy.deepcopy(STATS_DEFAULTS))  # (its {} and [] the caller's own, not every generation's)
        own = dec.stats()
        stats.update(own)
        generated = through or len(new)
        stats.update(  # copies waited on after the first token (a pipeline's decoder sums its ranks')
            decode_stall_s=own.get("decode_stall_s", stats["stall_s"] - prefill_stall),
            ttft_s=t_first - t0,
            tpot_s=(t_end - t_first) / (generated - 1) if generated > 1 else 0.0,  # (one token: nothing after the
            new_tokens=len(new),                                          # first, as STATS_DEFAULTS; the line: n/a)
            generated_tokens=generated,  # (OpenAI's completion_tokens: the stop's token counts too)
            prompt_tokens=len(ids),
            total_s=t_end - t0,
            policy=self.policy,
            h2d_path=stats["h2d_path"] if stats["h2d_bytes"] else None,  # (nothing copied: no path taken)
            finish_reason=reason,  # OpenAI's: "stop" (EOS or a stop string), "length", or "cancelled"
        )

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:  # `with specter.load(...) as engine:` closes it at the block's end
        self.close()

    def close(self) -> None:
        """Stop the engine's threads and links; a generation after this is a ConfigError, and one running
        (on another thread, or a stream left suspended) ends at once, finish_reason "cancelled"."""
        self.closed = True
        self._finalizer.detach()
        if hasattr(self.decoder, "close"):
            self.decoder.close()
        self._on_close()


_CLOSING: set[threading.Thread] = set()  # dropped engines' decoders being closed off the collecting thread


def _close_dropped(decoder, on_close: Callable[[], None]) -> None:
    """An engine collected without close(): its decoder closed, on a thread of its own where the collection
    runs on one of Specter's (which close() may join); those are joined at exit, before the interpreter
    finalizes (a daemon thread still inside a torch op then aborts the process: offload/threads.py)."""
    on_close()
    if not hasattr(decoder, "close"):
        return
    if not threading.current_thread().name.startswith("specter-"):
        decoder.close()
        return
    def run() -> None:
        try:
            decoder.close()
        finally:
            _CLOSING.discard(t)

    t = threading.Thread(target=run, name="specter-close-dropped", daemon=True)
    _CLOSING.add(t)
    t.start()


@atexit.register
def _join_closing() -> None:
    for t in list(_CLOSING):
        t.join(timeout=30)


