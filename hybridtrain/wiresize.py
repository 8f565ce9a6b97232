"""Byte sizes of the trainer's frames as they cross the wire, without torch or a tensor.

Mirrors `trainer.wire` (header, float64 scalars, text, per-payload header, the index encoding
the encoder picks), `trainer.frames` (which scalars each frame carries) and
`trainer.transport` (an 8-byte length prefix per frame), so the control plane's performance
model (app/perfmodel/predict.py) counts the bytes a run will send. Every size is exact except the delta
index encodings, whose length depends on where the kept elements lie: there the size is the
expectation for k positions drawn uniformly at random from n (`expected_fillers`), and the
encoding chosen is the cheapest in expectation. Top-k of a real gradient clusters more than
uniform positions do, so a real delta frame is usually a little smaller than predicted.
"""

from __future__ import annotations

import math
from functools import lru_cache

# trainer.wire: _MSG = "<HBBqiHBI" (magic, version, kind, step, sender, #scalars, #payloads,
# text length) and _PAYLOAD = "<BBII" (encoding, value dtype, numel, count).
MESSAGE_HEADER_BYTES = 23
PAYLOAD_HEADER_BYTES = 10
SCALAR_BYTES = 8
SEED_BYTES = 8
# trainer.wire: fp8 values (the only one-byte kind) travel behind their payload's fp32 scale.
SCALE_BYTES = 4
# trainer.transport: every frame travels behind its length as an int64.
LENGTH_PREFIX_BYTES = 8

DENSE, INT32, BITMAP, DELTA8, DELTA16, SEED = "dense", "int32", "bitmap", "delta8", "delta16", "seed"
# The encoder breaks ties in favour of the lower code (trainer.wire's order).
_CODE = {DENSE: 0, INT32: 1, BITMAP: 2, DELTA8: 3, DELTA16: 4, SEED: 5}
_MAX_GAP = {DELTA8: 255, DELTA16: 65535}

# trainer.frames: GRAD carries chunk, loss, samples, compute_s, last_tx_s, topk_s, site_s; UPDATE
# carries chunk, loss, the worker count M, then M densities and M batch sizes on the last
# chunk of a step (M = 0 on the others).
GRAD_SCALARS = 7
UPDATE_SCALARS = 3
# Sites as replicas (trainer.site_replica): a gradient crosses the site's LAN in pieces of this
# many elements, SITE_GRAD carrying piece and samples, SITE_MEAN the piece.
SITE_PIECE = 1 << 20
SITE_GRAD_SCALARS = 2
SITE_MEAN_SCALARS = 1


def kept_for(numel: int, density: float) -> int:
    """Elements a density keeps, as `trainer.compression.k_for`: at least one, at most all."""
    return max(1, min(numel, int(round(density * numel))))


@lru_cache(maxsize=65536)
def expected_fillers(numel: int, kept: int, max_gap: int) -> float:
    """Expected filler entries a delta encoding adds for `kept` sorted positions drawn uniformly
    from `numel`: each gap g costs floor((g - 1) / max_gap) fillers.

    The k gaps are exchangeable, each with P(g > t) = C(n - t, k) / C(n, k), so the expectation
    is k * sum_{j >= 1} C(n - j*max_gap, k) / C(n, k), summed until its terms vanish.
    """
    n, k = numel, kept
    if k <= 0 or n <= max_gap:
        return 0.0
    base = math.lgamma(n + 1) - math.lgamma(n - k + 1)
    total, j = 0.0, 1
    while n - j * max_gap >= k:
        t = j * max_gap
        term = math.exp(math.lgamma(n - t + 1) - math.lgamma(n - t - k + 1) - base)
        total += term
        if term < 1e-12:
            break
        j += 1
    return k * total


def index_costs(numel: int, kept: int, value_bytes: int) -> dict[str, float]:
    """Bytes of the index and value sections under each sparse encoding (delta: expected)."""
    n, k, v = numel, kept, value_bytes
    return {
        INT32: float(k * (4 + v)),
        BITMAP: float((n + 7) // 8 + k * v),
        DELTA8: (k + expected_fillers(n, k, 255)) * (1 + v),
        DELTA16: (k + expected_fillers(n, k, 65535)) * (2 + v),
    }


def choose_encoding(numel: int, kept: int | None, value_bytes: int, *, seeded: bool = False) -> tuple[str, float]:
    """The encoding `trainer.wire` would pick for a payload and its index and value bytes.

    `kept` None is a dense payload (every element, fp32 unless `value_bytes` says otherwise);
    `seeded` is random-k, whose indices travel as one seed.
    """
    if kept is None:
        return DENSE, float(numel * value_bytes)
    if seeded:
        return SEED, float(SEED_BYTES + kept * value_bytes)
    if 8 * kept >= numel:
        # From n/8 kept elements on the encoder takes the bitmap without comparing.
        return BITMAP, float((numel + 7) // 8 + kept * value_bytes)
    costs = index_costs(numel, kept, value_bytes)
    best = min(costs, key=lambda e: (costs[e], _CODE[e]))
    return best, costs[best]


def payload_bytes(numel: int, kept: int | None, value_bytes: int, *, seeded: bool = False) -> float:
    """One payload on the wire, its header (and an fp8 payload's scale) included
    (`trainer.wire.payload_nbytes`)."""
    scale = SCALE_BYTES if value_bytes == 1 else 0
    return PAYLOAD_HEADER_BYTES + scale + choose_encoding(numel, kept, value_bytes, seeded=seeded)[1]


def frame_bytes(scalars: int, payloads: float = 0.0, text_bytes: int = 0) -> float:
    """A frame with `scalars` float64 scalars, payloads totalling `payloads` bytes (headers
    included) and a text section, as the transport counts it: length prefix included."""
    return LENGTH_PREFIX_BYTES + MESSAGE_HEADER_BYTES + SCALAR_BYTES * scalars + text_bytes + payloads


def grad_frame_bytes(dense_numel: int, sparse_numel: int, kept: int | None, value_bytes: int = 2,
                     *, seeded: bool = False) -> float:
    """A worker's GRAD frame for one chunk: the dense part in fp32 (pass 0 on chunks after the
    first) and `sparse_numel` compressed elements of which `kept` travel (None = a dense step:
    warm-up or no compression, all fp32)."""
    sparse_vbytes = 4 if kept is None else value_bytes
    return frame_bytes(GRAD_SCALARS, payload_bytes(dense_numel, None, 4)
                       + payload_bytes(sparse_numel, kept, sparse_vbytes, seeded=seeded))


def update_frame_bytes(dense_numel: int, sparse_numel: int, kept: int | None, value_bytes: int = 2,
                       *, workers: int = 0) -> float:
    """The server's UPDATE frame for one chunk; `workers` = M on a step's last chunk (which
    carries M densities and M batch sizes), 0 on the others. The server's codec is top-k."""
    sparse_vbytes = 4 if kept is None else value_bytes
    return frame_bytes(UPDATE_SCALARS + 2 * workers, payload_bytes(dense_numel, None, 4)
                       + payload_bytes(sparse_numel, kept, sparse_vbytes))


def site_pieces(numel: int) -> list[int]:
    """The sizes of the pieces a site's gradient of `numel` elements travels in
    (`trainer.site_replica.pieces`: near-equal, at most SITE_PIECE each)."""
    count = max(1, math.ceil(numel / SITE_PIECE))
    bounds = [round(i * numel / count) for i in range(count + 1)]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def site_value_bytes(value_bytes: int) -> int:
    """Bytes a value of the in-site exchange takes in a run whose values take `value_bytes`:
    bf16's 2, or fp32's 4 in a run of fp32 values (`trainer.site_replica.site_dtype`)."""
    return 4 if value_bytes == 4 else 2


def site_grad_bytes(numel: int, value_bytes: int = 2) -> float:
    """A member's SITE_GRAD frames of one inner step: its whole gradient, piece by piece."""
    return sum(frame_bytes(SITE_GRAD_SCALARS, payload_bytes(n, None, value_bytes)) for n in site_pieces(numel))


def site_mean_bytes(numel: int, value_bytes: int = 2) -> float:
    """The relay's SITE_MEAN frames of one inner step to one member: the site's mean."""
    return sum(frame_bytes(SITE_MEAN_SCALARS, payload_bytes(n, None, value_bytes)) for n in site_pieces(numel))


def eval_frame_bytes(metric_text_bytes: int) -> float:
    """A worker's EVAL frame: its count as a scalar and its metric sums as JSON text."""
    return frame_bytes(1, 0.0, metric_text_bytes)


def buffers_frame_bytes(buffer_numel: int) -> float:
    """A worker's BUFFERS frame (its samples and its float buffers, fp32); BUFFERS_AVG, the
    server's answer, is 8 bytes smaller (no scalar)."""
    return frame_bytes(1, payload_bytes(buffer_numel, None, 4))
