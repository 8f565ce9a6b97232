"""Runs keep the prediction made when they were created; task profiles keep their whole result.

A run's prediction (app.perfmodel.predict, priced) is what its page and GET /runs/{id}/cost set beside
what it measured. A profile's result carries the model's inputs (dense_params, buffer_numel,
worker_compress_s, server_compress_s, aggregate_s) that have no columns of their own.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 02:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('prediction', _JSON, nullable=True))
    with op.batch_alter_table('task_profiles') as batch:
        batch.add_column(sa.Column('result', _JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('task_profiles') as batch:
        batch.drop_column('result')
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('prediction')
