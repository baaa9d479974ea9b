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

    def makes_draft(self, k_max: int | None = None) -> bool:
        """Whether an engine of it makes (quantises, plans, holds) a draft: a drafting policy, unless k_max
        is 0 (never drafts; None: the default)."""
        return self.drafts and k_max != 0

    def computes_on_host(self, device_type: str, host_threads: int | None = None, every_expert: bool = False) -> bool:
        """Whether it computes experts on the host lane on a `device_type` ("cpu", "cuda") device:
        host_lane "misses" (policy host) always; "split" (specter) on CPU (the emulated machine, where
        greedy decoding on both lanes is resident's bits, tested) and on CUDA only when host_threads is
        given (opt-in: the lane's CUDA path has not yet run on a GPU, and there the host's and the GPU's
        arithmetic round differently), never with host_threads 0 (every miss copied: CUDA's default
        shape, on CPU too), and not where the budget holds `every_expert` (nothing is ever missing: it
        then runs exactly as the copy-only policy, no lane thread). Every other policy only copies."""
        if self.host_lane == "misses":
            return True
        return (self.host_lane == "split" and not every_expert and host_threads != 0
                and (device_type == "cpu" or host_threads is not None))

    def check_host_threads(self, host_threads) -> None:
        """host_threads: None, or an integer >= 1 for a policy that computes experts on the host; 0 (no
        lane: every miss copied) for one that splits its misses between the lanes (specter)."""
        if host_threads is None:
            return
        if isinstance(host_threads, bool) or not isinstance(host_threads, int) or host_threads < 0:
            raise ConfigError(f"host_threads must be an integer >= 0, got {host_threads!r}")
        if not self.host_lane:
            raise ConfigError(f"policy {self.name!r} computes no expert on the host, so host_threads would be "
                              f"ignored; drop it, or use policy {' or '.join(map(repr, names('host_lane')))}")
        if host_threads == 0 and self.host_lane == "misses":
            raise ConfigError(f"policy {self.name!r} computes every miss on the host lane, so it needs host_threads "
                              f">= 1; for no lane at all (every miss copied) use policy 'on-demand'")


TABLE = (
    Policy("resident", "every expert on the device: the upper bound, where memory allows", offloads=False,
           eviction=""),
    Policy("on-demand", "LRU slot cache, an expert copied when a token needs it", offloads=True),
    Policy("next-layer", "on-demand, plus the next layer's likely experts copied ahead (its router applied to "
                         "the current hidden state)", offloads=True, prefetch="next-layer"),
    Policy("host", "a slot budget filled once and never copied to; every other expert computed on the host "
                   "where the store holds it (llama.cpp's --n-cpu-moe)", offloads=True, host_lane="misses"),
    Policy("spec-lru", "speculation alone: the INT4 draft guesses tokens, verification fetches on miss",
           offloads=True, drafts=True, decoder="speculative"),
    Policy("specter", "speculation with the draft's lookahead prefetching the experts verification will use, "
                      "misses split between copying and the host", offloads=True, drafts=True, prefetch="planner",
           host_lane="split", decoder="speculative"),
    Policy("oracle", "true routing known in advance, Belady eviction: the limit of prefetching at a budget",
           offloads=True, prefetch="oracle", decoder="oracle", bench_only=True),
)

DEFAULT = "specter"  # what specter.load and the CLI run when no policy is named
DEFAULT_K_MAX = 32   # the longest draft a speculative policy tries (specter.load's k_max, --k-max)
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
