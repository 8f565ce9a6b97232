"""Runs: whether reaching the target accuracy stops the run.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 16:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Existing runs stopped at their target: the server default keeps that true of them.
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('stop_at_target', sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('stop_at_target')
