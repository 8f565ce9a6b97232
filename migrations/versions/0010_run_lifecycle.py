"""Run lifecycle: degraded and restarting states, checkpoints, restarts and membership settings.

Runs get their checkpoint period, restart budget (and count) and minimum workers; a rank gets
when its launch was ordered and when the order was last sent (an unanswered order is re-sent)
and may have `left`;
uploaded checkpoints get a table of their own. Runs stored before keep checkpoints off and no
restarts, as they were launched.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 04:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_RUN_STATUSES = ('queued', 'launching', 'running', 'succeeded', 'failed', 'cancelled')
_NEW_RUN_STATUSES = ('degraded', 'restarting')
_WORKER_STATUSES = ('planned', 'launched', 'running', 'succeeded', 'failed', 'cancelled')
_NEW_WORKER_STATUSES = ('left',)
_SETTINGS_VALID = (
    'checkpoint_every >= 0 AND checkpoint_every_s >= 0 AND max_restarts >= 0 '
    'AND restarts >= 0 AND min_workers >= 1 AND min_workers_wait_s >= 0'
)


def _in(values: Sequence[str]) -> str:
    return 'status IN ({})'.format(', '.join(f"'{v}'" for v in values))


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('checkpoint_every', sa.Integer(), server_default='0', nullable=False))
        batch.add_column(sa.Column('checkpoint_every_s', sa.Double(), server_default='0', nullable=False))
        batch.add_column(sa.Column('max_restarts', sa.Integer(), server_default='0', nullable=False))
        batch.add_column(sa.Column('restarts', sa.Integer(), server_default='0', nullable=False))
        batch.add_column(sa.Column('min_workers', sa.Integer(), server_default='1', nullable=False))
        batch.add_column(sa.Column('min_workers_wait_s', sa.Double(), server_default='300', nullable=False))
        batch.drop_constraint(op.f('ck_runs_status'), type_='check')
        batch.create_check_constraint(op.f('ck_runs_status'), _in(_RUN_STATUSES + _NEW_RUN_STATUSES))
        batch.create_check_constraint(op.f('ck_runs_lifecycle_settings_valid'), _SETTINGS_VALID)
    with op.batch_alter_table('run_workers') as batch:
        batch.add_column(sa.Column('launched_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('ordered_at', sa.DateTime(timezone=True), nullable=True))
        batch.drop_constraint(op.f('ck_run_workers_status'), type_='check')
        batch.create_check_constraint(op.f('ck_run_workers_status'), _in(_WORKER_STATUSES + _NEW_WORKER_STATUSES))
    op.create_table('run_checkpoints',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('content', sa.LargeBinary(), nullable=True),
    sa.Column('stored_in', sa.String(length=8), nullable=False),
    sa.CheckConstraint('step >= 0', name=op.f('ck_run_checkpoints_step_nonnegative')),
    sa.CheckConstraint('size_bytes >= 0', name=op.f('ck_run_checkpoints_size_bytes_nonnegative')),
    sa.CheckConstraint("stored_in IN ('db', 'dir')", name=op.f('ck_run_checkpoints_stored_in_known')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_checkpoints_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_run_checkpoints')),
    sa.UniqueConstraint('run_id', 'step', name=op.f('uq_run_checkpoints_run_id_step'))
    )
    op.create_index(op.f('ix_run_checkpoints_run_id'), 'run_checkpoints', ['run_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_run_checkpoints_run_id'), table_name='run_checkpoints')
    op.drop_table('run_checkpoints')
    # The states and the rank status the older schema lacks end as what it knew.
    op.execute("UPDATE runs SET status = 'running' WHERE status IN ('degraded', 'restarting')")
    op.execute("UPDATE run_workers SET status = 'succeeded' WHERE status = 'left'")
    with op.batch_alter_table('run_workers') as batch:
        batch.drop_constraint(op.f('ck_run_workers_status'), type_='check')
        batch.create_check_constraint(op.f('ck_run_workers_status'), _in(_WORKER_STATUSES))
        batch.drop_column('ordered_at')
        batch.drop_column('launched_at')
    with op.batch_alter_table('runs') as batch:
        batch.drop_constraint(op.f('ck_runs_lifecycle_settings_valid'), type_='check')
        batch.drop_constraint(op.f('ck_runs_status'), type_='check')
        batch.create_check_constraint(op.f('ck_runs_status'), _in(_RUN_STATUSES))
        for column in ('min_workers_wait_s', 'min_workers', 'restarts', 'max_restarts',
                       'checkpoint_every_s', 'checkpoint_every'):
            batch.drop_column(column)
