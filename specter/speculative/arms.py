"""K = 0's two pairs of arms (`PlainArms`): plain steps with or without next-layer guesses, and with the host lane
for some misses or copying every one. The governor (governor.py) decides K; once it runs K = 0, these decide how.

Why an estimator and not a moving average: a plain step's time follows its misses, and those swing from step to
step (a step that misses nothing reads 0.2x the mean, a text's first step 2-3x). A single probe read that way
put an arm 5% slower to work for hundreds of steps when one reading replaced its figure, so the probes' readings
average as ratios to the running arm's rate, and the arms change places only when the average is clear of the
noise (docs/RESULTS.md, "Issue 23: plain-step arms that average").
"""
from __future__ import annotations

import math


class PlainArms:
    """K = 0's two ways: without or with next-layer guesses (True), or with the host lane or copying every miss
    (True, rated per miss); True must prove faster by `margin`. The best runs, the other is probed. A step's time
    swings with its misses (0.2x to 3x the mean), so no one reading decides: a probe reads as a ratio to the best's
    recent rate (its last `recent` units) and the ratios average, units-weighted and halving every `half_life`
    steps (a drift of the text cancels out). The arms change places on a reading of the taker whose average wins
    by `z` standard errors (per-unit spread `spread`, a prior worth `prior` units), probed next `probe_every`
    steps later. Else the next probe comes `probe_min` steps on, or as far as keeps its excess (shrunk to even
    by `shrink` units) within `budget`; once the taker is surely slower, at doubling intervals (up to
    `probe_max`). An arm's first reading counts until its second."""

    def __init__(self, probe_every: int = 8, probe_max: int = 1024, budget: float = 0.01, margin: float = 0.03,
                 recent: float = 32.0, half_life: float = 512.0, z: float = 2.0, spread: float = 0.5,
                 prior: float = 4.0, shrink: float = 16.0, probe_min: int = 2):
        self.t = {True: None, False: None}  # seconds a unit: the best's recent rate, the taker's by its ratio
        self.probe_every, self.probe_min, self.probe_max, self.budget = probe_every, probe_min, probe_max, budget
        self.margin, self.recent, self.half_life, self.z = margin, recent, half_life, z
        self.spread, self.prior, self.shrink = spread, prior, shrink
        self.n, self.best, self.interval, self.next = 0, None, probe_every, probe_every  # n: steps so far
        self.ratio, self.sq, self.weight = 1.0, 1.0, 0.0  # the taker's time over the best's: mean, mean square, units
        self.held = 0.0  # the units behind the best's rate (0: a first reading, replaced by the next)
        self.probing = False  # the last pick measures an arm other than the best one

    def pick(self) -> bool:
        self.n += 1
        for arm in (False, True):
            if self.t[arm] is None:
                self.probing = arm  # without next-layer is the baseline, measured first
                return arm
        self.probing = self.n >= self.next
        if self.probing:  # observe sets the next one by what the probes measured
            self.next = self.n + self.interval
        return self.best != self.probing

    def observe(self, arm: bool, step_s: float, steps: int = 1, misses: int | None = None) -> None:
        """`steps` steps of `arm` took step_s each on average (pick counted the first); `misses`: theirs (the
        lanes act on misses only), rated as seconds a miss: a run without any says nothing."""
        self.n += steps - 1
        units = steps
        if misses is not None:
            if misses <= 0:  # nothing to rate: a probe backs off as if the taker were surely slower, and so
                if self.best is None or arm != self.best:  # does a first reading (else its runs end at `next`)
                    self.interval = min(2 * self.interval, self.probe_max)
                    self.next = self.n + self.interval
                return
            step_s, units = step_s * steps / misses, misses
        t, self.weight = self.t, self.weight * 0.5 ** (steps / self.half_life)
        if self.best is None:  # an arm's first reading; with both, the baseline is best, the other's seeds the ratio
            t[arm] = step_s
            if t[not arm] is None:
                return
            self.best, self.ratio, self.sq, self.weight = False, t[True] / t[False], 0.0, 0.0
        elif arm == self.best:  # its recent rate
            self.held += units
            t[arm] += max(1 - 0.5 ** (units / self.recent), units / self.held) * (step_s - t[arm])
        else:
            r, w = step_s / t[self.best], self.weight
            self.ratio, self.sq = ((x * w + y * units) / (w + units) for x, y in ((self.ratio, r), (self.sq, r * r)))
            self.weight = w + units
            gap = self.ratio * (1 + self.margin) - 1 if self.best is False else self.ratio - 1 - self.margin
            var = (self.spread ** 2 * self.prior + max(self.sq - self.ratio ** 2, 0.0) * w) / (self.prior + w)
            noise = self.z * math.sqrt(var / self.weight)  # z standard errors of the average
            if gap <= -noise:  # the taker wins: the arms change places
                self.best, self.ratio, self.sq, self.held = not self.best, 1 / self.ratio, self.sq / self.ratio ** 4, w
                self.interval, self.next = self.probe_every, self.n + self.probe_every
            else:  # surely slower: doubling intervals; else often, within the budget
                excess = (self.ratio - 1) * self.weight / (self.weight + self.shrink)
                floor = 2 * self.interval if gap >= noise else self.probe_min
                self.interval = min(max(floor, round(excess / self.budget)), self.probe_max)
                self.next = self.n + self.interval
        t[not self.best] = t[self.best] * self.ratio
