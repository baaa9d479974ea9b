"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specter_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.cancelled = Counter("specter_requests_cancelled", "generations stopped because the client went away",
                                 registry=r)
        self.queue_depth = Gauge("specter_queue_depth", "requests waiting for the engine", registry=r)
        self.queue_wait = Histogram("specter_queue_wait_seconds", "time a request waited for the engine",
                                    buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("specter_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("specter_generated_tokens", "tokens generated (cancelled requests included)",
                                        registry=r)
        self.tokens_per_second = Gauge("specter_tokens_per_second", "decode rate of the last request (1 / TPOT)",
                                       registry=r)
        self.ttft = Histogram("specter_ttft_seconds", "time to first token in the engine (prefill)",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("specter_tpot_seconds", "time per output token after the first",
                              buckets=_LATENCY, registry=r)
        self.h2d_bytes = Counter("specter_h2d_bytes", "expert bytes copied host -> device", registry=r)
        self.expert_hits = Counter("specter_expert_hits", "expert uses found on the device", registry=r)
        self.expert_misses = Counter("specter_expert_misses",
                                     "expert uses not in a slot (copied, decoded from the coded tier, or computed "
                                     "on the host lane)", registry=r)
        self.tier_hits = Counter("specter_expert_tier_hits", "expert misses decoded from the coded device tier "
                                 "(--compress-experts), with no PCIe copy", registry=r)
        self.drafted = Counter("specter_drafted_tokens", "tokens the draft proposed", registry=r)
        self.accepted = Counter("specter_accepted_tokens", "drafted tokens verification accepted", registry=r)
        # ratios over the server's lifetime; NaN until there is something to divide
        self._uses = [0, 0, 0]       # expert hits, misses, coded-tier hits (among the misses)
        self._tried = [0, 0]         # accepted, rejections (alpha = accepted / (accepted + rejections))
        Gauge("specter_expert_hit_rate", "expert hits (in a slot) / expert uses since start",
              registry=r).set_function(lambda: _ratio(self._uses[0], self._uses[0] + self._uses[1]))
        Gauge("specter_expert_device_hit_rate", "expert uses found on the device (in a slot or the coded tier) / "
              "expert uses since start (bench's device_hit_rate, the summary line's hit rate)",
              registry=r).set_function(lambda: _ratio(self._uses[0] + self._uses[2], self._uses[0] + self._uses[1]))
        Gauge("specter_acceptance_rate", "alpha: P(a drafted token is accepted | the ones before were), since start",
              registry=r).set_function(lambda: _ratio(self._tried[0], sum(self._tried)))

    def observe(self, stats: dict) -> None:
        """Account one finished (or cancelled) generation from the engine's stats."""
        n = stats.get("generated_tokens", 0)  # (through a stop string's token: what the model generated)
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        self.generated_tokens.inc(n)
        if n:
            self.ttft.observe(stats["ttft_s"])
        if n > 1:
            self.tpot.observe(stats["tpot_s"])
            self.tokens_per_second.set(1 / stats["tpot_s"] if stats["tpot_s"] else 0.0)
        hits, misses = stats.get("expert_hits") or 0, stats.get("expert_misses") or 0
        self.expert_hits.inc(hits)
        self.expert_misses.inc(misses)
        self._uses[0] += hits
        self._uses[1] += misses
        tier = stats.get("tier_hits") or 0
        self.tier_hits.inc(tier)
        self._uses[2] += tier
        self.h2d_bytes.inc(stats.get("h2d_bytes") or 0)
        accepted = stats.get("accepted_tokens") or 0
        self.drafted.inc(stats.get("drafted_tokens") or 0)
        self.accepted.inc(accepted)
        self._tried[0] += accepted
        self._tried[1] += stats.get("rejections") or 0


def _ratio(a: int, b: int) -> float:
    return a / b if b else float("nan")
