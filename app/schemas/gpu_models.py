"""Schemas of the GPU catalog."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from app.schemas.common import LongText, Positive, PublicSchema, Schema, ShortText, TinyText


class GpuModelCreate(Schema):
    name: ShortText
    vendor: TinyText = "NVIDIA"
    form_factor: TinyText | None = None
    memory_gb: Positive
    fp32_tflops: Positive = Field(description="peak non-tensor FP32 TFLOPS")
    fp16_tflops: Positive = Field(
        description="peak tensor-core FP16 TFLOPS, dense (no sparsity), FP32 accumulate"
    )
    source: LongText = ""


class GpuModelUpdate(Schema):
    name: ShortText | None = None
    vendor: TinyText | None = None
    form_factor: TinyText | None = None
    memory_gb: Positive | None = None
    fp32_tflops: Positive | None = None
    fp16_tflops: Positive | None = None
    source: LongText | None = None


class GpuModelPublic(PublicSchema):
    id: int
    name: str
    vendor: str
    form_factor: str | None
    memory_gb: float
    fp32_tflops: float
    fp16_tflops: float
    source: str
    seeded: bool
    created_at: datetime
    updated_at: datetime
