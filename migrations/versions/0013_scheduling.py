"""Scheduling: a run's queue priority and whether it shares GPUs; each rank's GPU sharers.

Runs stored before have priority 0, do not share, and each rank held its GPU alone.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24 05:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('priority', sa.Integer(), nullable=False, server_default='0'))
        batch.add_column(sa.Column('share_gpus', sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table('run_workers') as batch:
        batch.add_column(sa.Column('sharers', sa.Integer(), nullable=False, server_default='1'))
    # The queue is read in (priority desc, id) order among queued runs.
    op.create_index('ix_runs_status_priority_id', 'runs', ['status', 'priority', 'id'])


def downgrade() -> None:
    op.drop_index('ix_runs_status_priority_id', table_name='runs')
    with op.batch_alter_table('run_workers') as batch:
        batch.drop_column('sharers')
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('share_gpus')
        batch.drop_column('priority')
