"""The engine: load once, then generate / stream / astream.

A policy is a *decoder*: an object whose `run(prompt_ids, params, max_new)` yields lists of
committed token ids (one token a step for plain decoding, several a cycle for speculation) and
whose `stats()` reports what it did. The engine owns everything around it: prompts and
tokenizers, validation, stop conditions, detokenisation, timing.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator

import torch

from .config import ModelSpec
from .errors import ConfigError, ContextLengthError, TokenizerError
from .layers import KVCache
from .model import MoETransformer
from .moe import ExpertWeights
from .sampling import SamplingParams, sample

# every generation reports every key (zeros where a policy has nothing to say), one schema for all
STATS_DEFAULTS = dict(ttft_s=0.0, tpot_s=0.0, new_tokens=0, cycles=0, accepted_per_cycle=0.0, acceptance_rate=0.0,
                      draft_efficiency=0.0, k_histogram={}, expert_hits=0, expert_misses=0, prefetch_issued=0,
                      prefetch_used=0, prefetch_recall=0.0, route_coverage=0.0, h2d_bytes=0, stall_s=0.0,
                      decode_stall_s=0.0, draft_s=0.0, verify_s=0.0, drafted_tokens=0, accepted_tokens=0, rejections=0)

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
        spec = self.model.spec
        cache = KVCache(spec, len(prompt) + max_new, self.device, self.dtype)
        gen = params.generator(self.device)
        tokens = torch.tensor(prompt, device=self.device)
        logits = self.model(tokens, 0, cache, self.experts, logits_for="last")  # [1, V]
        pos = len(prompt)
        for _ in range(max_new):
            tok = sample(logits, params, gen)  # [1]
            yield [int(tok)]
            logits = self.model(tok, pos, cache, self.experts)
            pos += 1

    def stats(self) -> dict:
        return dict(getattr(self.experts, "stats", lambda: {})())

    def reset_stats(self) -> None:
        if hasattr(self.experts, "reset_stats"):
            self.experts.reset_stats()

    def close(self) -> None:
        getattr(self.experts, "close", lambda: None)()


class Engine:
    def __init__(self, model: MoETransformer, experts: list[ExpertWeights], tokenizer, *, path: Path,
                 device: torch.device, dtype: torch.dtype, policy: str, decoder):
        self.model, self.expert_weights, self.tokenizer = model, experts, tokenizer
        self.path, self.device, self.dtype, self.policy = path, device, dtype, policy
        self.decoder = decoder

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    # ------------------------------------------------------------------------------- prompts
    def encode(self, prompt) -> list[int]:
        """A string, a list of token ids, or a chat (list of {"role", "content"} dicts)."""
        if isinstance(prompt, str):
            tok = self._need_tokenizer("a string prompt")
            ids = tok(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            tok = self._need_tokenizer("a chat prompt")
            if not getattr(tok, "chat_template", None):
                raise TokenizerError(f"the tokenizer in {self.path} has no chat template; pass a plain string")
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

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise TokenizerError(f"{self.path} ships no tokenizer, so {what} cannot be encoded; pass a list of token ids")
        return self.tokenizer

    # ---------------------------------------------------------------------------- generation
    def _tokens(self, prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, stats):
        """Yields (new_ids_so_far, finished_text_or_None). Fills `stats` as it goes."""
        params = SamplingParams(temperature, top_p, top_k, seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if stops and self.tokenizer is None:
            raise TokenizerError("stop strings need a tokenizer; this checkpoint ships none")
        ids = self.encode(prompt)
        limit = self.spec.max_position
        if len(ids) + max_new_tokens > limit:
            raise ContextLengthError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} "
                f"exceeds the model's context of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )
        eos = set(self.spec.eos_token_ids)
        self.decoder.reset_stats()
        new: list[int] = []
        t0 = time.perf_counter()
        t_first = None
        for chunk in self.decoder.run(ids, params, max_new_tokens):
            if t_first is None:
                t_first = time.perf_counter()
                prefill_stall = self.decoder.stats().get("stall_s", 0.0)
            done = False
            for t in chunk:
                new.append(t)
                if t in eos or len(new) >= max_new_tokens:
                    done = True
                    break
            if stops:
                text = self.decode(new)
                hit = min((text.find(s) for s in stops if s in text), default=-1)
                if hit >= 0:
                    yield new, text[:hit]
                    done = True
                    break
            yield new, None
            if done:
                break
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
        )

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop=None) -> GenerationOutput:
        stats: dict = {}
        new, final = [], None
        for new, final in self._tokens(prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, stats):
            pass
        text = final if final is not None else self.decode(new)
        return GenerationOutput(text=text, token_ids=list(new), stats=stats)

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, stop=None, stats: dict | None = None) -> Iterator[str]:
        """Text pieces as tokens are committed. Pass a dict as `stats` to receive the stats."""
        stats = {} if stats is None else stats
        printed = 0
        for new, final in self._tokens(prompt, max_new_tokens, temperature, top_p, top_k, seed, stop, stats):
            text = final if final is not None else self.decode(new)
            if final is None and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait
                continue
            if len(text) > printed:
                yield text[printed:]
                printed = len(text)

    async def astream(self, prompt, **kwargs) -> AsyncIterator[str]:
        """`stream` for asyncio code: each step runs in a worker thread, so the loop stays free."""
        it = self.stream(prompt, **kwargs)
        end = object()
        while (piece := await asyncio.to_thread(next, it, end)) is not end:
            yield piece

    def close(self) -> None:
        if hasattr(self.decoder, "close"):
            self.decoder.close()
