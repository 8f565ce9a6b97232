"""The optimizer's explanation of its choice, as prose: what the chosen plan changes against the
plan on every candidate, where the server went and what the next place would give, what the data
sets' reads cost (`app.perfmodel.optimize` computes the plans; this only words them)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from app.billing import BYTES_PER_GB

if TYPE_CHECKING:
    from app.perfmodel.optimize import PlanChoice


def _names(p: PlanChoice, ids: Sequence[int]) -> str:
    names = p.prediction.node_names
    return ", ".join(names.get(i, str(i)) for i in ids)


def describe(p: PlanChoice) -> str:
    """A plan in a phrase: strategy, nodes and where the server goes."""
    where = f" with the server on {p.prediction.node_names[p.server_node_id]}" if p.server_node_id is not None else ""
    return f"{p.strategy} on {_names(p, p.node_ids)}{where}"


def _g(p: PlanChoice) -> str:
    g = p.prediction.granularity
    return "unbounded" if g is None else f"{g:.1f}"


def _change(before: float, after: float, *, unit: str) -> str:
    if before == after or not (math.isfinite(before) and math.isfinite(after)) or before == 0:
        return f"keeps {unit} at {after:.3g}"
    pct = abs(after - before) / before * 100
    verb = "raises" if after > before else "lowers"
    return f"{verb} {unit} by {pct:.0f}% ({before:.3g} -> {after:.3g})"


def _two(a: float, b: float) -> tuple[str, str] | None:
    """`a` and `b` with 3 significant digits, or as many more (up to 6) as tell them apart;
    None when 6 do not."""
    for digits in range(3, 7):
        x, y = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if x != y:
            return x, y
    return None


def _gb(n: float) -> str:
    return f"{n / BYTES_PER_GB:.3g} GB"


def _data_sentence(best: PlanChoice, baseline: PlanChoice | None) -> str:
    """What the data sets' reads cost on `best`, by traffic class, and on the baseline's nodes
    where that differs."""
    by_class: dict[str, int] = {}
    for r in best.reads.reads:
        by_class[r.traffic_class] = by_class.get(r.traffic_class, 0) + r.bytes
    classes = ", ".join(f"{_gb(b)} {c.replace('_', '-')}" for c, b in by_class.items())
    out = f"Reading the data sets costs ${best.costs.data_usd:.3g} over the run here ({classes})"
    if baseline is not None and baseline.node_ids != best.node_ids \
            and abs(baseline.costs.data_usd - best.costs.data_usd) > 5e-7:
        out += f", against ${baseline.costs.data_usd:.3g} on every candidate"
    return out + "."


def explain(best: PlanChoice, baseline: PlanChoice | None, goal: str, *, next_server: PlanChoice | None,
            ruled_out: str = "") -> str:
    """Why `best` for `goal`, in numbers a person can check: against `baseline` (the best plan on
    every candidate; `ruled_out` says which limit it broke), `next_server` (the best plan with
    the server elsewhere) and what the data sets' reads cost."""
    parts = []
    by_cost = goal == "cost"

    def cost_phrase(a: PlanChoice, b: PlanChoice) -> str:
        return _change(a.usd_per_million, b.usd_per_million, unit="$/1M samples")

    def speed_phrase(a: PlanChoice, b: PlanChoice) -> str:
        return _change(a.prediction.samples_per_s, b.prediction.samples_per_s, unit="samples/s")

    main = cost_phrase if by_cost else speed_phrase
    other = speed_phrase if by_cost else cost_phrase
    if baseline is None:
        parts.append(f"{describe(best)} is the best plan for {goal} "
                     f"(the global batch is too small to use every candidate).")
    elif baseline is best:
        parts.append(f"{describe(best)}: every candidate is worth using "
                     f"(granularity {_g(best)}, ${best.usd_per_million:.3g}/1M samples, "
                     f"{best.prediction.samples_per_s:.3g} samples/s).")
    else:
        left = [i for i in baseline.node_ids if i not in best.node_ids]
        change = []
        if left:
            change.append(f"leaving out {_names(baseline, left)}")
        if best.strategy != baseline.strategy:
            change.append(f"running {best.strategy} instead of {baseline.strategy}")
        if best.server_node_id != baseline.server_node_id and best.server_node_id is not None \
                and baseline.server_node_id is not None:
            change.append(f"moving the server from {baseline.prediction.node_names[baseline.server_node_id]} "
                          f"to {best.prediction.node_names[best.server_node_id]}")
        what = " and ".join(change) or "this plan"
        why = f" ({ruled_out})" if ruled_out else ""
        parts.append(f"Compared with {describe(baseline)}{why}, {what} changes granularity from {_g(baseline)} "
                     f"to {_g(best)}, {main(baseline, best)} and {other(baseline, best)}.")
    if next_server is not None and best.server_node_id is not None:
        alt = next_server
        here = best.prediction.node_names[best.server_node_id]
        there = alt.prediction.node_names[alt.server_node_id]
        if by_cost:
            pair, unit, sign = _two(alt.usd_per_million, best.usd_per_million), "per 1M samples", "$"
            same = f"${best.usd_per_million:.3g}"
        else:
            pair, unit, sign = _two(alt.prediction.samples_per_s, best.prediction.samples_per_s), "samples/s", ""
            same = f"{best.prediction.samples_per_s:.3g}"
        metric = (f"{sign}{pair[0]} rather than {sign}{pair[1]} {unit}" if pair
                  else f"the same {same} {unit} (a tie, broken by the other goal, then by order)")
        parts.append(f"The server goes on {here}: on {there}, the next best place, it would give {metric}, "
                     f"with egress at ${alt.costs.egress_usd_per_h:.3g}/h rather than "
                     f"${best.costs.egress_usd_per_h:.3g}/h.")
    if best.reads.reads:
        parts.append(_data_sentence(best, baseline))
    if best.costs.unpriced:
        parts.append(f"No price is in force for {'; '.join(best.costs.unpriced)}: counted as $0.")
    return " ".join(parts)
