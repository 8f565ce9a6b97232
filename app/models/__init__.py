"""ORM models of the control plane; importing this package registers every table on `Base`."""

from app.models.base import Base
from app.models.bundles import Bundle, BundleStorage
from app.models.checkpoints import RunCheckpoint
from app.models.datasets import Dataset
from app.models.enums import (
    Continent,
    NodeStatus,
    Provider,
    SiteKind,
    TokenScope,
    TrafficClass,
)
from app.models.events import EventSource, RunEvent
from app.models.inventory import Cluster, GpuModel, Node, NodeGpu, Site, cluster_nodes
from app.models.links import LinkMeasurement, SiteLink
from app.models.prices import EgressPrice, InstancePrice
from app.models.profiles import ProfileStatus, TaskProfile
from app.models.runs import NodeAgent, Run, RunLog, RunMetric, RunStatus, RunWorker, WorkerStatus
from app.models.tokens import ApiToken

__all__ = [
    "ApiToken",
    "Base",
    "Bundle",
    "BundleStorage",
    "Cluster",
    "Continent",
    "Dataset",
    "EgressPrice",
    "EventSource",
    "GpuModel",
    "InstancePrice",
    "LinkMeasurement",
    "Node",
    "NodeAgent",
    "NodeGpu",
    "NodeStatus",
    "ProfileStatus",
    "Provider",
    "Run",
    "RunEvent",
    "RunLog",
    "RunMetric",
    "RunCheckpoint",
    "RunStatus",
    "RunWorker",
    "Site",
    "SiteKind",
    "SiteLink",
    "TaskProfile",
    "TokenScope",
    "TrafficClass",
    "WorkerStatus",
    "cluster_nodes",
]
