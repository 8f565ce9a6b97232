"""The closed vocabularies of the inventory, shared by the models, the schemas and the queries."""

from __future__ import annotations

import enum


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
    """Where a site is; egress prices between and within continents depend on it."""

    north_america = "north_america"
    south_america = "south_america"
    europe = "europe"
    asia = "asia"
    oceania = "oceania"
    africa = "africa"


class NodeStatus(enum.StrEnum):
    pending = "pending"  # declared, its agent has not joined yet
    online = "online"
    offline = "offline"  # heartbeats stopped
    draining = "draining"  # finishes its current work, takes no new runs


class TrafficClass(enum.StrEnum):
    """How far a byte travels; seed 003, Table 1, prices egress by these classes."""

    intra_zone = "intra_zone"
    inter_zone = "inter_zone"
    inter_region = "inter_region"
    inter_continent = "inter_continent"
    to_oceania = "to_oceania"
    internet = "internet"


class TokenScope(enum.StrEnum):
    """What an API token may do; each scope includes the ones below it."""

    read = "read"  # read everything
    ci = "ci"  # read everything, create and cancel runs
    admin = "admin"  # everything

    @property
    def rank(self) -> int:
        return _SCOPE_RANK[self]

    def allows(self, needed: TokenScope) -> bool:
        return self.rank >= needed.rank


_SCOPE_RANK = {TokenScope.read: 0, TokenScope.ci: 1, TokenScope.admin: 2}
