"""Schemas of data sets (sharded samples that runs read; docs/datasets.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field, field_validator

from app.models.enums import Continent, Provider
from app.schemas.common import PublicSchema, Schema, ShortText
from hybridtrain.data_access import DATASET_NAME, STORE_URL, URL_MAX, check_dataset_url

DatasetName = Annotated[str, Field(min_length=1, max_length=128, pattern=DATASET_NAME.pattern)]


class DatasetCreate(Schema):
    """A data set registered by URL; the control plane reads its index.json to check it."""

    name: DatasetName
    url: Annotated[str, Field(max_length=URL_MAX)] = Field(
        description="the folder of index.json and the shards: s3://bucket/prefix, https://host/path, "
        "an absolute path that exists on the nodes, or store: for the files uploaded under this name"
    )
    store_provider: Provider = Field(default=Provider.onprem, description="who runs the store (prices its egress)")
    store_continent: Continent = Continent.north_america
    store_region: ShortText | None = None
    store_zone: ShortText | None = None

    @field_validator("url")
    @classmethod
    def _readable_scheme(cls, value: str) -> str:
        if value.startswith("store:") and value != STORE_URL:
            raise ValueError(f"{STORE_URL} names the files uploaded under the data set's name, and nothing more")
        return check_dataset_url(value)


class DatasetPublic(PublicSchema):
    id: int
    name: str
    url: str
    format: str
    size_bytes: int
    shards: int
    samples: int
    store_provider: Provider
    store_continent: Continent
    store_region: str | None
    store_zone: str | None
    created_by: str
    created_at: datetime


class DatasetFilePublic(PublicSchema):
    """A file uploaded into the control plane's store for a data set."""

    name: str
    bytes: int
    sha256: str
