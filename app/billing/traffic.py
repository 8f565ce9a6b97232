"""Which egress price applies to a byte sent from one site to another: the traffic-class rules.

Seed 003, Table 1, prices a provider's egress by how far a byte travels. Every rule that turns
two sites into a priced traffic class lives in `classify` below; docs/costs.md states the same
rules in prose, with the table.

The vocabularies (`SiteKind`, `Provider`, `Continent`, `TrafficClass`) carry the same string
values as `app.models.enums`, so a stored site converts by value; they are redefined here
because this package must stay importable without SQLAlchemy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SiteKind(enum.StrEnum):
    onprem = "onprem"
    cloud = "cloud"


class Provider(enum.StrEnum):
    onprem = "onprem"
    gcp = "gcp"
    aws = "aws"
    azure = "azure"
    lambda_ = "lambda"
    other = "other"


class Continent(enum.StrEnum):
    """Where a site is; Table 1 calls these US, EU, ASIA and OCE (see `TABLE1_CONTINENT_NAMES`)."""

    north_america = "north_america"
    south_america = "south_america"
    europe = "europe"
    asia = "asia"
    oceania = "oceania"
    africa = "africa"


# Table 1's row labels for the continents it prices ("Traffic (inter-region) US", ...).
TABLE1_CONTINENT_NAMES: dict[Continent, str] = {
    Continent.north_america: "US",
    Continent.europe: "EU",
    Continent.asia: "ASIA",
    Continent.oceania: "OCE",
}


class TrafficClass(enum.StrEnum):
    """How far a byte travels, from the nearest (cheapest) to a different network altogether."""

    intra_zone = "intra_zone"
    inter_zone = "inter_zone"
    inter_region = "inter_region"
    inter_continent = "inter_continent"
    to_oceania = "to_oceania"
    internet = "internet"


# Providers whose sites share one private network, so geography decides the price. "other" is
# not one provider but any of many, and on-prem rooms reach each other over the internet.
_CLOUD_NETWORKS = frozenset({Provider.gcp, Provider.aws, Provider.azure, Provider.lambda_})


@dataclass(frozen=True)
class Site:
    """Where a node lives; two `Site` values are the same site exactly when they are equal."""

    name: str
    kind: SiteKind
    provider: Provider
    continent: Continent
    region: str | None = None
    zone: str | None = None

    def __post_init__(self) -> None:
        # Accept plain strings and app.models.enums members alike: they share values.
        object.__setattr__(self, "kind", SiteKind(self.kind))
        object.__setattr__(self, "provider", Provider(self.provider))
        object.__setattr__(self, "continent", Continent(self.continent))
        if (self.kind is SiteKind.onprem) != (self.provider is Provider.onprem):
            raise ValueError(
                f"site {self.name!r}: kind={self.kind.value!r} does not fit "
                f"provider={self.provider.value!r} (on-prem sites, and only they, use 'onprem')"
            )


@dataclass(frozen=True)
class Route:
    """The priced class of a byte from one site to another, and who pays for it.

    `scope` is the sender's continent. For `inter_region` it is also the receiver's, and picks
    Table 1's per-continent row; for the other classes it lets a provider price traffic by where
    it leaves from, and lookups fall back to the any-continent row (see `PriceLookup`). `payer`
    is the sending cloud provider, or None when the sender is on-prem: traffic out of on-prem and
    into a cloud is free.
    """

    traffic_class: TrafficClass
    scope: Continent | None
    payer: Provider | None


def classify(src: Site, dst: Site) -> Route:
    """The traffic class of a byte sent from `src` to `dst`, its price scope and its payer.

    1. The same site, or one cloud provider's same region and zone: intra_zone.
    2. Different providers, cloud and on-prem, two on-prem rooms, or "other" clouds: internet.
    3. Within one provider's network: same region, other zone: inter_zone.
    4. Other region, same continent: inter_region.
    5. Other continent, with Oceania at either end: to_oceania (Table 1's "ANY-OCE").
    6. Any other pair of continents: inter_continent.

    The scope is always the sender's continent. An unknown (None) region or zone never matches
    anything, so it prices as farther away.
    """
    return Route(_traffic_class(src, dst), src.continent, _payer(src))


def _traffic_class(src: Site, dst: Site) -> TrafficClass:
    if src == dst:
        return TrafficClass.intra_zone
    if src.provider != dst.provider or src.provider not in _CLOUD_NETWORKS:
        return TrafficClass.internet
    if _same(src.region, dst.region):
        return TrafficClass.intra_zone if _same(src.zone, dst.zone) else TrafficClass.inter_zone
    if src.continent is dst.continent:
        return TrafficClass.inter_region
    # The paper bills its Australian VMs' traffic at the Oceania rate in both directions ("three
    # regions share their gradients with AUS and vice versa", Section 5 (3)), as GCP does.
    if Continent.oceania in (src.continent, dst.continent):
        return TrafficClass.to_oceania
    return TrafficClass.inter_continent


def _payer(src: Site) -> Provider | None:
    # Only a cloud sender is billed: ingress is free and an on-prem uplink is not metered.
    return None if src.provider is Provider.onprem else src.provider


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and a.casefold() == b.casefold()
