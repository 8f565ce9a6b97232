"""Bundles of users' code and task profiles measured on nodes.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 01:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    op.create_table('bundles',
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('filename', sa.String(length=255), nullable=True),
    sa.Column('files', sa.Integer(), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('content', sa.LargeBinary(), nullable=True),
    sa.Column('stored_in', sa.String(length=8), nullable=False),
    sa.CheckConstraint('size_bytes >= 0', name=op.f('ck_bundles_size_bytes_nonnegative')),
    sa.CheckConstraint("stored_in IN ('db', 'dir')", name=op.f('ck_bundles_stored_in_known')),
    sa.PrimaryKeyConstraint('sha256', name=op.f('pk_bundles'))
    )
    op.create_table('task_profiles',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('node_id', sa.Integer(), nullable=False),
    sa.Column('task_key', sa.String(length=64), nullable=False),
    sa.Column('task', sa.String(length=255), nullable=False),
    sa.Column('task_args', _JSON, nullable=False),
    sa.Column('bundle_sha256', sa.String(length=64), nullable=True),
    sa.Column('batch_size', sa.Integer(), nullable=False),
    sa.Column('device', sa.String(length=8), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('params', sa.BigInteger(), nullable=True),
    sa.Column('train_samples', sa.BigInteger(), nullable=True),
    sa.Column('eval_samples', sa.BigInteger(), nullable=True),
    sa.Column('samples_per_s', sa.Double(), nullable=True),
    sa.Column('step_s', sa.Double(), nullable=True),
    sa.Column('metrics', _JSON, nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('measured_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('pending', 'done', 'failed')", name=op.f('ck_task_profiles_status')),
    sa.ForeignKeyConstraint(['bundle_sha256'], ['bundles.sha256'], name=op.f('fk_task_profiles_bundle_sha256_bundles'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_task_profiles_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_task_profiles'))
    )
    op.create_index(op.f('ix_task_profiles_node_id'), 'task_profiles', ['node_id'], unique=False)
    op.create_index(op.f('ix_task_profiles_task_key'), 'task_profiles', ['task_key'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_task_profiles_task_key'), table_name='task_profiles')
    op.drop_index(op.f('ix_task_profiles_node_id'), table_name='task_profiles')
    op.drop_table('task_profiles')
    op.drop_table('bundles')
