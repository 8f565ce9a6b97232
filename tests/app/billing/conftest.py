"""Fixtures for the billing tests: a site factory and Table 1 as a price table."""

from __future__ import annotations

from collections.abc import Callable
import pytest

from app.billing import Continent, Provider, Site, SiteKind, StaticPriceTable
from app.billing.table1 import table1_price_table

SiteFactory = Callable[..., Site]


@pytest.fixture
def site() -> SiteFactory:
    """Build a site: `site("gcp", "us-west1", "a", "north_america")`; the name follows the place."""

    def make(
        provider: str,
        region: str | None,
        zone: str | None,
        continent: str,
        name: str | None = None,
    ) -> Site:
        kind = SiteKind.onprem if provider == Provider.onprem else SiteKind.cloud
        return Site(
            name=name or f"{provider}/{region}/{zone}",
            kind=kind,
            provider=Provider(provider),
            continent=Continent(continent),
            region=region,
            zone=zone,
        )

    return make


@pytest.fixture
def table1() -> StaticPriceTable:
    """Table 1 and the implied rows, with the T4 instances priced in the regions the tests use."""
    return table1_price_table(
        {
            Provider.gcp: [
                "us-central1",
                "us-west1",
                "europe-west1",
                "australia-southeast1",
            ],
            Provider.aws: ["us-west-2", "us-east-1"],
            Provider.azure: ["southcentralus"],
        }
    )
