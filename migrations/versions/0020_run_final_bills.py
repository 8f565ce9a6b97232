"""Final bills: an ended run's total, whether part of it had no price, and when it was stored.

The overview and the runs list read these instead of summing the run's metrics again. Runs
stored before have none: they are billed live until the liveness pass stores theirs, a few a
pass (app.queries.final_bills).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06 20:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0020'
down_revision: str | None = '0019'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('billed_usd', sa.Numeric(16, 6), nullable=True))
        batch.add_column(sa.Column('billed_unpriced', sa.Boolean(), nullable=True))
        batch.add_column(sa.Column('billed_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # Only a cache of what the metrics and prices say: nothing is lost with it.
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('billed_at')
        batch.drop_column('billed_unpriced')
        batch.drop_column('billed_usd')
