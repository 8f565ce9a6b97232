"""Link measurements between nodes (agents' probes) and links declared between sites.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 02:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('link_measurements',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('src_node_id', sa.Integer(), nullable=False),
    sa.Column('dst_node_id', sa.Integer(), nullable=False),
    sa.Column('mbps', sa.Double(), nullable=False),
    sa.Column('rtt_ms', sa.Double(), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('seconds', sa.Double(), nullable=False),
    sa.Column('measured_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['dst_node_id'], ['nodes.id'], name=op.f('fk_link_measurements_dst_node_id_nodes'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['src_node_id'], ['nodes.id'], name=op.f('fk_link_measurements_src_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_link_measurements'))
    )
    op.create_index('ix_link_measurements_pair', 'link_measurements', ['src_node_id', 'dst_node_id', 'measured_at'], unique=False)
    op.create_index(op.f('ix_link_measurements_dst_node_id'), 'link_measurements', ['dst_node_id'], unique=False)
    op.create_table('site_links',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('src_site_id', sa.Integer(), nullable=False),
    sa.Column('dst_site_id', sa.Integer(), nullable=False),
    sa.Column('mbps', sa.Double(), nullable=False),
    sa.Column('rtt_ms', sa.Double(), nullable=False),
    sa.Column('created_by', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['dst_site_id'], ['sites.id'], name=op.f('fk_site_links_dst_site_id_sites'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['src_site_id'], ['sites.id'], name=op.f('fk_site_links_src_site_id_sites'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_site_links')),
    sa.UniqueConstraint('src_site_id', 'dst_site_id', name=op.f('uq_site_links_src_site_id_dst_site_id'))
    )
    op.create_index(op.f('ix_site_links_dst_site_id'), 'site_links', ['dst_site_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_site_links_dst_site_id'), table_name='site_links')
    op.drop_table('site_links')
    op.drop_index(op.f('ix_link_measurements_dst_node_id'), table_name='link_measurements')
    op.drop_index('ix_link_measurements_pair', table_name='link_measurements')
    op.drop_table('link_measurements')
