"""Cost accounting without a database: traffic classes, price lookups and a run's bill.

The database layer supplies a `PriceLookup` and plain `RunUsage`; nothing here imports
SQLAlchemy. See docs/costs.md for the rules and the decisions behind them.
"""

from app.billing.bill import (
    Bill,
    Granularity,
    LinkBytes,
    LinkCost,
    NodeCost,
    NodeUsage,
    PricingBasis,
    RunUsage,
    StoreRead,
    WorkerTime,
    compute_bill,
    granularity,
    price_reads,
)
from app.billing.errors import InvalidUsageError, PriceNotFoundError
from app.billing.membership import MEMBERSHIP_KINDS, MembershipChange, rank_spans, union_seconds
from app.billing.prices import (
    BYTES_PER_GB,
    USD_QUANTUM,
    EgressKey,
    InstanceKey,
    InstancePrice,
    PriceLookup,
    StaticPriceTable,
    compute_usd,
    egress_usd,
    round_usd,
)
from app.billing.traffic import (
    Continent,
    Provider,
    Route,
    Site,
    SiteKind,
    TrafficClass,
    classify,
)

__all__ = [
    "BYTES_PER_GB",
    "USD_QUANTUM",
    "Bill",
    "Continent",
    "EgressKey",
    "Granularity",
    "InstanceKey",
    "InstancePrice",
    "InvalidUsageError",
    "LinkBytes",
    "LinkCost",
    "MEMBERSHIP_KINDS",
    "MembershipChange",
    "NodeCost",
    "NodeUsage",
    "PriceLookup",
    "PriceNotFoundError",
    "PricingBasis",
    "Provider",
    "Route",
    "RunUsage",
    "Site",
    "SiteKind",
    "StaticPriceTable",
    "StoreRead",
    "TrafficClass",
    "WorkerTime",
    "classify",
    "compute_bill",
    "compute_usd",
    "egress_usd",
    "granularity",
    "price_reads",
    "rank_spans",
    "round_usd",
    "union_seconds",
]
