"""The engine: load once, then generate / stream / stream_ids / astream.

A policy is a *decoder*: an object whose `run(prompt_ids, params, max_new)` yields lists of
committed token ids (one token a step for plain decoding, several a cycle for speculation) and
whose `stats()` reports what it did. The engine owns everything around it: prompts and
tokenizers, validation, stop conditions, detokenisation, timing, and turns: one engine runs one
generation at a time (they share the slot pool, the planner and the KV cache), so concurrent
callers wait for their turn in arrival order and get exactly the text they would get alone.

A generation has one body, the decoder's `run`: the blocking API iterates it on the calling thread,
`astream` on a thread of its own (streaming.in_thread), the caller's loop free meanwhile. Turns, stop
strings and printable pieces are in streaming.py.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import AsyncIterator, Iterator

import torch

from .config import ModelSpec
from .errors import ConfigError, ContextLengthError, TokenizerError
from .model import MoETransformer
from .moe import ExpertWeights
from .sampling import SamplingParams
from .streaming import STATS_DEFAULTS, Decoding, Printer, Turns, in_thread, stop_list  # noqa: F401 -- STATS_DEFAULTS: the schema


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]            # new tokens only
    stats: dict = field(default_factory=dict)


_FIELDS = frozenset(f.name for f in fields(SamplingParams))  # SamplingParams' keywords


def choose(sampling: dict, defaults: dict) -> tuple[dict, str]:
    """(SamplingParams keywords, where they came from): the caller's keywords ("caller") when they set
    any sampling value (None counts as unset, a seed alone as no choice), else the model's defaults
    plus the seed ("model"; "none" when the model has none: greedy)."""
    given, chosen = {}, False
    for k, v in sampling.items():
        if v is not None or k not in _FIELDS:  # unknown: from_kwargs says so
            given[k] = v
            chosen = chosen or k != "seed"
    if chosen:
        return given, "caller"
    return {**defaults, **given}, "model" if defaults else "none"


def describe(params: SamplingParams) -> str:
    """A short human summary: "greedy" or "temperature 0.7, top-p 0.95, top-k 50, repetition 1.1"."""
    p = params
    parts = ["greedy"] if p.greedy else [f"temperature {p.temperature:g}"]
    for name, v, on in (("top-p", p.top_p, not p.greedy and p.top_p < 1), ("top-k", p.top_k, not p.greedy and p.top_k > 0),
                        ("min-p", p.min_p, not p.greedy and p.min_p > 0),
                        ("repetition", p.repetition_penalty, p.repetition_penalty != 1),
                        ("presence", p.presence_penalty, p.presence_penalty != 0),
                        ("frequency", p.frequency_penalty, p.frequency_penalty != 0)):
        if on:
            parts.append(f"{name} {v:g}")
    return ", ".join(parts)


class Engine:
    def __init__(self, model: MoETransformer, experts: list[ExpertWeights], tokenizer, *, path: Path,
                 device: torch.device, dtype: torch.dtype, policy: str, decoder, generation_defaults: dict | None = None, plan=None, shared=None):
        self.model, self.expert_weights, self.tokenizer = model, experts, tokenizer
        self.path, self.device, self.dtype, self.policy = path, device, dtype, policy
        self.decoder = decoder
        self.plan, self.shared = plan, shared  # the memory plan it was built to; the loaded checkpoint (builder.Loaded)
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
            bad = [t for t in ids if not 0 <= t < self.model.spec.vocab_size]
            if bad:
                raise ConfigError(f"token id {bad[0]} is outside the vocabulary [0, {self.model.spec.vocab_size})")
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

    async def astream(self, prompt, max_new_tokens: int = 128, *, stop=None, stats: dict | None = None,
                      **sampling) -> AsyncIterator[str]:
        """`stream` for asyncio code: the engine's turn is awaited on the caller's loop, the generation
        runs on a thread of its own (streaming.in_thread), so the loop is free while it computes and
        waits. Leaving the loop early, or cancelling the task, ends the generation after its cycle."""
        self._need_tokenizer("there is no text to stream; use stream_ids() or generate()")
        stats = {} if stats is None else stats
        ids, params, stops = self._prepare(prompt, max_new_tokens, stop, sampling, stats)
        printer = Printer(self, stops)
        async with self.turns.aturn():
            d = Decoding(self, ids, max_new_tokens, stops)
            run = in_thread(lambda: self.decoder.run(ids, params, max_new_tokens))
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
        printer = Printer(self, stop_list(stop))
        for new, text in self._generation(prompt, max_new_tokens, stop, sampling, {} if stats is None else stats,
                                          cancel):
            if (piece := printer.feed(new, text)) is not None:
                yield piece
        if (piece := printer.end()) is not None:  # the end: nothing is held back any more
            yield piece

    def _prepare(self, prompt, max_new_tokens, stop, sampling, stats: dict) -> tuple[list[int], SamplingParams, list]:
        """Validated (prompt ids, sampling params, stop strings); `stats` gets the sampling settings."""
        # the caller's sampling keywords when they give any (a seed alone does not count), else the model's
        chosen, source = choose(sampling, self._generation_defaults)
        params = SamplingParams.from_kwargs(chosen)
        stats.update(sampling=describe(params), sampling_from=source)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stops = stop_list(stop)
        if stops:
            self._need_tokenizer("stop strings cannot be matched; stop on max_new_tokens or the EOS token")
        ids = self.encode(prompt)
        limit = self.model.spec.max_position
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
            d = Decoding(self, ids, max_new_tokens, stops)
            run = self.decoder.run(ids, params, max_new_tokens)
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

    def close(self) -> None:
        if hasattr(self.decoder, "close"):
            self.decoder.close()


