"""API tokens may expire and be limited to named actions; their last use is recorded.

Tokens stored before keep no expiry and no limit (they behave as they did) and have not been
seen in use yet.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-24 05:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    with op.batch_alter_table('api_tokens') as batch:
        batch.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('actions', _JSON, nullable=True))
        batch.add_column(sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('api_tokens') as batch:
        batch.drop_column('last_used_at')
        batch.drop_column('actions')
        batch.drop_column('expires_at')
