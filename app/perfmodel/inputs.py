"""The performance model's inputs: a node, the task, the compression settings and a link, as
plain frozen dataclasses read from task profiles, probes and run options (app/perfmodel/predict.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.errors import InvalidFieldError
from hybridtrain.contract import DEFAULT_OUTER_DENSITY, DEFAULT_SYNC_EVERY
from hybridtrain.wiresize import kept_for

# A worker on the server's own node talks to it through the loopback interface.
LOOPBACK_MBPS = 20_000.0
LOOPBACK_RTT_MS = 0.05


class PredictError(InvalidFieldError):
    """The inputs of a prediction are inconsistent; `field` names the one at fault."""


def _float(profile: Mapping, key: str) -> float:
    return float(profile.get(key) or 0.0)


@dataclass(frozen=True)
class NodeSpec:
    """A node as the model sees it: the task's samples/s there, and what compression costs there
    (the task profile's worker_compress_s, server_compress_s, aggregate_s, in seconds per step
    at the reference density and k fraction, each growing by its `*_per_kept` per element kept
    beyond; the sum's zeroing, once a step; a dense frame's decode-and-add and encode cost per
    element; PowerSGD's work per step at `powersgd_rank`)."""

    node_id: int
    name: str
    site_id: int
    samples_per_s: float
    worker_compress_s: float = 0.0
    server_compress_s: float = 0.0
    aggregate_s: float = 0.0
    dense_aggregate_s_per_element: float = 0.0
    dense_encode_s_per_element: float = 0.0
    powersgd_s: float = 0.0
    powersgd_rank: int = 0
    worker_compress_s_per_kept: float = 0.0
    server_compress_s_per_kept: float = 0.0
    aggregate_s_per_kept: float = 0.0
    aggregate_fixed_s: float = 0.0
    # Where the three compression costs were timed (a profile without them: flat in k).
    worker_compress_density: float = 0.0
    server_compress_k_fraction: float = 0.0

    @classmethod
    def from_profile(cls, node_id: int, name: str, site_id: int, profile: Mapping) -> NodeSpec:
        """From the task profile's result measured on that node (fields it lacks count as 0)."""
        return cls(node_id, name, site_id, float(profile["samples_per_s"]),
                   _float(profile, "worker_compress_s"), _float(profile, "server_compress_s"),
                   _float(profile, "aggregate_s"), _float(profile, "dense_aggregate_s_per_element"),
                   _float(profile, "dense_encode_s_per_element"), _float(profile, "powersgd_s"),
                   int(profile.get("powersgd_rank") or 0), _float(profile, "worker_compress_s_per_kept"),
                   _float(profile, "server_compress_s_per_kept"), _float(profile, "aggregate_s_per_kept"),
                   _float(profile, "aggregate_fixed_s"), _float(profile, "worker_compress_density"),
                   _float(profile, "server_compress_k_fraction"))

    def powersgd_at(self, rank: int) -> float:
        """PowerSGD's work per step at `rank`: its matrix products grow linearly with the rank."""
        if self.powersgd_rank <= 0:
            return self.powersgd_s
        return self.powersgd_s * rank / self.powersgd_rank

    def worker_compress_at(self, numel: int, density: float) -> float:
        """A worker's compression of `numel` elements at `density` (error feedback, velocity,
        Top-k, the frame)."""
        return _at(self.worker_compress_s, self.worker_compress_s_per_kept, numel, density,
                   self.worker_compress_density)

    def server_compress_at(self, numel: int, k_fraction: float) -> float:
        """The server's re-sparsification of `numel` elements at `k_fraction`, and its frame."""
        return _at(self.server_compress_s, self.server_compress_s_per_kept, numel, k_fraction,
                   self.server_compress_k_fraction)

    def aggregate_at(self, numel: int, density: float) -> float:
        """Decoding and adding one worker's frame of `numel` elements at `density`, without the
        sum's zeroing (`aggregate_fixed_s`, once a step)."""
        one = _at(self.aggregate_s, self.aggregate_s_per_kept, numel, density, self.worker_compress_density)
        return max(0.0, one - self.aggregate_fixed_s)


def _at(cost: float, per_kept: float, numel: int, fraction: float, reference: float) -> float:
    """`cost`, timed at `reference`, moved along its line to `fraction` (never below zero)."""
    if reference <= 0 or per_kept <= 0:
        return cost
    return max(0.0, cost + per_kept * (kept_for(numel, fraction) - kept_for(numel, reference)))


@dataclass(frozen=True)
class TaskSpec:
    """The model's size: all parameters, the part that travels dense, the float buffers.
    `matrix_shapes` (rows, cols) of the compressible matrices, when known, make PowerSGD's bytes
    exact."""

    params: int
    dense_params: int
    buffer_numel: int = 0
    matrix_shapes: tuple[tuple[int, int], ...] = ()
    # The held-out set's size; given, evaluation every eval_every steps is part of the time.
    eval_samples: int | None = None

    @property
    def sparse_params(self) -> int:
        """The compressed part."""
        return max(0, self.params - self.dense_params)

    @classmethod
    def from_profile(cls, profile: Mapping, *, with_eval: bool = True) -> TaskSpec:
        """From a task profile's result (trainer.profile's JSON)."""
        eval_samples = profile.get("eval_samples") if with_eval else None
        shapes = tuple((int(r), int(c)) for r, c in profile.get("matrix_shapes") or ())
        return cls(int(profile["params"]), int(profile["dense_params"]), int(profile.get("buffer_numel") or 0),
                   matrix_shapes=shapes, eval_samples=int(eval_samples) if eval_samples else None)


@dataclass(frozen=True)
class CompressionSpec:
    """The trainer's compression settings (trainer.config.TrainConfig's defaults), plus the
    density and k_s the profile measured compression at (profile_*)."""

    density: float = 0.01
    density_min: float = 0.002
    density_max: float = 0.05
    server_k_fraction: float = 1 / 32
    value_bytes: int = 2
    warmup_steps: int = 5
    pipeline_chunks: int = 1
    compressor: str = "topk"
    eval_every: int = 50
    density_gamma: float = 0.5
    density_time_floor_s: float = 0.05
    powersgd_rank: int = 2
    powersgd_start: int = 10
    # Local SGD: the inner steps between outer steps (H).
    sync_every: int = DEFAULT_SYNC_EVERY
    outer_density: float = DEFAULT_OUTER_DENSITY
    outer_delay: int = 0
    # Sites as replicas (local SGD): each site's workers average every inner step over its LAN.
    site_replicas: bool = False
    # Streaming (local SGD): the outer steps in this many staggered fragments.
    fragments: int = 1


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link: goodput in Mbit/s, round trip in ms, and where they come from
    (measured, declared, assumed)."""

    mbps: float
    rtt_ms: float
    source: str = "assumed"


LOOPBACK = LinkSpec(LOOPBACK_MBPS, LOOPBACK_RTT_MS, "loopback")
