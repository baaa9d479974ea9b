"""The prefetch planner's scores: a decayed count per (layer, expert), decayed in O(1).

Every plain step decays each layer's scores once (and every cycle all of them): written out, that is
L E multiplications a token (Qwen3-30B-A3B: 48 x 128), where a step reads ~8 experts a layer (the
cost before and after: docs/RESULTS.md). A layer instead keeps raw values and a scale,

    score(e) = raw[e] * scale        decay by f: scale *= f        add w to e: raw[e] += w / scale

so decaying is one multiplication and adding touches only the experts used. Within a layer raw
values order as the scores do (one positive scale): rankings and comparisons inside a layer read
`raw[layer]` directly; a score compared across layers, or to an absolute amount, is `value`. When
a scale falls below TINY it is folded into its row (raw[e] *= scale, scale = 1), so raw values stay
below (added weight) / TINY, far inside a float's range.
"""
from __future__ import annotations


class Scores:
    TINY = 1e-100

    def __init__(self, layers: int, experts: int):
        self.raw = [[0.0] * experts for _ in range(layers)]  # [layer][expert]: score / scale[layer]
        self.scale = [1.0] * layers

    def __len__(self) -> int:
        return len(self.raw)

    def value(self, layer: int, e: int) -> float:
        return self.raw[layer][e] * self.scale[layer]

    def set(self, layer: int, e: int, v: float) -> None:
        self.raw[layer][e] = v / self.scale[layer]

    def add(self, layer: int, experts, w: float) -> None:
        """w added to each expert's score (an expert listed twice gains 2 w)."""
        row, inc = self.raw[layer], w / self.scale[layer]
        for e in experts:
            row[e] += inc

    def decay(self, layer: int, f: float) -> None:
        """Every score of `layer` times f (0 <= f <= 1)."""
        s = self.scale[layer] * f
        if s < self.TINY:  # fold it in (f = 0, or a long prompt's f ** tokens: every score 0, or nearly)
            row = self.raw[layer]
            row[:] = map(s.__mul__, row)
            s = 1.0
        self.scale[layer] = s

    def decay_all(self, f: float) -> None:
        for layer in range(len(self.raw)):
            self.decay(layer, f)

    def row(self, layer: int) -> list[float]:
        """The layer's scores, written out (O(E): for tests and reports, not a step's path)."""
        s = self.scale[layer]
        return [r * s for r in self.raw[layer]]
