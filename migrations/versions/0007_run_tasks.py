"""Runs train a task (or a script in a code bundle) instead of a built-in model and data set.

Old runs become the built-in task of their data set and model, their learning rate a task
argument and their target accuracy an `accuracy>=X` target; max_steps becomes nullable (a run
given in epochs learns its steps from the trainer).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 01:20:00
"""

import json
import re
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')
_BUILTIN = re.compile(r'^hybridtrain\.tasks\.([A-Za-z0-9_]+):([A-Za-z0-9_]+)$')
_ACCURACY_TARGET = re.compile(r'^accuracy>=([-+0-9.eE]+)$')
# What a run without a step count got before epochs could be left to the trainer.
_OLD_DEFAULT_MAX_STEPS = 300


def _runs(*columns: sa.Column) -> sa.TableClause:
    return sa.table('runs', sa.column('id', sa.Integer()), *columns)


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('task', sa.String(length=255), nullable=True))
        batch.add_column(sa.Column('task_args', _JSON, nullable=True))
        batch.add_column(sa.Column('bundle_sha256', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('script', sa.String(length=255), nullable=True))
        batch.add_column(sa.Column('script_args', _JSON, nullable=True))
        batch.add_column(sa.Column('target', sa.String(length=64), nullable=True))

    bind = op.get_bind()
    old = _runs(sa.column('model', sa.String()), sa.column('dataset', sa.String()),
                sa.column('lr', sa.Float()), sa.column('target_accuracy', sa.Float()))
    new = _runs(sa.column('task', sa.String()), sa.column('task_args', _JSON),
                sa.column('target', sa.String()))
    rows = bind.execute(sa.select(old.c.id, old.c.model, old.c.dataset, old.c.lr,
                                  old.c.target_accuracy)).all()
    for run_id, model, dataset, lr, target_accuracy in rows:
        bind.execute(
            new.update().where(new.c.id == run_id).values(
                task=f'hybridtrain.tasks.{dataset}:{model}',
                task_args={'lr': lr},
                target=None if target_accuracy is None else f'accuracy>={target_accuracy:g}',
            )
        )

    with op.batch_alter_table('runs') as batch:
        batch.alter_column('task', existing_type=sa.String(length=255), nullable=False)
        batch.alter_column('task_args', existing_type=_JSON, nullable=False)
        batch.alter_column('max_steps', existing_type=sa.Integer(), nullable=True)
        batch.drop_column('target_accuracy')
        batch.drop_column('lr')
        batch.drop_column('dataset')
        batch.drop_column('model')
    op.create_index(op.f('ix_runs_bundle_sha256'), 'runs', ['bundle_sha256'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_runs_bundle_sha256'), table_name='runs')
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('model', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('dataset', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('lr', sa.Double(), nullable=True))
        batch.add_column(sa.Column('target_accuracy', sa.Double(), nullable=True))

    bind = op.get_bind()
    new = _runs(sa.column('task', sa.String()), sa.column('task_args', _JSON),
                sa.column('target', sa.String()), sa.column('max_steps', sa.Integer()))
    old = _runs(sa.column('model', sa.String()), sa.column('dataset', sa.String()),
                sa.column('lr', sa.Float()), sa.column('target_accuracy', sa.Float()),
                sa.column('max_steps', sa.Integer()))
    rows = bind.execute(sa.select(new.c.id, new.c.task, new.c.task_args, new.c.target,
                                  new.c.max_steps)).all()
    for run_id, task, task_args, target, max_steps in rows:
        builtin = _BUILTIN.match(task or '')
        dataset, model = builtin.groups() if builtin else ('custom', 'custom')
        args = json.loads(task_args) if isinstance(task_args, str) else (task_args or {})
        lr = args.get('lr')
        accuracy = _ACCURACY_TARGET.match((target or '').replace(' ', ''))
        bind.execute(
            old.update().where(old.c.id == run_id).values(
                model=model,
                dataset=dataset,
                lr=float(lr) if isinstance(lr, (int, float)) else 0.1,
                target_accuracy=float(accuracy.group(1)) if accuracy else None,
                max_steps=max_steps or _OLD_DEFAULT_MAX_STEPS,
            )
        )

    with op.batch_alter_table('runs') as batch:
        batch.alter_column('model', existing_type=sa.String(length=64), nullable=False)
        batch.alter_column('dataset', existing_type=sa.String(length=64), nullable=False)
        batch.alter_column('lr', existing_type=sa.Double(), nullable=False)
        batch.alter_column('max_steps', existing_type=sa.Integer(), nullable=False)
        batch.drop_column('target')
        batch.drop_column('script_args')
        batch.drop_column('script')
        batch.drop_column('bundle_sha256')
        batch.drop_column('task_args')
        batch.drop_column('task')
