"""Runs' local SGD options in their own column, `local_sgd`, out of `compression`.

The outer knobs of `diloco` and `diloco-gc` (sync_every, outer_lr, outer_momentum,
outer_density, outer_delay) are not compression; the request now has them as their own
section (hybridtrain.train_options.LocalSgdOptions). Runs stored before have them moved over;
the way down puts them back.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 06:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0017'
down_revision: str | None = '0016'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LOCAL_SGD = ('sync_every', 'outer_lr', 'outer_momentum', 'outer_density', 'outer_delay')
_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def _runs() -> sa.Table:
    return sa.table('runs', sa.column('id', sa.Integer()), sa.column('compression', _JSON),
                    sa.column('local_sgd', _JSON))


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('local_sgd', _JSON, nullable=False, server_default='{}'))
    runs = _runs()
    connection = op.get_bind()
    for run_id, compression in connection.execute(sa.select(runs.c.id, runs.c.compression)).all():
        compression = dict(compression or {})
        moved = {k: compression.pop(k) for k in LOCAL_SGD if k in compression}
        if moved:
            connection.execute(runs.update().where(runs.c.id == run_id).values(compression=compression,
                                                                               local_sgd=moved))


def downgrade() -> None:
    runs = _runs()
    connection = op.get_bind()
    for run_id, compression, local_sgd in connection.execute(
            sa.select(runs.c.id, runs.c.compression, runs.c.local_sgd)).all():
        if local_sgd:
            connection.execute(runs.update().where(runs.c.id == run_id).values(
                compression={**(compression or {}), **local_sgd}))
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('local_sgd')
