"""Where a plan's inputs come from, in words: each node's profile (its rate, noise, age and
source: the profiler or a run's measured steps) and each link, for the CLI and the launch form."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def age_text(seconds: float | None) -> str:
    """`42 s ago`, `5 min ago`, `1.5 h ago`, `3 days ago`."""
    if seconds is None:
        return "at an unknown time"
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def since_s(iso: str | None, now: datetime) -> float | None:
    """Seconds from an ISO time to `now` (None without one)."""
    if not iso:
        return None
    when = datetime.fromisoformat(iso)
    when = when if when.tzinfo is not None else when.replace(tzinfo=UTC)
    return max(0.0, (now - when).total_seconds())


def noise_text(spread: float | None, repeats: int | None, *, unit: str = "runs") -> str:
    """`±2.5 % (spread 5.0 % over 3 runs)`, or that the noise is unknown."""
    if spread is None:
        return "noise unknown (one run)"
    runs = f" over {repeats} {unit}" if repeats else ""
    return f"±{100 * spread / 2:.1f} % (spread {100 * spread:.1f} %{runs})"


def _origin(given: dict[str, Any]) -> str:
    if given.get("source") == "run":
        return f"by run {given.get('run_id')}'s steps"
    return f"by the profiler (profile {given['profile_id']})"


def input_lines(plan: dict[str, Any], *, now: datetime | None = None) -> list[str]:
    """One line per input of `plan` (a plan's JSON): its nodes' profiles, then its links."""
    now = now or datetime.now(UTC)
    lines = []
    for given in plan.get("inputs") or []:
        rate = given.get("samples_per_s")
        name = given.get("node_name") or f"node {given['node_id']}"
        unit = "steps" if given.get("source") == "run" else "runs"
        lines.append(
            f"profile of {name} (id {given['node_id']}): {'n/a' if rate is None else f'{rate:.1f}'} samples/s "
            f"{noise_text(given.get('spread'), given.get('repeats'), unit=unit)}, measured "
            f"{age_text(given.get('age_s'))} {_origin(given)}"
        )
    seen = set()
    for link in (plan.get("prediction") or {}).get("links") or []:
        key = (link["src_node_id"], link["dst_node_id"])
        if key in seen:
            continue
        seen.add(key)
        source = link.get("source") or "assumed"
        if source == "measured":
            source = f"measured {age_text(since_s(link.get('measured_at'), now))}"
        lines.append(f"link {key[0]} -> {key[1]}: {link['mbps']:.0f} Mbit/s, {link['rtt_ms']:.1f} ms ({source})")
    return lines
