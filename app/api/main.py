"""The /api/v1 router: every resource's router, mounted with its prefix and tag."""

from fastapi import APIRouter

from app.api.responses import COMMON
from app.api.routes import (
    agent,
    agent_links,
    agent_profiles,
    bundles,
    checkpoints,
    clusters,
    datasets,
    egress_prices,
    gpu_models,
    instance_prices,
    links,
    nodes,
    plans,
    profiles,
    run_costs,
    run_events,
    run_logs,
    run_metrics,
    runs,
    sites,
    tokens,
)

api_router = APIRouter(responses=COMMON)
api_router.include_router(gpu_models.router, prefix="/gpu-models", tags=["gpu-models"])
api_router.include_router(sites.router, prefix="/sites", tags=["sites"])
api_router.include_router(nodes.router, prefix="/nodes", tags=["nodes"])
api_router.include_router(clusters.router, prefix="/clusters", tags=["clusters"])
api_router.include_router(
    instance_prices.router, prefix="/prices/instances", tags=["prices"]
)
api_router.include_router(egress_prices.router, prefix="/prices/egress", tags=["prices"])
api_router.include_router(tokens.router, prefix="/tokens", tags=["tokens"])
api_router.include_router(runs.router, prefix="/runs", tags=["runs"])
api_router.include_router(plans.router, prefix="/plans", tags=["plans"])
api_router.include_router(run_metrics.router, prefix="/runs", tags=["metrics"])
api_router.include_router(run_logs.router, prefix="/runs", tags=["logs"])
api_router.include_router(run_costs.router, prefix="/runs", tags=["costs"])
api_router.include_router(checkpoints.router, prefix="/runs", tags=["checkpoints"])
api_router.include_router(run_events.router, prefix="/runs", tags=["events"])
api_router.include_router(agent.router, prefix="/agent", tags=["agent"])
api_router.include_router(bundles.router, prefix="/bundles", tags=["bundles"])
api_router.include_router(bundles.run_router, prefix="/runs", tags=["bundles"])
api_router.include_router(datasets.router, prefix="/datasets", tags=["datasets"])
api_router.include_router(datasets.run_router, prefix="/runs", tags=["datasets"])
api_router.include_router(profiles.router, prefix="/tasks/profiles", tags=["task-profiles"])
api_router.include_router(agent_profiles.router, prefix="/agent", tags=["agent"])
api_router.include_router(links.router, prefix="/links", tags=["links"])
api_router.include_router(links.site_router, prefix="/site-links", tags=["links"])
api_router.include_router(agent_links.router, prefix="/agent", tags=["agent"])
