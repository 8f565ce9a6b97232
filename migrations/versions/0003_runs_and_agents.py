"""Runs (plan, lifecycle, metrics, logs) and the agents bound to nodes.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 02:51:45.228414
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('node_agents',
    sa.Column('node_id', sa.Integer(), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('join_token_hash', sa.String(length=64), nullable=False),
    sa.Column('hostname', sa.String(length=255), nullable=True),
    sa.Column('registered_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_node_agents_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('node_id', name=op.f('pk_node_agents')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_node_agents_token_hash'))
    )
    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('strategy', sa.String(length=32), nullable=False),
    sa.Column('model', sa.String(length=64), nullable=False),
    sa.Column('dataset', sa.String(length=64), nullable=False),
    sa.Column('global_batch_size', sa.Integer(), nullable=False),
    sa.Column('lr', sa.Double(), nullable=False),
    sa.Column('max_steps', sa.Integer(), nullable=False),
    sa.Column('epochs', sa.Integer(), nullable=True),
    sa.Column('target_accuracy', sa.Double(), nullable=True),
    sa.Column('seed', sa.Integer(), nullable=False),
    sa.Column('allocation', sa.String(length=16), nullable=False),
    sa.Column('device', sa.String(length=8), nullable=False),
    sa.Column('compression', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('cluster_id', sa.Integer(), nullable=True),
    sa.Column('ps_node_id', sa.Integer(), nullable=True),
    sa.Column('master_addr', sa.String(length=255), nullable=True),
    sa.Column('master_port', sa.Integer(), nullable=True),
    sa.Column('metrics_token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('idempotency_key', sa.String(length=255), nullable=True),
    sa.Column('request_fingerprint', sa.String(length=64), nullable=True),
    sa.Column('launched_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("status IN ('queued', 'launching', 'running', 'succeeded', 'failed', 'cancelled')", name=op.f('ck_runs_status')),
    sa.CheckConstraint('global_batch_size > 0', name=op.f('ck_runs_global_batch_size_positive')),
    sa.CheckConstraint('max_steps > 0', name=op.f('ck_runs_max_steps_positive')),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], name=op.f('fk_runs_cluster_id_clusters'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['ps_node_id'], ['nodes.id'], name=op.f('fk_runs_ps_node_id_nodes'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
    sa.UniqueConstraint('created_by', 'idempotency_key', name=op.f('uq_runs_created_by_idempotency_key')),
    sa.UniqueConstraint('metrics_token_hash', name=op.f('uq_runs_metrics_token_hash'))
    )
    op.create_index('ix_runs_status_id', 'runs', ['status', 'id'], unique=False)
    op.create_table('run_logs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('t', sa.Double(), nullable=False),
    sa.Column('line', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_logs_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_run_logs')),
    sa.UniqueConstraint('run_id', 'rank', 'seq', name=op.f('uq_run_logs_run_id_rank_seq'))
    )
    op.create_table('run_metrics',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=32), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('peer', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('t', sa.Double(), nullable=False),
    sa.Column('value', sa.Double(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_metrics_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_run_metrics')),
    sa.UniqueConstraint('run_id', 'name', 'rank', 'peer', 'step', name=op.f('uq_run_metrics_run_id_name_rank_peer_step'))
    )
    op.create_table('run_workers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('role', sa.String(length=8), nullable=False),
    sa.Column('node_id', sa.Integer(), nullable=True),
    sa.Column('node_name', sa.String(length=128), nullable=False),
    sa.Column('batch_size', sa.Integer(), nullable=True),
    sa.Column('gpu_model', sa.String(length=64), nullable=True),
    sa.Column('gpu_index', sa.Integer(), nullable=True),
    sa.Column('speed', sa.Double(), nullable=True),
    sa.Column('speed_unit', sa.String(length=16), nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('signal', sa.Integer(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('planned', 'launched', 'running', 'succeeded', 'failed', 'cancelled')", name=op.f('ck_run_workers_status')),
    sa.CheckConstraint('batch_size IS NULL OR batch_size > 0', name=op.f('ck_run_workers_batch_size_positive')),
    sa.CheckConstraint('rank >= 0', name=op.f('ck_run_workers_rank_nonnegative')),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_run_workers_node_id_nodes'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_workers_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_run_workers')),
    sa.UniqueConstraint('run_id', 'rank', name=op.f('uq_run_workers_run_id_rank'))
    )
    op.create_index('ix_run_workers_node_id_status', 'run_workers', ['node_id', 'status'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_run_workers_node_id_status', table_name='run_workers')
    op.drop_table('run_workers')
    op.drop_table('run_metrics')
    op.drop_table('run_logs')
    op.drop_index('ix_runs_status_id', table_name='runs')
    op.drop_table('runs')
    op.drop_table('node_agents')
