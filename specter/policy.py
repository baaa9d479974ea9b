"""The policies, in one table: what each one offloads, drafts, prefetches and evicts, and which
decoder runs it. The builder, the CLI, the memory plan and the bench read this table; nothing
else spells out which policy does what.

A leaf module (no torch): `specter --help` and `specter plan` read it without loading the engine.
The prefetch rules themselves live in speculative/draft.py (next-layer's guesses and the
planner) and offload/oracle.py (the oracle); the decoders in speculative/decoder.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Policy:
    name: str
    summary: str
    offloads: bool          # a slot pool under a budget; False: every expert resident (takes no budget)
    drafts: bool = False    # an INT4 draft speculates: k_max applies, the plan counts its memory
    prefetch: str = ""      # "" (fetch on miss) | "next-layer" | "planner" | "oracle"
    host_lane: str = ""     # "" | "misses": the host computes every miss | "split": LaneChoice splits each
    #                         layer's misses between copying and the host (CPU; CUDA only with host_threads)
    decoder: str = "plain"  # "plain" (one token a step) | "speculative" | "oracle" (record, then replay)
    eviction: str = "lru"   # the slot cache's rule; "planner" and "oracle" prefetch rank evictions over it
    bench_only: bool = False

    @property
    def compiles(self) -> bool:
        """`compile` applies: the plain decoder's one-token step or the speculative one's draft step and
        verifier (the oracle replays a recording eagerly)."""
        return self.decoder != "oracle"


TABLE = (
    Policy("resident", "every expert on the device: the upper bound, where memory allows", offloads=False,
           eviction=""),
    Policy("on-demand", "LRU slot cache, an expert copied when a token needs it", offloads=True),
    Policy("next-layer", "on-demand, plus the next layer's likely experts copied ahead (its router applied to "
                         "the current hidden state)", offloads=True, prefetch="next-layer"),
    Policy("host", "on-demand, but the experts not on the device computed on the host where the store holds "
                   "them", offloads=True, host_lane="misses"),
    Policy("spec-lru", "speculation alone: the INT4 draft guesses tokens, verification fetches on miss",
           offloads=True, drafts=True, decoder="speculative"),
    Policy("specter", "speculation with the draft's lookahead prefetching the experts verification will use, "
                      "misses split between copying and the host", offloads=True, drafts=True, prefetch="planner",
           host_lane="split", decoder="speculative"),
    Policy("oracle", "true routing known in advance, Belady eviction: the limit of prefetching at a budget",
           offloads=True, prefetch="oracle", decoder="oracle", bench_only=True),
)

DEFAULT = "specter"  # what specter.load and the CLI run when no policy is named
POLICY = {p.name: p for p in TABLE}
POLICIES = tuple(p.name for p in TABLE if not p.bench_only)  # what specter.load and the CLI offer
BENCH_POLICIES = tuple(POLICY)                                 # and what `specter bench` may compare


def get(name: str) -> Policy:
    """The policy called `name`; a ConfigError naming the choices for any other."""
    if name not in POLICY:
        raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)} "
                          f"(bench only: {', '.join(n for n in BENCH_POLICIES if n not in POLICIES)})")
    return POLICY[name]


def names(field: str) -> tuple[str, ...]:
    """The policies (bench-only ones aside) whose `field` is set, e.g. names("drafts") == ("spec-lru",
    "specter"): for messages that say which policies a flag applies to."""
    return tuple(p.name for p in TABLE if not p.bench_only and getattr(p, field))
