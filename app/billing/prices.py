"""Prices as the bill sees them: the lookup protocol, money units, and an in-memory table.

The database layer implements `PriceLookup` over its dated price rows
(`app.queries.prices.price_in_force`); `StaticPriceTable` is the same contract in memory, for
tests and for seed data. Both answer "the price in force at time T": the row with the latest
effective time not after T; for egress, a continent-specific row before the any-continent one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from typing import Protocol, TypeVar

from app.billing.traffic import Continent, Provider, TrafficClass

# GCP's price list meters egress per GiB; the others write "GB". One unit for every provider keeps
# bills comparable, so a "$/GB" rate here is dollars per 2**30 bytes, everywhere.
BYTES_PER_GB = 2**30
SECONDS_PER_HOUR = 3600
# Bills are exact Decimals internally and each reported figure is rounded once, to a micro-dollar.
USD_QUANTUM = Decimal("0.000001")
# Enough digits that bytes / 2**30 * rate (at most ~30 significant digits) is exact.
_PRECISION = 60


@dataclass(frozen=True)
class EgressKey:
    """An egress price series: a provider's rate for one traffic class, from one continent.

    `scope=None` is the any-continent series, which applies where no row for the continent is.
    """

    provider: Provider
    traffic_class: TrafficClass
    scope: Continent | None = None

    def __str__(self) -> str:
        scope = f" ({self.scope.value})" if self.scope else ""
        return f"{self.provider.value} {self.traffic_class.value}{scope} egress"


@dataclass(frozen=True)
class InstanceKey:
    """What identifies an instance price: a provider's instance type, with its GPUs, in a region."""

    provider: Provider
    region: str | None
    instance_type: str
    gpu_model: str | None = None
    gpu_count: int = 1

    def __str__(self) -> str:
        gpus = f" with {self.gpu_count}x {self.gpu_model}" if self.gpu_model else ""
        return f"{self.provider.value} {self.instance_type}{gpus} in {self.region or 'no region'}"


@dataclass(frozen=True)
class InstancePrice:
    """An instance's $/h, spot and on-demand; None where the provider offers no such price."""

    spot_usd_per_hour: Decimal | None
    on_demand_usd_per_hour: Decimal | None

    def for_spot(self, spot: bool) -> Decimal | None:
        """The rate a node pays given its spot flag."""
        return self.spot_usd_per_hour if spot else self.on_demand_usd_per_hour


class PriceLookup(Protocol):
    """Prices in force at a given time; None where no price was in force then."""

    def egress_usd_per_gb(self, key: EgressKey, at: datetime) -> Decimal | None:
        """The sender's $/GB (2**30 bytes) at `at`: `key`'s series, else its any-continent one."""
        ...

    def instance_price(self, key: InstanceKey, at: datetime) -> InstancePrice | None:
        """The spot and on-demand $/h of this instance type at time `at`."""
        ...


def egress_usd(n_bytes: int, usd_per_gb: Decimal) -> Decimal:
    """The exact (unrounded) dollars for `n_bytes` at `usd_per_gb`: the one egress formula."""
    with localcontext(prec=_PRECISION):
        return Decimal(n_bytes) * usd_per_gb / BYTES_PER_GB


def compute_usd(seconds: float, usd_per_hour: Decimal) -> Decimal:
    """The exact (unrounded) dollars for `seconds` of a machine at `usd_per_hour`."""
    with localcontext(prec=_PRECISION):
        # str() keeps the float's shortest decimal form rather than its binary expansion.
        return Decimal(str(seconds)) * usd_per_hour / SECONDS_PER_HOUR


def round_usd(amount: Decimal) -> Decimal:
    """`amount` rounded half-even to a micro-dollar, the precision every bill figure carries."""
    return amount.quantize(USD_QUANTUM, rounding=ROUND_HALF_EVEN)


_T = TypeVar("_T")


class StaticPriceTable:
    """An in-memory `PriceLookup` over dated rows: the latest row effective at or before T wins."""

    def __init__(
        self,
        egress: Iterable[tuple[EgressKey, datetime, Decimal]] = (),
        instances: Iterable[tuple[InstanceKey, datetime, InstancePrice]] = (),
    ) -> None:
        self._egress: dict[EgressKey, list[tuple[datetime, Decimal]]] = {}
        self._instances: dict[InstanceKey, list[tuple[datetime, InstancePrice]]] = {}
        for key, since, rate in egress:
            self._egress.setdefault(key, []).append((_aware(since), Decimal(rate)))
        for ikey, since, price in instances:
            self._instances.setdefault(ikey, []).append((_aware(since), price))
        for rows in (*self._egress.values(), *self._instances.values()):
            rows.sort(key=lambda row: row[0])

    def egress_usd_per_gb(self, key: EgressKey, at: datetime) -> Decimal | None:
        """The rate for `key` in force at `at`, falling back to the any-continent series."""
        at = _aware(at)
        rate = _in_force(self._egress.get(key, []), at)
        if rate is None and key.scope is not None:
            any_continent = EgressKey(key.provider, key.traffic_class)
            rate = _in_force(self._egress.get(any_continent, []), at)
        return rate

    def instance_price(self, key: InstanceKey, at: datetime) -> InstancePrice | None:
        """The instance price for `key` in force at `at`."""
        return _in_force(self._instances.get(key, []), _aware(at))


def _in_force(rows: list[tuple[datetime, _T]], at: datetime) -> _T | None:
    current = None
    for since, value in rows:
        if since > at:
            break
        current = value
    return current


def _aware(when: datetime) -> datetime:
    # Comparing naive and aware times raises deep inside a lookup; refuse them at the door.
    if when.tzinfo is None:
        raise ValueError(f"naive datetime {when!r}: prices are dated with timezone-aware times")
    return when
