"""Encrypted links: whether a run's ranks talk over TLS keyed by the run's secret.

Runs stored before ran over plain TCP: they read False. New runs encrypt unless they opt out.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-24 17:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('encrypt_links', sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('encrypt_links')
