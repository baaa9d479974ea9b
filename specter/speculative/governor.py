"""The governor: picks each cycle's K (0..K_max) so that speculation never loses to plain decoding, and K = 0's own
arm (with or without next-layer prefetch: `PlainArms`, arms.py). Why: docs/ARCHITECTURE.md ("The governor ...").

1. Arms, judged by realised throughput. Plain decoding (K = 0) and speculation (K >= 1) each keep a window of
   their latest cycles (W_plain steps, W_spec cycles); an arm's rate R is the median of worth(K) / seconds over
   its window (where it holds dear cycles and cheap ones, their mixture: `_Window`), worth(K) = E[tokens | K]
   by the estimates a_i of 2 (the bounds a_i^- pick K, not the arm), seconds the cycle's wall time, stalls
   included. Both arms are measured first (`start_plain`, when the budget
   holds every expert: plain decoding runs, speculation is probed 2 `probe_every` steps in). Speculation takes
   over only right after one of its own cycles, when that cycle's rate and its window's both clear

       R_spec > R_plain (1 + margin)                                  while plain steps copy
       R_spec > max(R_plain, R_plain_3) (1 + margin + extra)           when they copy nothing
       extra = min(proof sqrt(e_spec^2 + e_plain^2), proof_cap) + free_margin

   e a window's relative standard error (`_Window`), R_plain_3 the median of the newest 3 plain steps; leaving
   speculation takes only the margin. A plain step that copied, right after a speculative cycle, charges that
   cycle its excess over the plain window's median copying step (the experts its verification evicted,
   re-copied). The
   losing arm is probed (`plain_probe` plain steps, or `spec_probe` speculative cycles at its best K: one in a
   process; a pipeline's first probe cycle pays its whole draft, which its later ones draft beside the last
   verification, so it probes three) `probe_every` cycles
   after it lost, then at doubling intervals that keep the probes' loss under `budget` (a probe that alone beats
   the running arm by the same burden is followed up at once); with n cycles of t_o seconds at rate R_o against
   the running arm's t_r seconds and R_r (t an arm's median cycle seconds):

       interval >= n (t_o / t_r) (1 - R_o / R_r) / budget    (a plain probe's at once; the doubling a probe later)

   capped at probe_max cycles while speculating and probe_max n (t_o / t_r) while decoding plainly (twice that, at
   half the budget, when plain steps copy nothing). While decoding plainly, speculation is probed every
   `probe_every` steps, without backing off, while it may yet win: R_spec^+ > R_plain (1 + margin), R_spec^+ its
   window rated by the upper bounds a_i^+ (z = z_hope), judged as each probe starts and again once it ran.

2. Inside speculation, K is the argmax of E^-[tokens | K] / cycle(K) over 1 <= K <= min(K_max, 2 K_hi):

       E[tokens | K] = 1 + sum_{j=1..K} prod_{i=1..j} a_i
       a_i = (h_i + m p) / (n_i + m),     a_i^-+ = a_i -+ z sqrt(a_i (1 - a_i) / (N_i + m))
       cycle(K) = K d + v0 + v1 (K + 1) + s(K)
       s(K) = min(sum_t w_t sbar_t / sum_t w_t, min_{t > K, n_t >= n_K} sbar_t + (t - K) d),  w_t = n_t exp(-|K'-t|/h)

   a_i the probability that drafted position i is accepted given that i-1 was; h_i, n_i its decayed accepted /
   tried counts, N_i its observations (capped at 64), p the pooled acceptance (a prior worth m observations); d
   the draft step time, v0 + v1 (K + 1) verify compute fitted (weights n_K; the slope the lesser of the fits
   over every K and over the K read twice or more), sbar_t the moving average of the stall verification waited
   on (copies, the host lane) at tried K = t, n_t its count (capped at 16), h = `bandwidth`, K' = K clamped to
   the tried range (copies: a union of experts, which saturates with K); the min: a longer cycle drafts more and
   waits on a superset of copies, so a cold first reading at K_init cannot keep K long. Every `probe_every`
   cycles (doubling up to `probe_max` while the best K holds) it tries a K next to the best one, above and below
   in turn.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

from .arms import PlainArms


class _Window:
    """The latest cycles of one arm, as (K verified, seconds, dear). Recomputed at each add: rates, rate (their
    median: a burst of load slows a cycle or two many times over), seconds (the median cycle; None before the
    first), error (sqrt(pi/2) 1.4826 MAD / median rate / sqrt(n); None before two).

    `dear`: the cycle paid a cost only some cycles pay (a plain step's copies, a verification's stall, a
    pipeline's fresh draft). Such a cycle costs several that do not, so where the window holds both kinds its
    rate is their mixture: tokens over each kind's median seconds a token weighted by how often it came (robust
    to a burst of load in either kind). The median of all cycles would rate the arm at its commoner kind: with
    60% of plain steps copying nothing, at the no-copy step's speed however dear the copies."""

    def __init__(self, size: int, worth):
        self.ks, self.secs = deque(maxlen=size), deque(maxlen=size)  # each cycle's K and its seconds
        self.dear: deque = deque(maxlen=size)  # ... and whether it was dear (None: not told)
        self.worth = worth
        self.rates: list[float] = []
        self.rate = self.seconds = self.error = None

    def add(self, k: int, seconds: float, dear: bool | None = None) -> None:
        self.ks.append(k)
        self.secs.append(seconds)
        self.dear.append(dear)
        self.rates = self._rates(self.worth)
        med, self.seconds = statistics.median(self.rates), statistics.median(self.secs)
        self.rate = self._mix(self.rates)
        self.error, dev = None, []
        if len(self.secs) >= 2 and math.isfinite(med) and med > 0:
            for x in self.rates:
                dev.append(abs(x - med))
            self.error = 1.858 * statistics.median(dev) / med / math.sqrt(len(self.secs))

    def _rates(self, worth) -> list[float]:  # worth None: every cycle is one token
        return [(1.0 if worth is None else worth(k)) / s if s > 0 else math.inf for k, s in zip(self.ks, self.secs)]

    def rate_by(self, worth) -> float:
        """The window's rate with each cycle worth worth(K) tokens (as `rate` is at self.worth)."""
        return self._mix(self._rates(worth))

    def _mix(self, rates: list[float]) -> float:
        """The median of the cycles' rates, or where the window holds dear and cheap cycles their mixture."""
        if not (True in self.dear and False in self.dear and None not in self.dear):
            return statistics.median(rates)
        mix = sum(statistics.median(1 / r for r, d in zip(rates, self.dear) if d is kind) * self.dear.count(kind)
                  for kind in (False, True))  # seconds a token, summed over the window's cycles
        return len(rates) / mix if mix > 0 else math.inf

    def charge_last(self, extra: float) -> None:
        """The newest cycle `extra` seconds dearer (what it left to the cycle after it)."""
        k, seconds, dear = self.ks.pop(), self.secs.pop(), self.dear.pop()
        self.add(k, seconds + extra, dear)

    def typical(self, dear: bool) -> float | None:
        """The median seconds of the window's dear cycles (or cheap ones); of all of them where there are none."""
        secs = [s for s, d in zip(self.secs, self.dear) if d is dear]
        return statistics.median(secs) if secs else self.seconds

    def recent(self, n: int = 3) -> float | None:  # the median rate of its newest n cycles
        return statistics.median(self.rates[-n:]) if self.secs else None


class Governor:
    def __init__(self, k_max: int, k_init: int = 4, alpha: float = 0.25, probe_every: int = 8,
                 probe_max: int = 64, plain_probe: int = 2, spec_probe: int = 1, windows: tuple[int, int] = (8, 4),
                 z: float = 0.5, prior_weight: float = 4.0, bandwidth: float = 3.0, margin: float = 0.03,
                 budget: float = 0.01, proof: float = 1.0, proof_cap: float = 0.25, free_margin: float = 0.10,
                 fixed: int | None = None, z_hope: float = 1.0):
        self.k_max, self.alpha, self.fixed, self.k_init = k_max, alpha, fixed, max(1, min(k_init, k_max))
        self.probe_every, self.probe_max = probe_every, probe_max
        self.plain_probe, self.spec_probe = plain_probe, spec_probe
        self.z, self.m, self.bandwidth, self.margin, self.budget = z, prior_weight, bandwidth, margin, budget
        self.proof, self.proof_cap, self.free_margin, self.z_hope = proof, proof_cap, free_margin, z_hope
        # acceptance: decayed accepted / tried counts per drafted position (1..K_max) and pooled
        self.hits, self.tries, self.seen = [0.0] * (k_max + 1), [0.0] * (k_max + 1), [0] * (k_max + 1)  # seen: capped
        self.pool_hits, self.pool_tries = 0.8, 1.0
        self.draft_s = self.v0 = self.v1 = None  # d; the verify compute fit v0 + v1 (K + 1)
        self.stall: dict[int, float] = {}    # sbar_K
        self.stall_n: dict[int, int] = {}    # n_K (capped)
        self._v: dict[int, float] = {}       # per-K verify compute EMA
        self.plain, self.spec = _Window(windows[0], None), _Window(windows[1], self.window_tokens)
        self._worth: dict[int, float] = {}   # window_tokens, valid until the next observation
        self._bounds: dict[float, list[float]] = {}  # z -> [a_0 = 1, a_1^-, .., a_Kmax^-], until the next one
        self.plain_arms = PlainArms()        # K = 0's arm: with or without next-layer prefetch
        self.lane_arms = PlainArms()         # ... and with the host lane for its misses, or copying every one (True)
        self.plain_copies_nothing = False    # none of the plain window's steps (at least plain_probe) copied anything
                                             # (or said: plain.dear): no bytes for speculation to save
        self.cycles = 0
        self.arm: str | None = None          # the running arm: "spec" or "plain" (None: both still measured)
        self._spec_fresh: float | None = None  # the rate of the latest cycle if it was speculative (a probe)
        self._after_spec = False             # the latest cycle was speculative
        self.probe = False                   # the last decision was a probe (of the other arm, or of a K)
        self._arm_probe, self._arm_probe_left = False, 0  # ... of the other arm; its cycles still to run
        self._arm_interval, self._arm_next = probe_every, probe_every
        self._best: int | None = None        # speculation's argmax K at the last decision
        self._k_interval, self._k_next, self._side = probe_every, probe_every, 0
        self.k = k_init if fixed is None else fixed
        self.steps = 1                       # when next_k returns 0: plain steps to run before the next call
        self._kernel = [math.exp(-d / bandwidth) for d in range(k_max + 1)]  # s(K)'s weights by |K' - t|

    # ---------------------------------------------------------------------------- observe
    def observe_cycle(self, k: int, accepted: int, draft_s: float, verify_s: float, stall_s: float,
                      verified: int | None = None, copied: int | None = None, steps: int = 1,
                      dear: bool | None = None) -> None:
        """A cycle drafted K tokens (in draft_s), verified the first `verified` of them (default all), accepted
        `accepted` of those; verification took verify_s, stall_s of it waiting on copies or the host lane. `copied`:
        expert bytes a plain step (K = 0) found off the device, to copy or read on the host lane (None: unknown).
        `steps`: K = 0 only, a run of that many plain steps (next_k's steps): verify_s their mean, copied their sum.
        `dear` (K >= 1; _Window): whether the cycle paid a cost only some cycles pay, default stall_s > 0 (a
        pipeline passes its fresh drafts: pipeline/optimistic.py); a plain step's is copied > 0."""
        self.cycles += steps
        seconds = draft_s + verify_s
        drafted, k = k, (k if verified is None else verified)
        for i in range(1, min(accepted + 1, k) + 1):  # positions 1..accepted were accepted, accepted+1 rejected
            hit = 1.0 if i <= accepted else 0.0
            self.hits[i], self.tries[i] = 0.9 * self.hits[i] + hit, 0.9 * self.tries[i] + 1.0
            self.seen[i] = min(self.seen[i] + 1, 64)
            self.pool_hits, self.pool_tries = 0.98 * self.pool_hits + hit, 0.98 * self.pool_tries + 1.0
        self._worth, self._bounds = {}, {}  # valid until the next observation
        after_spec, self._after_spec = self._after_spec, drafted > 0
        if after_spec and drafted == 0 and copied != 0 and len(self.plain.secs) >= self.plain_probe:
            excess = seconds - self.plain.typical(True)  # what the last cycle's evictions cost this step, beyond a
            # plain step's usual copies (not told which copied: every step's median)
            if excess > 0:
                self.spec.charge_last(excess)
                seconds -= excess
        self._spec_fresh = self.window_tokens(k) / seconds if drafted > 0 and seconds > 0 else None
        if self._arm_probe and self._arm_probe_left == 0 and seconds > 0:
            # an arm probe just ended: if it alone beats the running arm, probe again right away
            probed_plain, rate = drafted == 0, self.window_tokens(k) / seconds
            if probed_plain != (self.arm == "plain"):
                running = (self.plain if self.arm == "plain" else self.spec).rate
                need = self.margin if probed_plain else self.burden()
                if running is not None and not probed_plain:
                    plain = self.plain  # as speculation must beat it (as in _arm)
                    running = max(plain.rate, plain.recent()) if self.plain_copies_nothing else plain.rate
                if running is not None and rate > running * (1 + need):
                    self._arm_next = self.cycles
        if drafted == 0:
            self.plain.add(k, seconds, None if copied is None else copied > 0)
            self.plain_copies_nothing = len(self.plain.dear) >= self.plain_probe and all(
                d is False for d in self.plain.dear)
            return
        self.spec.add(k, seconds, stall_s > 0 if dear is None else dear)
        if self._arm_probe and self.hopeful():  # a probe that lifted the hopes: the next one at probe_every
            self._arm_interval, self._arm_next = self.probe_every, min(self._arm_next, self.cycles + self.probe_every)
        a = self.alpha  # moving averages (None: no value yet, so the first is taken as it is)
        old, new = self.draft_s, draft_s / drafted
        self.draft_s = new if old is None else (1 - a) * old + a * new
        old = self.stall.get(drafted)  # what drafting K costs, as verified
        self.stall[drafted] = stall_s if old is None else (1 - a) * old + a * stall_s
        old, new = self._v.get(k), verify_s - stall_s
        self._v[k] = new if old is None else (1 - a) * old + a * new
        self.stall_n[drafted] = min(self.stall_n.get(drafted, 0) + 1, 16)
        # the verify fit's slope (docstring): a K read once (a load spike?) may lengthen K, but not shorten it
        sure = [(k, v) for k, v in self._v.items() if self.stall_n.get(k, 1) >= 2]
        self.v0, self.v1 = fit = self._verify_fit(list(self._v.items()))
        if sure and len(sure) < len(self._v) and (alt := self._verify_fit(sure))[1] < fit[1]:
            self.v0, self.v1 = alt  # a second fit only while some K was read once: one in the usual case

    def _verify_fit(self, pts: list[tuple[int, float]]) -> tuple[float, float]:
        """(v0, v1): v0 + v1 (K + 1) by least squares over (K, verify compute) points weighted by n_K; one point: a
        prior (verify mostly fixed cost)."""
        if len(pts) == 1:
            return pts[0][1] * 0.7, pts[0][1] * 0.3 / (pts[0][0] + 1)
        n, sx, sy, stall_n = 0, 0, 0.0, self.stall_n
        for k, v in pts:
            n, sx, sy = n + (w := stall_n.get(k, 1)), sx + w * (k + 1), sy + w * v
        mx, my, var, cov = sx / n, sy / n, 0.0, 0.0
        for k, v in pts:
            var, cov = var + (w := stall_n.get(k, 1)) * (k + 1 - mx) ** 2, cov + w * (k + 1 - mx) * (v - my)
        v1 = max(0.0, cov / var) if var else 0.0
        return max(0.0, my - v1 * mx), v1

    def start_plain(self) -> None:
        """A prior for a new engine whose budget holds every expert: nothing is ever copied, so a draft has nothing
        to hide and speculation can only win on compute. Plain decoding runs from the first token, and speculation
        is first probed 2 `probe_every` steps later (a short first generation is not spent measuring it), then like
        any losing arm."""
        if self.arm is None and self.fixed is None and self.k_max > 0:
            self.arm = "plain"
            self._arm_next = self.cycles + 2 * self.probe_every

    def new_context(self) -> None:
        """A new prompt: while plain decoding runs, speculation is probed again 2 `probe_every` steps in, as in a new
        engine (start_plain). Probes that kept losing back off to intervals sized by the phase they lost in (up to
        probe_max n (t_o / t_r) steps: thousands when plain steps copied nothing), and plain decoding's steps run as
        one observation up to the next probe, so a new prompt whose plain steps copy again (many times slower)
        would otherwise run without speculation for as long. One probe a generation at most; the backed-off
        interval holds after it while speculation keeps losing."""
        if self.arm == "plain" and self.fixed is None:
            self._arm_next = min(self._arm_next, self.cycles + 2 * self.probe_every)

    def burden(self) -> float:
        """How much faster speculation must be before it runs: margin (+ extra when plain copies nothing)."""
        if not self.plain_copies_nothing:
            return self.margin
        var = (self.spec.error or 0.0) ** 2 + (self.plain.error or 0.0) ** 2  # None: not measured yet
        return self.margin + min(self.proof * math.sqrt(var), self.proof_cap) + self.free_margin

    # ------------------------------------------------------------------------- estimates
    def bounds(self, z: float) -> list[float]:
        """[1, a_1^-, .., a_Kmax^-] at this z (0: the estimates a_i; < 0: the upper bounds), once per observation."""
        out = self._bounds.get(z)
        if out is None:
            p, m, out = self.pool_hits / self.pool_tries, self.m, [1.0]  # p: the pooled acceptance
            for i in range(1, self.k_max + 1):
                a = (self.hits[i] + m * p) / (self.tries[i] + m)
                out.append(min(1.0, max(0.0, a - z * math.sqrt(a * (1.0 - a) / (self.seen[i] + m)))))
            self._bounds[z] = out
        return out

    def window_tokens(self, k: int, z: float = 0.0) -> float:
        """worth(K) = E[tokens | K] now, by the estimates a_i (z = 0; the bounds pick K, not the arm), or at z < 0
        by the upper bounds a_i^+ (`hopeful`)."""
        if (k, z) not in self._worth:
            a, tokens, run = self.bounds(z), 1.0, 1.0
            for i in range(1, k + 1):
                run *= a[i]
                tokens += run
            self._worth[k, z] = tokens
        return self._worth[k, z]

    def hopeful(self) -> bool:
        """Plain decoding runs, and speculation may yet win: R_spec^+ (window rated by a_i^+) > R_plain (1 + margin)."""
        if self.arm != "plain" or not self.spec.secs:
            return False
        return self.spec.rate_by(lambda k: self.window_tokens(k, -self.z_hope)) > self.plain.rate * (1 + self.margin)

    def stall_estimate(self, k: int) -> float:
        """s(K): kernel-smoothed measured stalls, clamped to the tried range, bounded by longer K's (the docstring)."""
        if not self.stall:
            return 0.0
        k = min(max(k, min(self.stall)), max(self.stall))
        kernel, n, d = self._kernel, self.stall_n.get(k, 0), self.draft_s or 0.0
        num, den, cap = 0.0, 0.0, math.inf
        for t, s in self.stall.items():
            w = self.stall_n[t] * kernel[abs(k - t)]
            num, den = num + w * s, den + w
            if t > k and self.stall_n[t] >= n:  # a longer K, measured as often: what it cost, plus K's saved drafting
                cap = min(cap, s + (t - k) * d)
        return min(num / den, cap)

    def _argmax_k(self) -> int:
        """argmax_{K >= 1} E^-[tokens | K] / cycle(K), in one pass over K."""
        if self.draft_s is None or self.v0 is None:
            return self.k_init
        best_k, best_r, tokens, run = 1, -1.0, 1.0, 1.0
        lo, hi = min(self.stall), max(self.stall)
        a, stall = self.bounds(self.z), {}  # s(K), clamped outside the tried range: computed once
        for k in range(1, min(self.k_max, 2 * hi) + 1):  # at most twice the longest tried
            run *= a[k]
            tokens += run
            c = min(max(k, lo), hi)
            if c not in stall:
                stall[c] = self.stall_estimate(c)
            t = k * self.draft_s + self.v0 + self.v1 * (k + 1) + stall[c]  # cycle_time(k)
            if t > 0 and tokens / t > best_r:
                best_k, best_r = k, tokens / t
        return best_k

    # ----------------------------------------------------------------------------- decide
    def next_k(self, remaining: int) -> int:
        """K for the next cycle; `remaining` tokens are still wanted (no point drafting past them). When it is 0,
        `steps` says how many plain steps to run before asking again (the decoder runs them as plain decoding's loop
        and reports them as one observe_cycle(steps=n)): one while the arms are measured or probed and right after a
        speculative cycle (that step may pay for the cycle's copies), else up to the next probe of speculation,
        since nothing else can move plain decoding's arm before it (a switch needs a fresh speculative cycle)."""
        cap = max(0, min(self.k_max, remaining - 1))
        self.steps = 1
        if self.fixed is not None or self.k_max == 0:
            self.steps = max(1, remaining)
            return min(self.fixed or 0, cap)
        self.probe = self._arm_probe = False
        arm = self._arm()
        self._arm_probe = self.probe
        self.k = 0 if arm == "plain" else self._argmax_k()
        if arm == "plain":
            if not (self.probe or self.arm != "plain" or self._after_spec):
                self.steps = max(1, min(remaining, self._arm_next - self.cycles))
            return 0
        if self.probe:  # an arm probe of speculation runs its best K
            return min(self.k, cap)
        best = self.k  # running speculation explores K around its best
        if best != self._best:  # the best K moved: look around it again soon
            self._best, self._k_interval = best, self.probe_every
            self._k_next = min(self._k_next, self.cycles + self.probe_every)
        if self.cycles >= self._k_next:
            self._k_next = self.cycles + self._k_interval
            self._k_interval = min(2 * self._k_interval, self.probe_max)
            self._side += 1
            around = ()  # the neighbours inside 1..K_max, in turn (a K probe: rare)
            for k in (best + 1, best - 1):
                if 1 <= k <= self.k_max:
                    around += (k,)
            if around:
                self.probe = True
                self.k = around[self._side % len(around)]
        return min(self.k, cap)

    def _arm(self) -> str:
        """Which arm runs this cycle: both are measured first, then the faster, with probes of the other."""
        if self._arm_probe_left > 0:  # inside a probe of the other arm
            self._arm_probe_left -= 1
            self.probe = True
            return "spec" if self.arm == "plain" else "plain"
        if self.arm is None:  # both arms measured first (start_plain: plain decoding runs)
            if len(self.spec.secs) < max(2, self.spec_probe):
                return "spec"
            if len(self.plain.secs) < self.plain_probe:
                return "plain"
            # both measured: speculation runs only if it proves faster
            self.arm = "spec" if self.spec.rate > self.plain.rate * (1 + self.burden()) else "plain"
        running, other = (self.spec, self.plain) if self.arm == "spec" else (self.plain, self.spec)
        if running.rate is None:  # start_plain: plain decoding measures itself first
            return self.arm
        # the burden is at least the margin (start_plain: speculation unmeasured until its first probe)
        faster = other.rate is not None and other.rate > running.rate * (1 + self.margin)
        if faster and self.arm == "plain":  # the burden of proof, on evidence as fresh as the plain window's
            # plain decoding's rate as speculation must beat it: the window's, and when plain steps copy
            # nothing also its newest steps' (R_plain_3), whichever is faster
            plain = self.plain
            bar = (max(plain.rate, plain.recent()) if self.plain_copies_nothing else plain.rate) * (1 + self.burden())
            faster = self._spec_fresh is not None and min(other.rate, self._spec_fresh) > bar
        if faster:  # the landscape moved: look at the loser again soon
            self.arm = "plain" if self.arm == "spec" else "spec"
            self._arm_interval = self.probe_every
            self._arm_next = self.cycles + self.probe_every
        if self.cycles >= self._arm_next:
            self._arm_next = self.cycles + self._arm_interval
            # probes that keep losing back off, and never cost more than `budget` of the time
            n = self.plain_probe if self.arm == "spec" else self.spec_probe
            weight = max(other.seconds or 0.0, 1e-12) / max(running.seconds, 1e-12)  # t_o / t_r
            loss = 0.0 if other.rate is None else n * weight * max(0.0, 1.0 - other.rate / max(running.rate, 1e-12))
            cap = self.probe_max if self.arm == "spec" else round(self.probe_max * max(1.0, weight) * n)  # in probes
            budget, free = self.budget, self.arm == "plain" and self.plain_copies_nothing
            cap, budget = (2 * cap, budget / 2) if free else (cap, budget)
            if self.hopeful():
                self._arm_interval = self.probe_every  # speculation may yet win: no backing off while it may
            else:
                self._arm_interval = min(max(2 * self._arm_interval, round(loss / budget)), cap)
            if self.arm == "spec":  # a costly plain probe puts the next off at once (speculation's hopes may return)
                self._arm_next = max(self._arm_next, self.cycles + min(round(loss / budget), cap))
            self._arm_probe_left = n - 1
            self.probe = True
            return "plain" if self.arm == "spec" else "spec"
        return self.arm
