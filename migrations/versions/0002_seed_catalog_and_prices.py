"""Seed the GPU catalog (NVIDIA datasheets) and the prices of seed 003, Table 1 (April 2023).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 02:45:00

The data is written out here, not imported from the application, so this revision inserts the
same rows forever. Every row names its source; seeded rows are marked `seeded = true`.

GPU figures are peak, per GPU, at boost clock:
- `fp32_tflops`: non-tensor FP32.
- `fp16_tflops`: tensor-core FP16, *dense* (datasheets often print the 2:4-sparsity figure,
  twice as large; it is halved here) with FP32 accumulate, the rate mixed-precision training
  uses. GeForce cards run FP32 accumulate at half their FP16-accumulate rate; their row says so.

Prices: seed 003 (Erben, Mayer, Jacobsen, "How Can We Train Deep Learning Models Across Clouds
and Continents?", PVLDB 17(6), 2024), Table 1, "Average us-west cloud pricing in April '23",
T4 VMs with 8 CPU cores. Its rows map to (traffic_class, continent) as follows:

    Traffic (inter-zone)              -> inter_zone,      continent NULL (any)
    Traffic (inter-region) US         -> inter_region,    north_america
    Traffic (inter-region) EU         -> inter_region,    europe
    Traffic (inter-region) ASIA       -> inter_region,    asia
    Traffic (inter-region) OCE        -> inter_region,    oceania
    Traffic ANY-OCE                   -> to_oceania,      continent NULL (from anywhere)
    Traffic (between continents)      -> inter_continent, continent NULL (any)

Table 1 has no intra-zone or internet rows: intra_zone is seeded at 0 $/GB (all three providers
charge nothing within a zone) and internet egress from each provider's public list price (first
tier, to North America), which is *not* from the paper.
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PAPER_DATE = datetime(2023, 4, 1, tzinfo=UTC)
PAPER = "seed 003 (Erben et al., PVLDB 17(6) 2024), Table 1: average us-west pricing, April 2023"

_V100 = (
    "NVIDIA V100 Tensor Core GPU datasheet (volta-v100-datasheet-update-us-1165301-r5), "
    "https://images.nvidia.com/content/technologies/volta/pdf/"
    "volta-v100-datasheet-update-us-1165301-r5.pdf"
)
_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf; 312 TFLOPS FP16 tensor is the dense "
    "figure (624 with sparsity); SXM4 and PCIe share these peaks"
)
_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet, "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_GA102 = (
    "NVIDIA Ampere GA102 GPU Architecture whitepaper v2, Appendix A (GeForce RTX 3090), "
    "https://images.nvidia.com/aem-dam/en-zz/Solutions/geforce/ampere/pdf/"
    "NVIDIA-ampere-GA102-GPU-Architecture-Whitepaper-V1.pdf"
)

# name, form factor, memory GB, FP32 TFLOPS, FP16 tensor dense TFLOPS, source
GPU_MODELS = [
    (
        "RTX 3090 Ti", "PCIe", 24, 40.0, 80.0,
        "NVIDIA GeForce RTX 3090 Ti specifications, https://www.nvidia.com/en-us/geforce/"
        "graphics-cards/30-series/rtx-3090-3090ti/: 40 shader TFLOPS, 320 tensor TFLOPS "
        "(FP16 accumulate, with sparsity) -> 160 dense, halved for FP32 accumulate on GeForce",
    ),
    (
        "RTX 3090", "PCIe", 24, 35.6, 71.0,
        _GA102 + ": 35.6 FP32 TFLOPS; FP16 tensor with FP32 accumulate 71 dense (142 sparse)",
    ),
    (
        "RTX 8000", "PCIe", 48, 16.3, 130.5,
        "NVIDIA Quadro RTX 8000 datasheet (quadro-rtx-8000-us-nvidia-946977-r1-web), "
        "https://www.nvidia.com/content/dam/en-zz/Solutions/design-visualization/"
        "quadro-product-literature/quadro-rtx-8000-us-nvidia-946977-r1-web.pdf: 16.3 TFLOPS "
        "single precision, 130.5 TFLOPS tensor",
    ),
    (
        "V100 PCIe", "PCIe", 16, 14.0, 112.0,
        _V100 + ": PCIe column, 14 TFLOPS FP32, 112 TFLOPS tensor; the 16 GB variant the clouds "
        "rent (a 32 GB variant exists: add it as your own model)",
    ),
    (
        "V100 SXM2", "SXM2", 16, 15.7, 125.0,
        _V100 + ": SXM2 column, 15.7 TFLOPS FP32, 125 TFLOPS tensor; 16 GB variant (AWS p3, "
        "GCP); a 32 GB variant exists",
    ),
    (
        "T4", "PCIe", 16, 8.1, 65.0,
        "NVIDIA T4 Tensor Core GPU datasheet (t4-tensor-core-datasheet-951643), "
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
        "t4-tensor-core-datasheet-951643.pdf: 8.1 TFLOPS FP32, 65 TFLOPS mixed FP16/FP32",
    ),
    (
        "A10", "PCIe", 24, 31.2, 125.0,
        "NVIDIA A10 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/"
        "Solutions/Data-Center/a10/pdf/datasheet-new/nvidia-a10-datasheet.pdf: 31.2 TFLOPS "
        "FP32, FP16 tensor 125 dense (250 with sparsity)",
    ),
    (
        "L4", "PCIe", 24, 30.3, 121.0,
        "NVIDIA L4 Tensor Core GPU datasheet, https://resources.nvidia.com/"
        "en-us-data-center-overview/l4-gpu-datasheet: 30.3 TFLOPS FP32, FP16 tensor 242 with "
        "sparsity -> 121 dense",
    ),
    ("A100 40GB", "SXM4", 40, 19.5, 312.0, _A100 + "; 40 GB HBM2"),
    ("A100 80GB", "SXM4", 80, 19.5, 312.0, _A100 + "; 80 GB HBM2e"),
    (
        "H100 SXM", "SXM5", 80, 67.0, 989.0,
        _H100 + ": H100 SXM column, 67 TFLOPS FP32, FP16 tensor 1,979 with sparsity -> 989 dense",
    ),
    (
        "H100 PCIe", "PCIe", 80, 51.0, 756.0,
        _H100 + ": H100 PCIe column, 51 TFLOPS FP32, FP16 tensor 1,513 with sparsity -> 756 dense",
    ),
    (
        "H200", "SXM5", 141, 67.0, 989.0,
        "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/: "
        "H200 SXM column, 67 TFLOPS FP32, FP16 tensor 1,979 with sparsity -> 989 dense, 141 GB "
        "HBM3e",
    ),
]

# provider, region, instance type (8 vCPU + 1 T4), spot $/h, on-demand $/h
T4_INSTANCES = [
    ("gcp", "us-west", "n1-standard-8", 0.180, 0.572),
    ("aws", "us-west", "g4dn.2xlarge", 0.395, 0.802),
    ("azure", "us-west", "Standard_NC8as_T4_v3", 0.134, 0.489),
]

# traffic class, continent, {provider: $/GB}, from Table 1
TABLE1_EGRESS = [
    ("inter_zone", None, {"gcp": 0.01, "aws": 0.01, "azure": 0.00}),
    ("inter_region", "north_america", {"gcp": 0.01, "aws": 0.01, "azure": 0.02}),
    ("inter_region", "europe", {"gcp": 0.02, "aws": 0.01, "azure": 0.02}),
    ("inter_region", "asia", {"gcp": 0.05, "aws": 0.01, "azure": 0.08}),
    ("inter_region", "oceania", {"gcp": 0.08, "aws": 0.01, "azure": 0.08}),
    ("to_oceania", None, {"gcp": 0.15, "aws": 0.02, "azure": 0.08}),
    ("inter_continent", None, {"gcp": 0.08, "aws": 0.02, "azure": 0.02}),
]

INTERNET_EGRESS = {
    "gcp": (
        0.12,
        "Google Cloud network pricing, premium tier internet egress, 0-1 TiB/month to North "
        "America, https://cloud.google.com/vpc/network-pricing (list price, not from seed 003)",
    ),
    "aws": (
        0.09,
        "Amazon EC2 on-demand pricing, data transfer out to the internet, first 10 TB/month, "
        "https://aws.amazon.com/ec2/pricing/on-demand/ (list price, not from seed 003)",
    ),
    "azure": (
        0.087,
        "Azure bandwidth pricing, internet egress from North America, first 10 TB/month after "
        "the free 100 GB, https://azure.microsoft.com/pricing/details/bandwidth/ "
        "(list price, not from seed 003)",
    ),
}

INTRA_ZONE_SOURCE = (
    "not in seed 003's Table 1: GCP, AWS and Azure charge nothing for traffic within one zone "
    "(their network pricing pages)"
)


def _tables() -> tuple[sa.Table, sa.Table, sa.Table]:
    meta = sa.MetaData()
    gpu_models = sa.Table(
        "gpu_models",
        meta,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String),
        sa.Column("vendor", sa.String),
        sa.Column("form_factor", sa.String),
        sa.Column("memory_gb", sa.Double),
        sa.Column("fp32_tflops", sa.Double),
        sa.Column("fp16_tflops", sa.Double),
        sa.Column("source", sa.Text),
        sa.Column("seeded", sa.Boolean),
        sa.Column("created_at", sa.DateTime(timezone=True)),
        sa.Column("updated_at", sa.DateTime(timezone=True)),
    )
    instance_prices = sa.Table(
        "instance_prices",
        meta,
        sa.Column("provider", sa.String),
        sa.Column("region", sa.String),
        sa.Column("instance_type", sa.String),
        sa.Column("gpu_model_id", sa.Integer),
        sa.Column("gpu_count", sa.Integer),
        sa.Column("spot_usd_per_h", sa.Double),
        sa.Column("on_demand_usd_per_h", sa.Double),
        sa.Column("effective_from", sa.DateTime(timezone=True)),
        sa.Column("source", sa.Text),
        sa.Column("seeded", sa.Boolean),
        sa.Column("created_at", sa.DateTime(timezone=True)),
    )
    egress_prices = sa.Table(
        "egress_prices",
        meta,
        sa.Column("provider", sa.String),
        sa.Column("traffic_class", sa.String),
        sa.Column("continent", sa.String),
        sa.Column("usd_per_gb", sa.Double),
        sa.Column("effective_from", sa.DateTime(timezone=True)),
        sa.Column("source", sa.Text),
        sa.Column("seeded", sa.Boolean),
        sa.Column("created_at", sa.DateTime(timezone=True)),
    )
    return gpu_models, instance_prices, egress_prices


def _ts(value: datetime) -> datetime:
    # SQLite stores naive UTC (see app.models.base.UTCDateTime); Postgres keeps the zone.
    return value.replace(tzinfo=None) if op.get_bind().dialect.name == "sqlite" else value


def upgrade() -> None:
    gpu_models, instance_prices, egress_prices = _tables()
    seeded_at = _ts(datetime.now(UTC))
    op.bulk_insert(
        gpu_models,
        [
            {
                "name": name,
                "vendor": "NVIDIA",
                "form_factor": form,
                "memory_gb": memory,
                "fp32_tflops": fp32,
                "fp16_tflops": fp16,
                "source": source,
                "seeded": True,
                "created_at": seeded_at,
                "updated_at": seeded_at,
            }
            for name, form, memory, fp32, fp16, source in GPU_MODELS
        ],
    )
    t4_id = op.get_bind().execute(
        sa.select(gpu_models.c.id).where(gpu_models.c.name == "T4")
    ).scalar_one()
    op.bulk_insert(
        instance_prices,
        [
            {
                "provider": provider,
                "region": region,
                "instance_type": instance_type,
                "gpu_model_id": t4_id,
                "gpu_count": 1,
                "spot_usd_per_h": spot,
                "on_demand_usd_per_h": on_demand,
                "effective_from": _ts(PAPER_DATE),
                "source": f"{PAPER}; T4 with 8 CPU cores ({instance_type})",
                "seeded": True,
                "created_at": seeded_at,
            }
            for provider, region, instance_type, spot, on_demand in T4_INSTANCES
        ],
    )
    rows = []
    for provider in ("gcp", "aws", "azure"):
        rows.append(("intra_zone", None, provider, 0.0, INTRA_ZONE_SOURCE))
        for traffic_class, continent, prices in TABLE1_EGRESS:
            rows.append((traffic_class, continent, provider, prices[provider], PAPER))
        usd, source = INTERNET_EGRESS[provider]
        rows.append(("internet", None, provider, usd, source))
    op.bulk_insert(
        egress_prices,
        [
            {
                "provider": provider,
                "traffic_class": traffic_class,
                "continent": continent,
                "usd_per_gb": usd,
                "effective_from": _ts(PAPER_DATE),
                "source": source,
                "seeded": True,
                "created_at": seeded_at,
            }
            for traffic_class, continent, provider, usd, source in rows
        ],
    )


def downgrade() -> None:
    gpu_models, instance_prices, egress_prices = _tables()
    seeded = sa.column("seeded").is_(True)
    op.execute(egress_prices.delete().where(seeded))
    op.execute(instance_prices.delete().where(seeded))
    op.execute(gpu_models.delete().where(seeded))
