"""The governor: picks each cycle's K (0..K_max) so that speculation never loses to plain decoding.

It works at two levels.

1. Arms, judged by realised throughput. Plain decoding (K = 0) and speculation (K >= 1) each keep
   a window of their latest cycles, and an arm's rate is

       R = median(tokens / seconds)              over its window (W_plain steps, W_spec cycles)

   seconds are the cycle's measured wall time (draft + verify + acceptance: whatever the model
   below leaves out is in it); tokens are what the cycle was worth, E^-[tokens | K] by the lower
   bounds a_i^- of the acceptance below, evaluated when the arms are compared (a window of a few
   cycles' own accepted counts is too noisy to rank two arms within a few percent, and a window
   that kept each cycle's worth as estimated when it ran would keep a lucky probe's optimism).

   The burden of proof is on speculation. Both arms are measured first; then, and whenever plain
   decoding runs, speculation takes over only right after one of its own cycles (a probe), when
   that cycle's own rate and its window's both clear the bar:

       R_spec > R_plain (1 + margin)                                   while plain steps copy
       R_spec > max(R_plain, R_plain_3) (1 + margin + extra)            when they copy nothing

   Only right after a probe: while plain decoding runs, the speculative window holds cycles of
   earlier text, and a plain window that slowed with the text it decodes now (more misses) must not
   be compared with them -- traced on a DeepSeek-V2 shape at 1/4 residency, such stale windows
   switched spec-lru into 800 ms cycles worth less than the 110-150 ms plain steps they replaced.
   While plain steps copy, a step's time varies with its misses, which is the workload, not noise
   to discount: a larger bar there kept probes at a short K from ever growing into the long
   drafts that pay. When every plain step in the window copied nothing (all experts resident),
   speculation has no bytes to save, only its draft to pay for, and "never slower than resident"
   is the promise: R_plain_3 is the median of the newest 3 plain steps (a burst of load that
   slowed the plain window must not make speculation look faster), and

       extra = min(proof sqrt(e_spec^2 + e_plain^2), proof_cap) + free_margin   (10%)

   e the windows' relative standard errors, e = sqrt(pi/2) 1.4826 MAD(rates) / R / sqrt(n): a
   window that merely looks faster under timing noise does not win; a batched verification that
   really pays (on a GPU it can) still clears it, and speculative probes come half as often. Leaving
   speculation takes only `margin` (3%: under timing noise, two arms closer than that would take
   turns, and each switch pays probes; a margin within the "never more than 3% slower" promise).
   The other arm is probed (`plain_probe` plain steps, or one speculative cycle at its best K)
   `probe_every` cycles after it lost, then at doubling intervals up to `probe_max` cycles while
   it keeps losing, so K = 0 is re-measured as the cache and the text change, and speculation
   comes back when it pays again.
   A probe whose own rate beats the running arm's R by the same burden (speculation's to enter,
   the margin to leave) is followed up at once, so a changed landscape is confirmed within a
   window, not after several back-off intervals. The interval is
   also never shorter than keeps what probes lose under `budget` (1%) of the time: a probe of n
   cycles of t_o seconds at rate R_o loses n t_o (1 - R_o / R_r) against the running arm, paid
   over the interval's cycles of t_r seconds, so

       interval >= n (t_o / t_r) (1 - R_o / R_r) / budget      (t = an arm's median cycle seconds)

   capped at `probe_max` cycles while speculating, and at probe_max (t_o / t_r) cycles (probe_max
   probe-lengths of time) while decoding plainly: a speculative probe can last 4 plain steps for
   a token and a half, and a cap counted in plain steps let such probes cost 2-4% of the time.

2. Inside speculation, K from the model of the cycle (the amortisation roofline). A cycle with K
   drafted tokens commits

       E[tokens | K] = 1 + sum_{j=1..K} prod_{i=1..j} a_i

   a_i is the probability that drafted position i is accepted given that position i-1 was. With
   h_i, n_i the decayed accepted / tried counts of position i and p the pooled acceptance of
   every position (the prior, worth m pseudo-observations),

       a_i = (h_i + m p) / (n_i + m),     a_i^- = a_i - z sqrt(a_i (1 - a_i) / (N_i + m))

   with N_i the plain count of observations of position i (capped at 64), and K is chosen with
   the lower bounds a_i^-: a position rarely reached is held near the pooled rate with a wide
   bound, not at the last value it happened to show. z = 0.5: the bounds multiply along a draft,
   so a wider one would rule out long drafts that measurably pay. The cycle takes

       cycle(K) = K d + v0 + v1 (K + 1) + s(K)

   d the draft step time, v0 + v1 (K + 1) a running linear fit of verify compute, s(K) the copy
   stall verification waited on (the copies drafting did not hide), and with two lanes (specter,
   OffloadedExperts.host_choice) its wait for the host lane's rows too: plain steps use the same
   lanes, so both arms are timed on the same machinery. Each tried K keeps sbar_K, a
   moving average of its stalls, and n_K, its count (capped at 16); s(K) smooths them over K,

       s(K) = sum_t w_t sbar_t / sum_t w_t,     w_t = n_t exp(-|K' - t| / h),   K' = clamp(K, K_lo, K_hi)

   (h = `bandwidth`, K_lo..K_hi the tried range). One cycle's stall swings with what the cache
   happened to hold, so a lone K's own value is noise, and neighbouring K copy about the same
   union of experts. Outside the tried range the estimate is that of its nearest end: a cycle's
   copies are the union of its tokens' experts missing from the slots, which saturates, so a
   longer draft copies about as much as the longest tried (this is what lets long drafts amortise
   copies). Unlike a borrowed "smallest stall ever seen", no untried K looks better than what was
   measured next to it, and one lucky cycle is outweighed by its neighbours' counts. Speculation's
   K is the argmax of E^-[tokens | K] / cycle(K) over 1 <= K <= 2 K_hi: a draft at most doubles
   the longest tried, so a bet on long drafts that do not pay costs a few short cycles, not one
   K_max cycle. Every `probe_every` cycles (doubling up to `probe_max` while the best K holds) it
   tries a K next to the best one, alternately above and below, so stale estimates heal.
"""
from __future__ import annotations

import math
import statistics
from collections import deque


class _Window:
    """The latest cycles of one arm, as (K verified, seconds); its rate is the median of
    worth(K) / seconds, worth(K) the tokens such a cycle is worth by the acceptance estimates of
    now (not of when it ran: a probe's lucky acceptance must not stay in the window at its
    optimistic value). A burst of load from another process slows a cycle or two many times over:
    a ratio of sums would carry it into the comparison of the arms, the median does not."""

    def __init__(self, size: int, worth):
        self.ks: deque = deque(maxlen=size)
        self.secs: deque = deque(maxlen=size)
        self.worth = worth
        self._memo: dict = {}  # rate / error / seconds until the next add (worth changes only with a
                               # speculative cycle, which is added to the speculative window)

    def add(self, k: int, seconds: float) -> None:
        self.ks.append(k)
        self.secs.append(seconds)
        self._memo.clear()

    def __len__(self) -> int:
        return len(self.secs)

    def rates(self) -> list[float]:
        return [self.worth(k) / s if s > 0 else math.inf for k, s in zip(self.ks, self.secs)]

    def seconds(self) -> float | None:
        """The median duration of one of its cycles."""
        if "seconds" not in self._memo:
            self._memo["seconds"] = statistics.median(self.secs) if self.secs else None
        return self._memo["seconds"]

    def rate(self) -> float | None:
        if "rate" not in self._memo:
            self._memo["rate"] = statistics.median(self.rates()) if self.secs else None
        return self._memo["rate"]

    def recent(self, n: int = 3) -> float | None:
        """The median rate of its newest n cycles: what it measured just now."""
        return statistics.median(self.rates()[-n:]) if self.secs else None

    def error(self) -> float | None:
        """The relative standard error of `rate`: sqrt(pi/2) 1.4826 MAD / median / sqrt(n) (the MAD
        estimates the spread without trusting a burst; a median is sqrt(pi/2) as noisy as a mean)."""
        if "error" not in self._memo:
            med, err = self.rate(), None
            if len(self.secs) >= 2 and math.isfinite(med) and med > 0:
                mad = statistics.median(abs(x - med) for x in self.rates())
                err = 1.858 * mad / med / math.sqrt(len(self.secs))
            self._memo["error"] = err
        return self._memo["error"]


class Governor:
    def __init__(self, k_max: int, k_init: int = 4, alpha: float = 0.25, probe_every: int = 8,
                 probe_max: int = 64, plain_probe: int = 2, windows: tuple[int, int] = (8, 4), z: float = 0.5,
                 prior_weight: float = 4.0, bandwidth: float = 3.0, margin: float = 0.03, budget: float = 0.01,
                 proof: float = 1.0, proof_cap: float = 0.25, free_margin: float = 0.10, fixed: int | None = None):
        self.k_max, self.alpha, self.fixed = k_max, alpha, fixed
        self.probe_every, self.probe_max, self.plain_probe = probe_every, probe_max, plain_probe
        self.z, self.m, self.bandwidth, self.margin, self.budget = z, prior_weight, bandwidth, margin, budget
        self.proof, self.proof_cap, self.free_margin = proof, proof_cap, free_margin
        # acceptance: decayed accepted / tried counts per drafted position (1..K_max) and pooled
        self.hits, self.tries = [0.0] * (k_max + 1), [0.0] * (k_max + 1)
        self.seen = [0] * (k_max + 1)        # observations of each position (capped): its confidence
        self.pool_hits, self.pool_tries = 0.8, 1.0
        self.draft_s: float | None = None    # d
        self.stall: dict[int, float] = {}    # sbar_K
        self.stall_n: dict[int, int] = {}    # n_K (capped)
        self.v0, self.v1 = None, None        # verify compute fit
        self._v: dict[int, float] = {}       # per-K verify compute EMA
        self.step0: float | None = None      # a plain decode step, stalls included (EMA, for reports)
        self.plain, self.spec = _Window(windows[0], lambda k: 1.0), _Window(windows[1], self.window_tokens)
        self._worth: dict[int, float] = {}   # window_tokens, valid until the next observation
        self.plain_copied: deque = deque(maxlen=windows[0])  # did each of the latest plain steps copy anything
        self.cycles = 0
        self.arm: str | None = None          # the running arm: "spec" or "plain" (None: both still measured)
        self._spec_fresh: float | None = None  # the rate of the latest cycle if it was speculative (a probe)
        self.probe = False                   # the last decision was a probe (of the other arm, or of a K)
        self._arm_probe = False              # ... of the other arm
        self._arm_probe_left = 0             # cycles still to run of the current arm probe
        self._arm_interval, self._arm_next = probe_every, probe_every
        self._best: int | None = None        # speculation's argmax K at the last decision
        self._k_interval, self._k_next, self._side = probe_every, probe_every, 0
        self.k = k_init if fixed is None else fixed
        self._kernel = [math.exp(-d / bandwidth) for d in range(k_max + 1)]  # s(K)'s weights by |K' - t|

    # ---------------------------------------------------------------------------- observe
    def observe_cycle(self, k: int, accepted: int, draft_s: float, verify_s: float, stall_s: float,
                      verified: int | None = None, copied: int | None = None) -> None:
        """A cycle drafted K tokens (in draft_s), verified the first `verified` of them (default all:
        see `verify_k`), accepted `accepted` of those, and verification took verify_s, stall_s of it
        waiting on copies or the host lane. `copied`: expert bytes a plain step (K = 0) found off the device,
        copied over the link or read on the host lane (None: unknown)."""
        self.cycles += 1
        seconds = draft_s + verify_s
        drafted, k = k, (k if verified is None else verified)
        for i in range(1, min(accepted + 1, k) + 1):  # positions 1..accepted were accepted, accepted+1 rejected
            hit = 1.0 if i <= accepted else 0.0
            self.hits[i] = 0.9 * self.hits[i] + hit
            self.tries[i] = 0.9 * self.tries[i] + 1.0
            self.seen[i] = min(self.seen[i] + 1, 64)
            self.pool_hits = 0.98 * self.pool_hits + hit
            self.pool_tries = 0.98 * self.pool_tries + 1.0
        self._worth.clear()
        self._spec_fresh = self.window_tokens(k) / seconds if drafted > 0 and seconds > 0 else None
        if self._arm_probe and self._arm_probe_left == 0 and seconds > 0:
            self._follow_up(drafted, self.window_tokens(k) / seconds)
        (self.plain if drafted == 0 else self.spec).add(k, seconds)
        if drafted == 0:
            self.step0 = self._ema(self.step0, verify_s)
            self.plain_copied.append(copied is None or copied > 0)
            return
        self.draft_s = self._ema(self.draft_s, draft_s / drafted)
        self.stall[drafted] = self._ema(self.stall.get(drafted), stall_s)  # what drafting K costs, as verified
        self.stall_n[drafted] = min(self.stall_n.get(drafted, 0) + 1, 16)
        self._v[k] = self._ema(self._v.get(k), verify_s - stall_s)
        self._fit()

    def _follow_up(self, k: int, rate: float) -> None:
        """An arm probe just ended: if it alone beats the running arm, probe again right away."""
        probed_plain = k == 0
        if probed_plain != (self.arm == "plain"):
            running = (self.plain if self.arm == "plain" else self.spec).rate()
            need = self.margin if probed_plain else self.burden()
            if running is not None and not probed_plain:
                running = self._plain_bar()
            if running is not None and rate > running * (1 + need):
                self._arm_next = self.cycles

    @property
    def plain_copies_nothing(self) -> bool:
        """Every plain step in the window copied nothing (all experts resident): speculation has no
        bytes to save there, only its draft to pay for."""
        return len(self.plain_copied) >= self.plain_probe and not any(self.plain_copied)

    def _plain_bar(self) -> float:
        """Plain decoding's rate as speculation must beat it: at full residency also its newest steps
        (a burst of load that slowed the window must not make speculation look faster); elsewhere a
        plain step's time varies with its misses, and the faster of two medians would be biased up."""
        if self.plain_copies_nothing:
            return max(self.plain.rate(), self.plain.recent())
        return self.plain.rate()

    def burden(self) -> float:
        """How much faster speculation's window must measure than plain decoding's before it runs:
        the margin; when plain decoding copies nothing, plus `proof` combined standard errors of the
        two windows (capped at `proof_cap`) and `free_margin`. Leaving speculation takes the margin."""
        if not self.plain_copies_nothing:
            return self.margin
        errs = [e for e in (self.spec.error(), self.plain.error()) if e is not None]
        noise = min(self.proof * math.sqrt(sum(e * e for e in errs)), self.proof_cap)
        return self.margin + noise + self.free_margin

    def _ema(self, old, new):
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

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

    # ------------------------------------------------------------------------- estimates
    @property
    def pool(self) -> float:
        return self.pool_hits / self.pool_tries

    def acceptance(self, i: int, z: float | None = None) -> float:
        """a_i^-: the lower confidence bound of position i's acceptance (see the module docstring);
        z = 0 gives the estimate itself."""
        a = (self.hits[i] + self.m * self.pool) / (self.tries[i] + self.m)
        return max(0.0, a - (self.z if z is None else z) * math.sqrt(a * (1.0 - a) / (self.seen[i] + self.m)))

    def expected_tokens(self, k: int, z: float = 0.0) -> float:
        """E[tokens | K] by the acceptance estimates (z = 0) or their lower bounds (z > 0)."""
        tokens, run = 1.0, 1.0
        for i in range(1, k + 1):
            run *= self.acceptance(i, z=z)
            tokens += run
        return tokens

    def window_tokens(self, k: int) -> float:
        """What a speculative cycle that verified K tokens is worth in the arms' comparison:
        E^-[tokens | K], by the acceptance's lower bounds of now (a cycle's own count is too noisy
        for a window of a few cycles; an estimate from a few probes' lucky acceptances must not
        pull the governor into speculation)."""
        if k not in self._worth:
            self._worth[k] = self.expected_tokens(k, z=self.z)
        return self._worth[k]

    def stall_estimate(self, k: int) -> float:
        """s(K): kernel-smoothed measured stalls, clamped to the tried range (see the module docstring)."""
        if not self.stall:
            return 0.0
        k = min(max(k, min(self.stall)), max(self.stall))
        kernel = self._kernel
        num = den = 0.0
        for t, s in self.stall.items():
            w = self.stall_n[t] * kernel[abs(k - t)]
            num, den = num + w * s, den + w
        return num / den

    def cycle_time(self, k: int) -> float | None:
        """cycle(K) in seconds, or None before anything is measured."""
        if k == 0:
            return self.step0
        if self.draft_s is None or self.v0 is None:
            return None
        return k * self.draft_s + self.v0 + self.v1 * (k + 1) + self.stall_estimate(k)

    def rate(self, k: int) -> float | None:
        """The model's tokens per second at K (E[tokens | K] / cycle(K))."""
        t = self.cycle_time(k)
        if not t:
            return None
        tokens, run = 1.0, 1.0
        for i in range(1, k + 1):
            run *= self.acceptance(i)
            tokens += run
        return tokens / t

    def _argmax_k(self) -> int:
        """argmax_{K >= 1} rate(K), in one pass over K."""
        if self.draft_s is None or self.v0 is None:
            return max(1, self.k)
        best_k, best_r, tokens, run = 1, -1.0, 1.0, 1.0
        lo, hi = min(self.stall), max(self.stall)
        stall = {k: self.stall_estimate(k) for k in range(lo, hi + 1)}  # clamped outside: computed once
        for k in range(1, min(self.k_max, 2 * hi) + 1):  # at most twice the longest tried
            run *= self.acceptance(k)
            tokens += run
            t = k * self.draft_s + self.v0 + self.v1 * (k + 1) + stall[min(max(k, lo), hi)]  # cycle_time(k)
            if t > 0 and tokens / t > best_r:
                best_k, best_r = k, tokens / t
        return best_k

    def verify_k(self, k: int, new: list[int], copy_s: float) -> int:
        """How many of K drafted tokens to verify, now that the draft's routers said what each needs.

        Drafted token j (1..K) is worth value_j = prod_{i<=j} a_i tokens and costs v1 + c new_j seconds
        to verify, new_j the experts it needs that no earlier token needs and that are not on the device
        or on their way, c one copy's time. Verifying the first K' pays when, summed over j <= K', it
        buys tokens at least as cheaply as the speculative arm's realised rate R does:

            K' = argmax_{K'} sum_{j<=K'} (value_j - R (v1 + c new_j))

        A late token that needs an expert nothing earlier needs costs a whole copy for a fraction of
        a token. `new` holds new_j for j = 0..K-1 (the draft's routers saw those tokens); the last
        drafted token was never run through the draft, so it is charged the mean of the others."""
        rate = self.spec.rate()
        if k == 0 or rate is None or self.v1 is None:
            return k
        tail = sum(new[1:]) / (len(new) - 1) if len(new) > 1 else 0.0
        best, gain, best_gain, run = 0, 0.0, 0.0, 1.0
        for j in range(1, k + 1):
            run *= self.acceptance(j, z=0.0)
            gain += run - rate * (self.v1 + copy_s * (new[j] if j < len(new) else tail))
            if gain > best_gain:
                best, best_gain = j, gain
        return best

    # ----------------------------------------------------------------------------- decide
    def next_k(self, remaining: int) -> int:
        """K for the next cycle; `remaining` tokens are still wanted (no point drafting past them)."""
        cap = max(0, min(self.k_max, remaining - 1))
        if self.fixed is not None:
            return min(self.fixed, cap)
        if self.k_max == 0:
            return 0
        self.probe = self._arm_probe = False
        arm = self._arm()
        self._arm_probe = self.probe
        if arm == "plain":
            self.k = 0
        else:  # an arm probe of speculation runs its best K; only running speculation explores K
            self.k = self._argmax_k() if self.probe else self._spec_k()
        return min(self.k, cap)

    def _arm(self) -> str:
        """Which arm runs this cycle: both are measured first, then the faster, with probes of the other."""
        if self._arm_probe_left > 0:  # inside a probe of the other arm
            self._arm_probe_left -= 1
            self.probe = True
            return "spec" if self.arm == "plain" else "plain"
        if len(self.spec) < 2:
            return "spec"
        if len(self.plain) < self.plain_probe:
            return "plain"
        if self.arm is None:  # both measured once: speculation runs only if it proves faster
            self.arm = "spec" if self.spec.rate() > self.plain.rate() * (1 + self.burden()) else "plain"
        running, other = (self.spec, self.plain) if self.arm == "spec" else (self.plain, self.spec)
        faster = other.rate() > running.rate() * (1 + self.margin)  # the burden is at least the margin
        if faster and self.arm == "plain":  # the burden of proof, on evidence as fresh as the plain window's
            bar = self._plain_bar() * (1 + self.burden())
            faster = self._spec_fresh is not None and min(other.rate(), self._spec_fresh) > bar
        if faster:  # the landscape moved: look at the loser again soon
            self.arm = "plain" if self.arm == "spec" else "spec"
            self._arm_interval = self.probe_every
            self._arm_next = self.cycles + self.probe_every
        if self.cycles >= self._arm_next:
            self._arm_next = self.cycles + self._arm_interval
            # probes that keep losing back off, and never cost more than `budget` of the time: a probe
            # of n cycles of t_o seconds loses n t_o (1 - R_o / R_r), paid over `interval` cycles of t_r
            n = self.plain_probe if self.arm == "spec" else 1
            weight = max(other.seconds(), 1e-12) / max(running.seconds(), 1e-12)  # t_o / t_r
            loss = n * weight * max(0.0, 1.0 - other.rate() / max(running.rate(), 1e-12))
            # at most probe_max cycles apart while speculating; while decoding plainly, probe_max
            # probe-lengths of time (a speculative probe lasts several plain steps), and twice that
            # at half the budget when plain decoding copies nothing (no cache for the text to move)
            cap = self.probe_max if self.arm == "spec" else round(self.probe_max * max(1.0, weight))
            budget, free = self.budget, self.arm == "plain" and self.plain_copies_nothing
            if free:
                cap, budget = 2 * cap, budget / 2
            self._arm_interval = min(max(2 * self._arm_interval, round(loss / budget)), cap)
            self._arm_probe_left = (self.plain_probe if self.arm == "spec" else 1) - 1
            self.probe = True
            return "plain" if self.arm == "spec" else "spec"
        return self.arm

    def _spec_k(self) -> int:
        best = self._argmax_k()
        if best != self._best:  # the best K moved: look around it again soon
            self._best, self._k_interval = best, self.probe_every
            self._k_next = min(self._k_next, self.cycles + self.probe_every)
        if self.cycles >= self._k_next:
            self._k_next = self.cycles + self._k_interval
            self._k_interval = min(2 * self._k_interval, self.probe_max)
            self._side += 1
            around = [k for k in (best + 1, best - 1) if 1 <= k <= self.k_max]
            if around:
                self.probe = True
                return around[self._side % len(around)]
        return best
