"""Prices in force at a given instant, as `app.billing.PriceLookup`s over the price tables.

`DbPriceLookup` asks the database for the version in force at one instant, and
`CachedPriceLookup` remembers its answers per key and instant (the optimizer prices the same few
nodes and links across thousands of plans). Billing a list of runs asks at every run's own
start, so those queries grew with the runs: `PriceHistoryLookup` reads each series (an instance
type with its GPUs in a region, a provider's egress class from a continent) once, all its
versions, and answers every instant from them.
"""

from __future__ import annotations

import bisect
from datetime import datetime
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.billing import EgressKey, InstanceKey, InstancePrice, PriceLookup
from app.models import EgressPrice, GpuModel
from app.models import InstancePrice as InstancePriceRow
from app.queries.prices import EgressKey as EgressSeries
from app.queries.prices import egress_price_in_force


class CachedPriceLookup:
    """A `PriceLookup` that asks `inner` once per key and instant: the optimizer prices the same
    few nodes and links across thousands of plans."""

    def __init__(self, inner: PriceLookup) -> None:
        self.inner = inner
        self._egress: dict[tuple[EgressKey, datetime], Decimal | None] = {}
        self._instance: dict[tuple[InstanceKey, datetime], InstancePrice | None] = {}

    def egress_usd_per_gb(self, key: EgressKey, at: datetime) -> Decimal | None:
        """The inner lookup's answer, remembered."""
        if (key, at) not in self._egress:
            self._egress[(key, at)] = self.inner.egress_usd_per_gb(key, at)
        return self._egress[(key, at)]

    def instance_price(self, key: InstanceKey, at: datetime) -> InstancePrice | None:
        """The inner lookup's answer, remembered."""
        if (key, at) not in self._instance:
            self._instance[(key, at)] = self.inner.instance_price(key, at)
        return self._instance[(key, at)]


class DbPriceLookup:
    """`app.billing.PriceLookup` over the price tables: the versions in force at a given time."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def egress_usd_per_gb(self, key: EgressKey, at: datetime) -> Decimal | None:
        """The sender's $/GB in force at `at` (its continent's row, else the any-continent row)."""
        series = EgressSeries(key.provider.value, key.traffic_class.value, key.scope)  # type: ignore[arg-type]
        row: EgressPrice | None = egress_price_in_force(self.session, key=series, at=at)
        return None if row is None else Decimal(str(row.usd_per_gb))

    def instance_price(self, key: InstanceKey, at: datetime) -> InstancePrice | None:
        """The spot and on-demand $/h in force at `at` for this instance type and its GPUs."""
        stmt = (
            select(InstancePriceRow)
            .where(
                InstancePriceRow.provider == key.provider.value,
                InstancePriceRow.instance_type == key.instance_type,
                InstancePriceRow.region.is_not_distinct_from(key.region),
                InstancePriceRow.effective_from <= at,
            )
            .order_by(InstancePriceRow.effective_from.desc())
            .limit(1)
        )
        if key.gpu_model is not None:
            stmt = stmt.join(GpuModel, GpuModel.id == InstancePriceRow.gpu_model_id).where(
                GpuModel.name == key.gpu_model, InstancePriceRow.gpu_count == key.gpu_count
            )
        row = self.session.scalar(stmt)
        if row is None:
            return None
        spot = None if row.spot_usd_per_h is None else Decimal(str(row.spot_usd_per_h))
        return InstancePrice(spot, Decimal(str(row.on_demand_usd_per_h)))



# Versions of one series, oldest first: when each took effect, and what it said.
_Versions = tuple[list[datetime], list[object]]


def _in_force(versions: _Versions, at: datetime) -> object | None:
    starts, values = versions
    i = bisect.bisect_right(starts, at)
    return values[i - 1] if i else None


class PriceHistoryLookup:
    """`app.billing.PriceLookup` answering any instant from each series' versions, read once a series."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._egress: dict[tuple[str, str, str | None], _Versions] = {}
        self._instance: dict[InstanceKey, _Versions] = {}

    def egress_usd_per_gb(self, key: EgressKey, at: datetime) -> Decimal | None:
        """The sender's $/GB in force at `at`: its continent's series, else the any-continent one."""
        scopes = [key.scope.value, None] if key.scope is not None else [None]
        for scope in scopes:
            usd = _in_force(self._egress_series(key.provider.value, key.traffic_class.value, scope), at)
            if usd is not None:
                return usd  # type: ignore[return-value]
        return None

    def instance_price(self, key: InstanceKey, at: datetime) -> InstancePrice | None:
        """The spot and on-demand $/h in force at `at` for this instance type and its GPUs."""
        return _in_force(self._instance_series(key), at)  # type: ignore[return-value]

    def _egress_series(self, provider: str, traffic_class: str, continent: str | None) -> _Versions:
        name = (provider, traffic_class, continent)
        if name not in self._egress:
            rows = self.session.execute(
                select(EgressPrice.effective_from, EgressPrice.usd_per_gb)
                .where(EgressPrice.provider == provider, EgressPrice.traffic_class == traffic_class,
                       EgressPrice.continent.is_not_distinct_from(continent))
                .order_by(EgressPrice.effective_from)
            ).all()
            self._egress[name] = ([r[0] for r in rows], [Decimal(str(r[1])) for r in rows])
        return self._egress[name]

    def _instance_series(self, key: InstanceKey) -> _Versions:
        if key not in self._instance:
            stmt = (
                select(InstancePriceRow.effective_from, InstancePriceRow.spot_usd_per_h,
                       InstancePriceRow.on_demand_usd_per_h)
                .where(
                    InstancePriceRow.provider == key.provider.value,
                    InstancePriceRow.instance_type == key.instance_type,
                    InstancePriceRow.region.is_not_distinct_from(key.region),
                )
                .order_by(InstancePriceRow.effective_from)
            )
            if key.gpu_model is not None:
                stmt = stmt.join(GpuModel, GpuModel.id == InstancePriceRow.gpu_model_id).where(
                    GpuModel.name == key.gpu_model, InstancePriceRow.gpu_count == key.gpu_count
                )
            rows = self.session.execute(stmt).all()
            self._instance[key] = (
                [r[0] for r in rows],
                [InstancePrice(None if r[1] is None else Decimal(str(r[1])), Decimal(str(r[2]))) for r in rows],
            )
        return self._instance[key]
