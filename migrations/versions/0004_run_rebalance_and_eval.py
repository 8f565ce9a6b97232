"""Runs: re-balancing period and evaluation period.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 23:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('rebalance_every', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('eval_every', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('eval_every')
        batch.drop_column('rebalance_every')
