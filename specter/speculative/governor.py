"""The governor: picks the next cycle's K (0..K_max) to maximise tokens per second.

Model (the amortisation roofline). A cycle with K drafted tokens commits

    E[tokens | K] = 1 + sum_{j=1..K} prod_{i=1..j} a_i

where a_i is the moving-average probability that drafted position i is accepted given that
position i-1 was. A position never yet reached (K grows past anything tried) borrows the pooled
acceptance of all positions seen: a fixed pessimistic prior there would make the governor climb
one probe at a time towards a good long K, and a short generation never gets there. Its time is

    cycle(K) = max(K * d, c_first(K)) + c_rest(K) + v(K)
             = K * d + s(K) + v(K)

with d the draft step time, c_first the copies issued during drafting, c_rest the copies still
missing when verification reaches them, and v(K) the compute of verifying K+1 tokens. The copy
terms are not modelled from bytes but measured: s(K), the stall the verifier actually waited,
is exactly the part of the copies drafting did not hide. v(K) = v0 + v1 * (K + 1) is a running
linear fit of verify compute time. K = 0 is plain decoding, whose measured step time t0 includes
its own stalls: rate(0) = 1 / t0.

The governor returns argmax_K E[tokens | K] / cycle(K). Every estimate is a moving average, and
now and then it tries a K next to the best one, so stale estimates heal and a useful draft is
never locked out: first after `probe_every` cycles, then at doubling intervals (up to 8x) while
the best K stays the same, back to `probe_every` when it changes; with a useless draft a_i -> 0 and K = 0 wins, so speculation
never makes a run slower than not speculating (beyond the probes).
"""
from __future__ import annotations


class Governor:
    def __init__(self, k_max: int, k_init: int = 4, alpha: float = 0.25, probe_every: int = 8, fixed: int | None = None):
        self.k_max, self.alpha, self.probe_every, self.fixed = k_max, alpha, probe_every, fixed
        # acc[i]: P(accept position i | accepted i-1), i >= 1; None until position i is first observed
        self.acc: list[float | None] = [None] * (k_max + 1)
        self.pool = 0.8                      # acceptance over all observed positions: the prior for unseen ones
        self.draft_s: float | None = None    # d
        self.stall: dict[int, float] = {}    # s(K)
        self.v0, self.v1 = None, None        # verify compute fit
        self._v: dict[int, float] = {}       # per-K verify compute EMA
        self.step0: float | None = None      # t0: a plain decode step, stalls included
        self.cycles = 0
        self._probe = 0
        self._best = None                    # argmax of the last decision
        self._interval, self._next_probe = probe_every, probe_every
        self.probe_max = 8 * probe_every
        self.k = k_init if fixed is None else fixed

    def _ema(self, old, new):
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    # ---------------------------------------------------------------------------- observe
    def observe_cycle(self, k: int, accepted: int, draft_s: float, verify_s: float, stall_s: float) -> None:
        self.cycles += 1
        if k == 0:
            self.step0 = self._ema(self.step0, verify_s)
            return
        for i in range(1, min(accepted + 1, k) + 1):  # positions 1..accepted were accepted, accepted+1 rejected
            hit = 1.0 if i <= accepted else 0.0
            self.acc[i] = (1 - self.alpha) * self._acc(i) + self.alpha * hit
            self.pool = (1 - self.alpha / 4) * self.pool + self.alpha / 4 * hit
        self.draft_s = self._ema(self.draft_s, draft_s / k)
        self.stall[k] = self._ema(self.stall.get(k), stall_s)
        self._v[k] = self._ema(self._v.get(k), verify_s - stall_s)
        self._fit()

    def _acc(self, i: int) -> float:
        a = self.acc[i]
        return self.pool if a is None else a

    def _fit(self) -> None:
        pts = sorted(self._v.items())
        if len(pts) == 1:
            k, v = pts[0]
            self.v0, self.v1 = v * 0.7, v * 0.3 / (k + 1)  # a prior: verify mostly fixed cost
            return
        n = len(pts)
        xs, ys = [k + 1 for k, _ in pts], [v for _, v in pts]
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        self.v1 = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var) if var else 0.0
        self.v0 = max(0.0, my - self.v1 * mx)

    # ----------------------------------------------------------------------------- decide
    def cycle_time(self, k: int, unseen_stall: float | None = None) -> float | None:
        """cycle(K); a K never observed borrows the smallest stall seen (`unseen_stall`)."""
        if k == 0:
            return self.step0
        if self.draft_s is None or self.v0 is None:
            return None
        if unseen_stall is None:
            unseen_stall = min(self.stall.values()) if self.stall else 0.0
        return k * self.draft_s + self.stall.get(k, unseen_stall) + self.v0 + self.v1 * (k + 1)

    def _argmax_rate(self) -> int:
        """argmax_K rate(K) in one pass (this runs every cycle, so no per-K recomputation)."""
        best_k, best_r = self.k, None
        if self.step0:
            best_k, best_r = 0, 1.0 / self.step0
        if self.draft_s is None or self.v0 is None:
            return best_k
        unseen = min(self.stall.values()) if self.stall else 0.0
        tokens, run = 1.0, 1.0
        for k in range(1, self.k_max + 1):
            run *= self._acc(k)
            tokens += run
            t = self.cycle_time(k, unseen)
            if t > 0 and (best_r is None or tokens / t > best_r):
                best_k, best_r = k, tokens / t
        return best_k

    def _neighbour(self) -> int:
        """A probe next to the best K (alternately above and below): cheap, and enough for the
        rate model, which already extrapolates to every K from acceptance and the verify fit."""
        best = self.k if self._best is None else self._best
        around = [k for k in (best + 1, best - 1) if 0 <= k <= self.k_max]
        self._probe += 1
        return around[self._probe % len(around)] if around else best

    def next_k(self, remaining: int) -> int:
        """K for the next cycle; `remaining` tokens are still wanted (no point drafting past them)."""
        cap = max(0, min(self.k_max, remaining - 1))
        if self.fixed is not None:
            return min(self.fixed, cap)
        if self.step0 is None and self.cycles >= 2:
            k = 0  # measure plain decoding once early: it is the floor we must beat
        elif self.cycles >= self._next_probe:
            k = self._neighbour()
            self._next_probe = self.cycles + self._interval
            self._interval = min(self._interval * 2, self.probe_max)  # probes that keep losing back off
        else:
            k = self._argmax_rate()
            if k != self._best:  # the landscape moved: look around again soon
                self._best, self._interval = k, self.probe_every
                self._next_probe = min(self._next_probe, self.cycles + self.probe_every)
        self.k = k
        return min(k, cap)
