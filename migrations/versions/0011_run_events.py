"""Run events (the run's timeline), and metrics stored once per (run, rank, stream, seq).

The trainer now numbers each process's records (stream, seq), so a step trained again after a
restart is kept while a resent batch is not. Rows stored before carry the key they had:
stream `~{name}/{peer}` and seq their step, which is also what ingestion gives a record that
comes without a stream.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24 04:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BIG_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table('run_events',
    sa.Column('id', _BIG_ID, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('t', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('subject', sa.Integer(), nullable=True),
    sa.Column('node_id', sa.Integer(), nullable=True),
    sa.Column('step', sa.Integer(), nullable=True),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.Column('source', sa.String(length=32), nullable=False),
    sa.Column('stream', sa.String(length=32), nullable=True),
    sa.Column('seq', sa.BigInteger(), nullable=True),
    sa.CheckConstraint("source IN ('trainer', 'control_plane', 'agent')", name=op.f('ck_run_events_source')),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_run_events_node_id_nodes'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_events_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_run_events'))
    )
    op.create_index('ix_run_events_run_id_t', 'run_events', ['run_id', 't'], unique=False)
    op.create_index('uq_run_events_run_id_stream_seq', 'run_events', ['run_id', 'stream', 'seq'], unique=True)
    op.create_index(op.f('ix_run_events_node_id'), 'run_events', ['node_id'], unique=False)

    with op.batch_alter_table('run_metrics') as batch:
        batch.add_column(sa.Column('stream', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('seq', sa.BigInteger(), nullable=True))
    op.execute(
        "UPDATE run_metrics SET stream = '~' || name || '/' || CAST(peer AS VARCHAR(12)), seq = step"
    )
    with op.batch_alter_table('run_metrics') as batch:
        batch.alter_column('stream', existing_type=sa.String(length=64), nullable=False)
        batch.alter_column('seq', existing_type=sa.BigInteger(), nullable=False)
        batch.drop_constraint('uq_run_metrics_run_id_name_rank_peer_step', type_='unique')
        batch.create_index('uq_run_metrics_run_id_rank_stream_seq', ['run_id', 'rank', 'stream', 'seq'], unique=True)
        batch.create_index('ix_run_metrics_series', ['run_id', 'name', 'rank', 'peer', 'step'], unique=False)


def downgrade() -> None:
    # Rows of one step trained twice (a restart) collide on the old key: keep the first.
    op.execute(
        "DELETE FROM run_metrics WHERE id NOT IN (SELECT min(id) FROM run_metrics "
        "GROUP BY run_id, name, rank, peer, step)"
    )
    with op.batch_alter_table('run_metrics') as batch:
        batch.drop_index('ix_run_metrics_series')
        batch.drop_index('uq_run_metrics_run_id_rank_stream_seq')
        batch.create_unique_constraint('uq_run_metrics_run_id_name_rank_peer_step', ['run_id', 'name', 'rank', 'peer', 'step'])
        batch.drop_column('seq')
        batch.drop_column('stream')
    op.drop_index(op.f('ix_run_events_node_id'), table_name='run_events')
    op.drop_index('uq_run_events_run_id_stream_seq', table_name='run_events')
    op.drop_index('ix_run_events_run_id_t', table_name='run_events')
    op.drop_table('run_events')
