"""Data sets: the datasets table, and the data sets a run reads.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06 07:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0018'
down_revision: str | None = '0017'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')
_PROVIDERS = "('onprem', 'gcp', 'aws', 'azure', 'lambda', 'other')"
_CONTINENTS = "('north_america', 'south_america', 'europe', 'asia', 'oceania', 'africa')"


def upgrade() -> None:
    op.create_table(
        'datasets',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=128), nullable=False),
        sa.Column('url', sa.String(length=2000), nullable=False),
        sa.Column('format', sa.String(length=32), nullable=False),
        sa.Column('size_bytes', sa.BigInteger(), nullable=False),
        sa.Column('shards', sa.Integer(), nullable=False),
        sa.Column('samples', sa.BigInteger(), nullable=False),
        sa.Column('store_provider', sa.String(length=32), nullable=False),
        sa.Column('store_continent', sa.String(length=32), nullable=False),
        sa.Column('store_region', sa.String(length=64), nullable=True),
        sa.Column('store_zone', sa.String(length=64), nullable=True),
        sa.Column('created_by', sa.String(length=128), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint('size_bytes >= 0', name=op.f('ck_datasets_size_bytes_nonnegative')),
        sa.CheckConstraint('shards >= 1', name=op.f('ck_datasets_shards_positive')),
        sa.CheckConstraint('samples >= 1', name=op.f('ck_datasets_samples_positive')),
        sa.CheckConstraint(f'store_provider IN {_PROVIDERS}', name=op.f('ck_datasets_store_provider')),
        sa.CheckConstraint(f'store_continent IN {_CONTINENTS}', name=op.f('ck_datasets_store_continent')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_datasets')),
        sa.UniqueConstraint('name', name=op.f('uq_datasets_name')),
    )
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('datasets', _JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('datasets')
    op.drop_table('datasets')
