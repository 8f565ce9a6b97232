"""Run state `cancelling`: a cancelled run whose agents have not yet reported its roles gone.

A launched run's cancel now reads `cancelling` (its GPUs still held) until every rank's exit
is in, and remembers when the cancel was asked for (`cancel_requested_at`), from which the
liveness pass times out an agent that never reports. Runs stored before are unchanged.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 07:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0019'
down_revision: str | None = '0018'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_RUN_STATUSES = ('queued', 'launching', 'running', 'degraded', 'restarting', 'succeeded', 'failed', 'cancelled')


def _in(values: Sequence[str]) -> str:
    return 'status IN ({})'.format(', '.join(f"'{v}'" for v in values))


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('cancel_requested_at', sa.DateTime(timezone=True), nullable=True))
        batch.drop_constraint(op.f('ck_runs_status'), type_='check')
        batch.create_check_constraint(op.f('ck_runs_status'), _in(_RUN_STATUSES + ('cancelling',)))


def downgrade() -> None:
    # The older schema knows no `cancelling`: such a run ends as what it was asked to be.
    op.execute("UPDATE runs SET status = 'cancelled', finished_at = COALESCE(finished_at, cancel_requested_at) "
               "WHERE status = 'cancelling'")
    with op.batch_alter_table('runs') as batch:
        batch.drop_constraint(op.f('ck_runs_status'), type_='check')
        batch.create_check_constraint(op.f('ck_runs_status'), _in(_RUN_STATUSES))
        batch.drop_column('cancel_requested_at')
