"""The benchmark table: one row per figure, median with its min-max beside it."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.stats import Spread

#: measure, result (median), min-max, target, detail
Row = tuple[str, str, str, str, str]

HEADER = (
    "| measure | result (median) | min-max | target | detail |\n| --- | --- | --- | --- | --- |"
)


def spread_row(measure: str, spread: Spread, spec: str, unit: str, target: str, detail: str) -> Row:
    result, span = spread.fmt(spec, unit)
    return (measure, result, span, target, detail)


def table(rows: Sequence[Row]) -> str:
    return "\n".join([HEADER, *("| " + " | ".join(row) + " |" for row in rows)])
