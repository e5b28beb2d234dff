"""The engine's rate outside syncs by how many learners train beside it.

On one GPU the learners are CUDA contexts of their own. Without MPS the
GPU time-slices between contexts, so an engine step that shares the GPU
with a learner's forward and backward passes takes longer, even where the
GPU is far from busy. The per-adapter pause keeps the engine generating
while every learner trains; under the global pause a learner that trains
while another tenant syncs has the GPU to itself. So the per-adapter
engine may be slower outside syncs (2.5-14% in the GPU runs) only because
more learners train beside it, not because of anything it does itself.

That is testable from one run: outside every sync, cut the time by how
many learners are inside their update call, and take the engine's token
rate in each piece. If the overlap is the whole story, both modes' engines
run at the same rate at the same number of learners training (the
``0`` pieces above all), and the global mode's rates, weighted by another
mode's time at each number, predict that mode's rate outside syncs.

A mode's rate over the global's is then split into two factors whose
product it is: ``overlap_over_global``, what the global mode's rates
predict for this mode's mix of learners training (below 1.0x when it
trains beside the engine more), and ``own_pace``, its measured rate over
that prediction (below 1.0x when its engine is slower at the same
overlap). Ratios, not a share of the gap: a share is unstable when the
two rates are close (a 5 tok/s gap read as 1925% on an H100 at 94ac4e8).

The counter is read every 50 ms (:class:`EngineTokenCounter`) and a
learner's update takes hundreds of milliseconds on the GPU, so the pieces'
edges blur a little, the same in every mode.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from examples.rl.engine_rate import EngineTokenCounter, depth

#: per number of learners training (a string, as in the JSON): seconds, share, tok_s
RateByTraining = dict[str, dict[str, float]]


def rate_by_training(
    counter: EngineTokenCounter,
    outside: Sequence[tuple[float, float]],
    training: Sequence[tuple[float, float]],
) -> RateByTraining:
    """Over the ``outside`` windows, the engine's tokens/s and the share of
    the time with each number of ``training`` windows open at once."""
    seconds: dict[int, float] = defaultdict(float)
    tokens: dict[int, float] = defaultdict(float)
    for start, end in outside:
        for a, b, n in depth(training, start, end):
            seconds[n] += b - a
            tokens[n] += counter.tokens_between(a, b)
    total = sum(seconds.values())
    return {
        str(n): {
            "seconds": seconds[n],
            "share": seconds[n] / total,
            "tok_s": tokens[n] / seconds[n],
        }
        for n in sorted(seconds)
        if seconds[n] > 0
    }


def _pooled(modes: Mapping[str, Any], key: str) -> dict[str, dict[int, tuple[float, float]]]:
    """Per base mode (positions pooled), per number of learners training:
    (seconds, tokens)."""
    pooled: dict[str, dict[int, tuple[float, float]]] = {}
    for mode, data in modes.items():
        by_n = pooled.setdefault(mode.split("#")[0], {})
        for n, piece in (data.get(key) or {}).items():
            s, t = by_n.get(int(n), (0.0, 0.0))
            by_n[int(n)] = (s + piece["seconds"], t + piece["tok_s"] * piece["seconds"])
    return {base: by_n for base, by_n in pooled.items() if by_n}


def _rate(pieces: Mapping[int, tuple[float, float]]) -> float:
    seconds = sum(s for s, _ in pieces.values())
    return sum(t for _, t in pieces.values()) / seconds


def overlap_explains(
    modes: Mapping[str, Any], key: str = "engine_by_learners_training"
) -> dict[str, Any] | None:
    """Each mode's engine rate outside syncs against what the global mode's
    rates at each number of learners training predict for it; None without
    a global mode. A number the global mode never reached takes its rate
    at the nearest number it did. Positions of a mode are pooled."""
    pooled = _pooled(modes, key)
    if "global" not in pooled:
        return None
    reference = {n: t / s for n, (s, t) in pooled["global"].items()}
    global_rate = _rate(pooled["global"])
    found: dict[str, Any] = {}
    for base, pieces in pooled.items():
        seconds = sum(s for s, _ in pieces.values())
        measured = _rate(pieces)
        predicted = sum(s * reference[_nearest(reference, n)] for n, (s, _) in pieces.items())
        alone = pieces.get(0)
        found[base] = {
            "tok_s": measured,
            "by_learners_training": {str(n): t / s for n, (s, t) in sorted(pieces.items())},
            "mean_learners_training": sum(n * s for n, (s, _) in pieces.items()) / seconds,
            "predicted_tok_s": predicted / seconds,
            "over_global": measured / global_rate,
            "overlap_over_global": predicted / seconds / global_rate,
            "own_pace": measured / (predicted / seconds),
            "none_training_over_global": (
                alone[1] / alone[0] / reference[0] if alone and 0 in reference else None
            ),
        }
    return found


def _nearest(rates: Mapping[int, float], n: int) -> int:
    return min(rates, key=lambda k: (abs(k - n), k))


def overlap_lines(modes: Mapping[str, Any]) -> list[str]:
    """:func:`overlap_explains` in words."""
    found = overlap_explains(modes)
    if found is None:
        return []
    lines = []
    for base, data in found.items():
        rates = " / ".join(f"{n}: {r:.0f}" for n, r in data["by_learners_training"].items())
        line = (
            f"{base}: engine tok/s outside syncs {data['tok_s']:.0f}, by learners training "
            f"at once {rates} (mean {data['mean_learners_training']:.2f})"
        )
        if base != "global":
            alone = data["none_training_over_global"]
            line += (
                f"; {data['over_global']:.3f}x the global's = its overlap "
                f"{data['overlap_over_global']:.3f}x (the global mode's rates for its time "
                f"at each number) x its own pace {data['own_pace']:.3f}x"
                + ("" if alone is None else f"; with none training {alone:.3f}x the global's")
            )
        lines.append(line)
    return lines
