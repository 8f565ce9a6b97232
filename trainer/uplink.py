"""A worker's way up (seed 000, step 2), a helper `trainer.ps.PSClient` holds: each chunk of
the flat gradient through the codec (tiny and 1-D tensors dense, the rest through
`worker_sparsify`: error feedback, momentum correction, the worker's density, unless it is a
warm-up step), posted to the server or, under per-site aggregation, combined at the site's
relay first. With several chunks the step is a pipeline: chunk c+1 is compressed while chunk c
is on the wire and being aggregated, whose update comes back meanwhile."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from trainer.algorithm import worker_sparsify
from trainer.codec_state import DENSE_CHUNK, codec, sends_dense
from trainer.compression import CompressionState, Payload
from trainer.config import TrainConfig
from trainer.flat_model import FlatModel
from trainer.frames import Grad, pack
from trainer.linkclock import LinkClock
from trainer.membership import relay_wait_s
from trainer.relay import SERVER
from trainer.site_relay import SiteRelay
from trainer.transport import Inbox, Transport


@dataclass
class Upload:
    """One step's sends: what the frames report, and the times and bytes they took."""

    step: int
    samples: int
    loss: float
    compute_s: float
    waits: list = field(default_factory=list)
    topk_s: float = 0.0
    encode_s: float = 0.0
    tx_s: float = 0.0
    nbytes: int = 0
    # Sites as replicas: the round's seconds averaging within the site (the re-split's fixed cost).
    site_s: float = 0.0
    # Streaming local SGD: each fragment's (chunk's) own round of samples, its change's weight.
    chunk_samples: dict[int, int] = field(default_factory=dict)


class Uplink:
    """The codec's state per chunk (residuals) and the link's clock for the density rule."""

    def __init__(self, cfg: TrainConfig, rank: int, flat: FlatModel, bounds: tuple[tuple[int, int], ...],
                 transport: Transport, relay: SiteRelay, *, velocity: torch.Tensor | None, momentum: float) -> None:
        self.cfg, self.rank, self.flat, self.bounds = cfg, rank, flat, bounds
        self.transport, self.relay = transport, relay
        self.velocity, self.momentum = velocity, momentum
        self.codec = codec(cfg, cfg.compressor)
        # One codec state (residual) per chunk: each chunk is compressed on its own.
        self.states = [CompressionState(density=cfg.densities[0], seed=cfg.seed) for _ in bounds]
        # What the last upload took at the link's rate (trainer.linkclock): the server's
        # density rule reads it from the next frames.
        self.last_tx_s = 0.0
        self.link_clock = LinkClock()
        # A relay waits for its members in proportion to the step time, as the server's loss
        # deadline does (trainer.membership.relay_wait_s).
        self.step_times: deque[float] = deque(maxlen=20)

    def dense_step(self, step: int) -> bool:
        """Warm-up steps and uncompressed strategies send the whole gradient."""
        return sends_dense(self.cfg, step)

    def own_dense(self, step: int) -> bool:
        """Whether this worker's own chunks skip the codec: on a dense step, and under site
        replicas for a relay and its members, whose changes (the same one) the relay compresses
        once for the whole site, with the site's one error-feedback residual."""
        in_site = self.cfg.site_replicas and (self.relay.up != SERVER or self.relay.combiner is not None)
        return in_site or self.dense_step(step)

    def compress(self, step: int, chunk: int, density: float) -> tuple[Payload, Payload]:
        """Step 2 for one chunk: (the dense part, on the dense chunk only; the chunk through the codec)."""
        layout, grad = self.flat.layout, self.flat.grad
        nd = layout.dense_numel if chunk == DENSE_CHUNK else 0
        dense = Payload(nd, grad[:nd].cpu())
        a, b = self.bounds[chunk]
        state = self.states[chunk]
        state.density = density
        state.step = step
        # The velocity is accumulated here, chunk by chunk, not with the gradient: a
        # per-parameter cost, it belongs with compression time, which re-balancing treats as
        # fixed rather than per sample.
        sparse = worker_sparsify(
            grad[layout.dense_numel + a : layout.dense_numel + b], codec=self.codec, state=state,
            velocity=None if self.velocity is None else self.velocity[a:b],
            momentum=self.momentum, dense_step=self.own_dense(step))
        return dense, replace(sparse, values=sparse.values.cpu(),
                              indices=None if sparse.indices is None else sparse.indices.cpu())

    def send(self, upload: Upload, inbox: Inbox, density: float, chunks: Sequence[int] | None = None) -> None:
        """Compress and post `chunks` of `upload`'s step (default every one; streaming local SGD
        sends its fragments due), in order."""
        for c in range(len(self.bounds)) if chunks is None else chunks:
            self._send_chunk(upload, c, inbox, density)

    def _send_chunk(self, upload: Upload, c: int, inbox: Inbox, density: float) -> None:
        tc = time.perf_counter()
        dense, sparse = self.compress(upload.step, c, density)
        te = time.perf_counter()
        upload.topk_s += te - tc
        samples = upload.chunk_samples.get(c, upload.samples)
        grad = Grad(upload.step, self.rank, c, upload.loss, samples, upload.compute_s, self.last_tx_s,
                    upload.topk_s, dense, sparse, site_s=upload.site_s)
        combiner = self.relay.combiner
        if combiner is not None:
            grad = combiner.combine(grad, inbox, density=density, dense_step=self.dense_step(upload.step),
                                    wait_s=relay_wait_s(self.step_times, self.cfg.timeout_s))
            te = time.perf_counter()
            upload.topk_s = grad.topk_s
        frame = pack(grad)
        self.relay.note_sent(grad.step, frame)
        ts = time.perf_counter()
        upload.encode_s += ts - te
        upload.waits.append(self.transport.post_many([self.relay.up], frame))
        upload.nbytes += frame.numel()
        upload.tx_s += time.perf_counter() - ts

    def wait(self, upload: Upload) -> None:
        """Until every chunk is written; the write's time counts as transmission."""
        ts = time.perf_counter()
        for wait in upload.waits:
            wait()
        upload.tx_s += time.perf_counter() - ts

    def delivered(self, upload: Upload) -> None:
        """The update is back, so the server has the whole upload and its ACKs are in: the
        link's rate sample is the upload's own, and the send time the density rule reads."""
        self.link_clock.note(self.transport.delivery_rate(self.relay.up))
        self.last_tx_s = self.link_clock.send_s(upload.nbytes, upload.tx_s)
