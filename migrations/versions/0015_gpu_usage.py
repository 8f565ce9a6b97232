"""GPU usage: each node's GPU utilisation and memory from NVML, as of its last heartbeat.

Nodes stored before have none until their agent's next heartbeat on a machine with a driver.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-24 19:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.add_column(sa.Column(
            'gpu_usage', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True,
        ))


def downgrade() -> None:
    with op.batch_alter_table('nodes') as batch:
        batch.drop_column('gpu_usage')
