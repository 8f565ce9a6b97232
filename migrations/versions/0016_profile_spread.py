"""Profile spread: how much a profile's repeated runs disagreed, and how many there were.

Agents repeat the profiler until its samples/s settle (agents.profiles.stable_measurement) and
report the spread, (max - min) / median of the runs kept, beside the median run. Profiles
stored before have neither (null: one run, noise unknown).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 04:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0016'
down_revision: str | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('task_profiles') as batch:
        batch.add_column(sa.Column('spread', sa.Double(), nullable=True))
        batch.add_column(sa.Column('repeats', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('task_profiles') as batch:
        batch.drop_column('repeats')
        batch.drop_column('spread')
