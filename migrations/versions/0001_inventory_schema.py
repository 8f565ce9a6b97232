"""Inventory schema: GPU models, sites, nodes, clusters, versioned prices and API tokens.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 02:39:41.776037
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql


revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('api_tokens',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('scope', sa.String(length=32), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("scope IN ('read', 'ci', 'admin')", name=op.f('ck_api_tokens_scope')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('name', name=op.f('uq_api_tokens_name')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash'))
    )
    op.create_table('clusters',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('description', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_clusters')),
    sa.UniqueConstraint('name', name=op.f('uq_clusters_name'))
    )
    op.create_table('egress_prices',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('provider', sa.String(length=32), nullable=False),
    sa.Column('traffic_class', sa.String(length=32), nullable=False),
    sa.Column('continent', sa.String(length=32), nullable=True),
    sa.Column('usd_per_gb', sa.Double(), nullable=False),
    sa.Column('effective_from', sa.DateTime(timezone=True), nullable=False),
    sa.Column('source', sa.Text(), nullable=False),
    sa.Column('seeded', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint('usd_per_gb >= 0', name=op.f('ck_egress_prices_usd_per_gb_nonnegative')),
    sa.CheckConstraint("provider IN ('onprem', 'gcp', 'aws', 'azure', 'lambda', 'other')", name=op.f('ck_egress_prices_provider')),
    sa.CheckConstraint("traffic_class IN ('intra_zone', 'inter_zone', 'inter_region', 'inter_continent', 'to_oceania', 'internet')", name=op.f('ck_egress_prices_traffic_class')),
    sa.CheckConstraint("continent IN ('north_america', 'south_america', 'europe', 'asia', 'oceania', 'africa')", name=op.f('ck_egress_prices_continent')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_egress_prices')),
    sa.UniqueConstraint('provider', 'traffic_class', 'continent', 'effective_from', name=op.f('uq_egress_prices_provider_traffic_class_continent_effective_from'))
    )
    op.create_index('uq_egress_prices_any_continent', 'egress_prices', ['provider', 'traffic_class', 'effective_from'], unique=True, postgresql_where=sa.text('continent IS NULL'), sqlite_where=sa.text('continent IS NULL'))
    op.create_table('gpu_models',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('vendor', sa.String(length=32), nullable=False),
    sa.Column('form_factor', sa.String(length=32), nullable=True),
    sa.Column('memory_gb', sa.Double(), nullable=False),
    sa.Column('fp32_tflops', sa.Double(), nullable=False),
    sa.Column('fp16_tflops', sa.Double(), nullable=False),
    sa.Column('source', sa.Text(), nullable=False),
    sa.Column('seeded', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('fp16_tflops > 0', name=op.f('ck_gpu_models_fp16_tflops_positive')),
    sa.CheckConstraint('fp32_tflops > 0', name=op.f('ck_gpu_models_fp32_tflops_positive')),
    sa.CheckConstraint('memory_gb > 0', name=op.f('ck_gpu_models_memory_gb_positive')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_gpu_models')),
    sa.UniqueConstraint('name', name=op.f('uq_gpu_models_name'))
    )
    op.create_table('sites',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('provider', sa.String(length=32), nullable=False),
    sa.Column('region', sa.String(length=64), nullable=True),
    sa.Column('zone', sa.String(length=64), nullable=True),
    sa.Column('continent', sa.String(length=32), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("kind IN ('onprem', 'cloud')", name=op.f('ck_sites_kind')),
    sa.CheckConstraint("provider IN ('onprem', 'gcp', 'aws', 'azure', 'lambda', 'other')", name=op.f('ck_sites_provider')),
    sa.CheckConstraint("continent IN ('north_america', 'south_america', 'europe', 'asia', 'oceania', 'africa')", name=op.f('ck_sites_continent')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sites')),
    sa.UniqueConstraint('name', name=op.f('uq_sites_name'))
    )
    op.create_index(op.f('ix_sites_provider'), 'sites', ['provider'], unique=False)
    op.create_table('instance_prices',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('provider', sa.String(length=32), nullable=False),
    sa.Column('region', sa.String(length=64), nullable=False),
    sa.Column('instance_type', sa.String(length=64), nullable=False),
    sa.Column('gpu_model_id', sa.Integer(), nullable=False),
    sa.Column('gpu_count', sa.Integer(), nullable=False),
    sa.Column('spot_usd_per_h', sa.Double(), nullable=True),
    sa.Column('on_demand_usd_per_h', sa.Double(), nullable=False),
    sa.Column('effective_from', sa.DateTime(timezone=True), nullable=False),
    sa.Column('source', sa.Text(), nullable=False),
    sa.Column('seeded', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint('gpu_count > 0', name=op.f('ck_instance_prices_gpu_count_positive')),
    sa.CheckConstraint('on_demand_usd_per_h >= 0', name=op.f('ck_instance_prices_on_demand_nonnegative')),
    sa.CheckConstraint('spot_usd_per_h IS NULL OR spot_usd_per_h >= 0', name=op.f('ck_instance_prices_spot_nonnegative')),
    sa.ForeignKeyConstraint(['gpu_model_id'], ['gpu_models.id'], name=op.f('fk_instance_prices_gpu_model_id_gpu_models'), ondelete='RESTRICT'),
    sa.CheckConstraint("provider IN ('onprem', 'gcp', 'aws', 'azure', 'lambda', 'other')", name=op.f('ck_instance_prices_provider')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_instance_prices')),
    sa.UniqueConstraint('provider', 'region', 'instance_type', 'gpu_model_id', 'gpu_count', 'effective_from', name=op.f('uq_instance_prices_provider_region_instance_type_gpu_model_id_gpu_count_effective_from'))
    )
    op.create_index(op.f('ix_instance_prices_gpu_model_id'), 'instance_prices', ['gpu_model_id'], unique=False)
    op.create_table('nodes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('site_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('address', sa.String(length=255), nullable=True),
    sa.Column('instance_type', sa.String(length=64), nullable=True),
    sa.Column('spot', sa.Boolean(), nullable=False),
    sa.Column('labels', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('last_heartbeat', sa.DateTime(timezone=True), nullable=True),
    sa.Column('amortised_usd_per_h', sa.Double(), server_default='0', nullable=False),
    sa.Column('detected_hardware', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('measured_samples_per_s', sa.Double(), nullable=True),
    sa.Column('join_token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('amortised_usd_per_h >= 0', name=op.f('ck_nodes_amortised_usd_per_h_nonnegative')),
    sa.ForeignKeyConstraint(['site_id'], ['sites.id'], name=op.f('fk_nodes_site_id_sites'), ondelete='RESTRICT'),
    sa.CheckConstraint("status IN ('pending', 'online', 'offline', 'draining')", name=op.f('ck_nodes_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_nodes')),
    sa.UniqueConstraint('join_token_hash', name=op.f('uq_nodes_join_token_hash')),
    sa.UniqueConstraint('site_id', 'name', name=op.f('uq_nodes_site_id_name'))
    )
    op.create_index('ix_nodes_status_id', 'nodes', ['status', 'id'], unique=False)
    op.create_table('cluster_nodes',
    sa.Column('cluster_id', sa.Integer(), nullable=False),
    sa.Column('node_id', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['cluster_id'], ['clusters.id'], name=op.f('fk_cluster_nodes_cluster_id_clusters'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_cluster_nodes_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('cluster_id', 'node_id', name=op.f('pk_cluster_nodes'))
    )
    op.create_index(op.f('ix_cluster_nodes_node_id'), 'cluster_nodes', ['node_id'], unique=False)
    op.create_table('node_gpus',
    sa.Column('node_id', sa.Integer(), nullable=False),
    sa.Column('gpu_model_id', sa.Integer(), nullable=False),
    sa.Column('count', sa.Integer(), nullable=False),
    sa.CheckConstraint('count > 0', name=op.f('ck_node_gpus_count_positive')),
    sa.ForeignKeyConstraint(['gpu_model_id'], ['gpu_models.id'], name=op.f('fk_node_gpus_gpu_model_id_gpu_models'), ondelete='RESTRICT'),
    sa.ForeignKeyConstraint(['node_id'], ['nodes.id'], name=op.f('fk_node_gpus_node_id_nodes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('node_id', 'gpu_model_id', name=op.f('pk_node_gpus'))
    )
    op.create_index(op.f('ix_node_gpus_gpu_model_id'), 'node_gpus', ['gpu_model_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_node_gpus_gpu_model_id'), table_name='node_gpus')
    op.drop_table('node_gpus')
    op.drop_index(op.f('ix_cluster_nodes_node_id'), table_name='cluster_nodes')
    op.drop_table('cluster_nodes')
    op.drop_index('ix_nodes_status_id', table_name='nodes')
    op.drop_table('nodes')
    op.drop_index(op.f('ix_instance_prices_gpu_model_id'), table_name='instance_prices')
    op.drop_table('instance_prices')
    op.drop_index(op.f('ix_sites_provider'), table_name='sites')
    op.drop_table('sites')
    op.drop_table('gpu_models')
    op.drop_index('uq_egress_prices_any_continent', table_name='egress_prices', postgresql_where=sa.text('continent IS NULL'), sqlite_where=sa.text('continent IS NULL'))
    op.drop_table('egress_prices')
    op.drop_table('clusters')
    op.drop_table('api_tokens')
