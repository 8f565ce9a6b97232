"""The paper's algorithm (seed 000, section III) as small functions over explicit state.

No sockets, threads or clocks here: `trainer.ps` runs these pieces over the protocol of
`trainer.frames`, and the tests call them directly.

Per step t:
 1. Allocation: n_m = B * s_m / sum(s) (`hybridtrain.contract.proportional_batch_sizes`).
 2. Worker m: g_m, the gradient of its mean loss on its n_m samples. Tiny and 1-D tensors go
    dense; the rest is compressed: under DGC's momentum correction the velocity
    u_m <- mu * u_m + g_m is what is compressed; Top-k of (residual + u_m or g_m) at the
    worker's density d_m^t is sent, the rest kept as the residual (error feedback), and the sent
    coordinates of u_m restart at zero (`worker_sparsify`).
 3. Server: G = sum_m alpha_m * g~_m with alpha_m = n_m / B (eq. 1-2, `aggregate`), plus its own
    residual, re-sparsified to k_s = server_k_fraction of the elements (`server_sparsify`).
 4. Every worker applies the same G (eq. 3) with the same optimizer, so the replicas stay equal.
 5. The densities adapt to transmission times (`adapt_densities`) and, under `measured`
    allocation, the batch split to compute times (`trainer.allocation.rebalance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridtrain.contract import adapt_densities  # noqa: F401 - step 5 lives in the contract (the planner's model uses it too)
from trainer.compression import CompressionState, Compressor, ErrorFeedback, Payload, widen
from trainer.frames import Grad, LayoutSpec


@dataclass(frozen=True)
class Layout:
    """Where each parameter lives in the flat gradient: dense tensors first, then compressed."""

    spec: LayoutSpec
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, model: nn.Module, dense_numel: int, *, forward: bool = False) -> Layout:
        """1-D tensors (biases, norms) and tensors under `dense_numel` elements travel dense,
        first; the compressed ones follow in reverse order of definition, which is about the
        order the backward pass produces their gradients. With `forward`, in order of definition, about the order the forward pass
        reads them, so the first chunks of an update are the first needed (`--apply-in-forward`)."""
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        is_dense = [p.dim() <= 1 or p.numel() < dense_numel for _, p in params]
        compressed = [i for i, d in enumerate(is_dense) if not d]
        order = [i for i, d in enumerate(is_dense) if d] + (compressed if forward else compressed[::-1])
        names, numels, offsets, off = [], [], [], 0
        for i in order:
            name, p = params[i]
            names.append(name)
            numels.append(p.numel())
            offsets.append(off)
            off += p.numel()
        nd = sum(p.numel() for (_, p), d in zip(params, is_dense) if d)
        buffers = sum(b.numel() for b in float_buffers(model))
        return cls(LayoutSpec(tuple(names), tuple(numels), nd, buffers), tuple(offsets))

    @property
    def names(self) -> tuple[str, ...]:
        return self.spec.names

    @property
    def numels(self) -> tuple[int, ...]:
        return self.spec.numels

    @property
    def dense_numel(self) -> int:
        return self.spec.dense_numel

    @property
    def sparse_numel(self) -> int:
        return self.spec.sparse_numel

    @property
    def numel(self) -> int:
        return self.spec.numel


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm running statistics and the model's other float buffers that it keeps in its
    state_dict (not trained, so never in gradients): averaged before an evaluation, carried by
    a joiner's state and a checkpoint."""
    # A buffer registered with persistent=False (an attention mask, a rotary table) is what the
    # model rebuilds at construction and its own state_dict leaves out: the same on every
    # replica, so averaging it before every evaluation only sent it over the WAN and back
    # (charlm's 48 x 48 mask: 9.4 kB a worker each way, a third of diloco-gc's WAN bytes at H = 100).
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():  # named_buffers()'s order, and a shared buffer once
        for name, b in module._buffers.items():  # noqa: SLF001 - with the persistence named_buffers() drops
            if (b is not None and b.dtype.is_floating_point and id(b) not in seen
                    and name not in module._non_persistent_buffers_set):  # noqa: SLF001
                seen.add(id(b))
                found.append(b)
    return found


def chunk_count(sparse_numel: int, asked: int) -> int:
    """How many chunks a step is cut into: as asked (--pipeline-chunks), at most one per compressed
    element; a model with no compressed part (every tensor dense) sends one empty chunk."""
    return max(1, min(asked, sparse_numel))


def chunks(sparse_numel: int, count: int) -> tuple[tuple[int, int], ...]:
    """`count` contiguous, near-equal (start, stop) ranges tiling the compressed part."""
    if not 1 <= count <= max(1, sparse_numel):
        raise ValueError(f"cannot split {sparse_numel} compressed elements into {count} chunks")
    bounds = [round(i * sparse_numel / count) for i in range(count + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def chunk_pieces(layout: Layout, bounds: Sequence[tuple[int, int]]) -> list[list[tuple[str, int, int, int, int]]]:
    """For each chunk of the compressed part, the tensors it holds a part of: (the tensor's
    name, the part's first and end element in the tensor, the same in the chunk)."""
    nd = layout.dense_numel
    out: list[list[tuple[str, int, int, int, int]]] = [[] for _ in bounds]
    for name, off, n in zip(layout.names, layout.offsets, layout.numels):
        if off < nd:
            continue
        lo, hi = off - nd, off - nd + n
        for c, (a, b) in enumerate(bounds):
            first, end = max(lo, a), min(hi, b)
            if first < end:
                out[c].append((name, first - lo, end - lo, first - a, end - a))
    return out


def worker_sparsify(
    grad: torch.Tensor,
    *,
    codec: Compressor,
    state: CompressionState,
    velocity: torch.Tensor | None,
    momentum: float,
    dense_step: bool,
) -> Payload:
    """Step 2 for one chunk: what the worker sends of `grad` (updates `state` and `velocity`).

    With a velocity (momentum correction) u <- momentum * u + grad is what travels; a dense step
    (warm-up, or no compression) sends it whole, otherwise the codec's Top-k with error feedback,
    and the velocity of every sent coordinate restarts at zero (DGC's momentum factor masking).
    """
    # One pass writing momentum * u + grad into u, not a multiply then an add: 0.24 against
    # 0.37 ms for 838 k elements on one core (the rounding may differ in the last bit, an FMA).
    sent = grad if velocity is None else torch.add(grad, velocity, alpha=momentum, out=velocity)
    if dense_step:
        return Payload(sent.numel(), sent)
    payload = codec.compress(sent, state)
    if velocity is not None and payload.indices is not None:
        velocity.index_fill_(0, payload.indices, 0.0)
    return payload


def correction_momentum(groups: Sequence[dict]) -> float | None:
    """The SGD momentum that momentum correction moves into the velocity for these param groups:
    0.0 where none has momentum, None where they disagree or use dampening or Nesterov."""
    moms = {float(g.get("momentum", 0.0)) for g in groups}
    if moms <= {0.0}:
        return 0.0
    simple = all(not g.get("nesterov") and not g.get("dampening") for g in groups)
    return moms.pop() if len(moms) == 1 and simple else None


def aggregate(grads: Sequence[Grad], dense_numel: int, chunk_numel: int,
              *, into: torch.Tensor | None = None,
              weights: Sequence[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3, eq. 1-2: sum_m alpha_m * g~_m of one chunk, alpha_m = n_m / sum(n) (fp32), n_m
    each frame's samples or its entry of `weights` (a late change's, trainer.late_changes). The
    sparse sum is added in place to `into` (chunk_numel elements) when given, else to zeros."""
    ns = [g.samples for g in grads] if weights is None else list(weights)
    total = sum(ns)
    if total <= 0:
        raise ValueError("aggregate: the workers reported no samples")
    dense = torch.zeros(dense_numel)
    sparse = torch.zeros(chunk_numel) if into is None else into
    for g, n in zip(grads, ns, strict=True):
        alpha = n / total
        # Widen to fp32 before weighting and summing (fp16 values would lose the small terms);
        # an fp8 payload's scale joins the weight.
        dense.add_(widen(g.dense.values), alpha=alpha * g.dense.scale)
        if g.sparse.indices is None:
            sparse.add_(widen(g.sparse.values), alpha=alpha * g.sparse.scale)
        else:
            sparse.index_add_(0, g.sparse.indices, widen(g.sparse.values), alpha=alpha * g.sparse.scale)
    return dense, sparse


def server_sparsify(update: torch.Tensor, *, codec: Compressor, state: CompressionState,
                    dense_step: bool) -> Payload:
    """Step 3's re-sparsification: Top-k_s of (server residual + G), the rest kept back."""
    if dense_step:
        return Payload(update.numel(), update)
    return codec.compress(update, state)


def aggregate_sparsified(grads: Sequence[Grad], dense_numel: int, chunk_numel: int, *, codec: Compressor,
                         state: CompressionState, dense_step: bool,
                         weights: Sequence[float] | None = None) -> tuple[torch.Tensor, Payload]:
    """Step 3 whole for one chunk: the dense part's weighted sum, and the sparse part's
    (`aggregate`) re-sparsified (`server_sparsify`). Under error feedback the sum is added
    straight into the residual: one pass and one fresh chunk-sized buffer fewer, which on the
    server's few cores is a third of its work a step."""
    if dense_step or not isinstance(codec, ErrorFeedback):
        dense, sparse = aggregate(grads, dense_numel, chunk_numel, weights=weights)
        return dense, server_sparsify(sparse, codec=codec, state=state, dense_step=dense_step)
    dense, _ = aggregate(grads, dense_numel, chunk_numel, into=codec.accumulator(state, chunk_numel),
                         weights=weights)
    return dense, codec.compress_accumulated(state)


def add_payload(pieces: Sequence[tuple[torch.Tensor, int, int, int, int, float]], payload: Payload) -> None:
    """Add one chunk's payload, times each piece's factor, into the flat tensors it spans: a piece
    is (a flat tensor, the part's first and end element in it, the same in the chunk, factor).
    A sparse payload touches its own elements only (the codecs' indices are sorted)."""
    if not pieces:
        return
    device = pieces[0][0].device
    if payload.indices is None:
        values = payload.decoded(device)
        for flat, first, end, s, e, alpha in pieces:
            flat[first:end].add_(values[s:e], alpha=alpha)
        return
    indices = payload.indices.to(device)
    values = widen(payload.values).to(device)
    edges = torch.tensor([x for piece in pieces for x in piece[3:5]], dtype=indices.dtype, device=device)
    cuts = torch.searchsorted(indices, edges).tolist()
    for (flat, first, _, s, _, alpha), lo, hi in zip(pieces, cuts[0::2], cuts[1::2]):
        if lo < hi:
            at = indices[lo:hi] if s == first else indices[lo:hi] - (s - first)
            flat.index_add_(0, at, values[lo:hi], alpha=alpha * payload.scale)


def apply_payload(target: torch.Tensor, payload: Payload) -> None:
    """Write a (possibly sparse) payload into the flat tensor `target` (zeros elsewhere)."""
    if payload.indices is None:
        target.copy_(payload.decoded(target.device))
    else:
        target.zero_()
        target.index_add_(0, payload.indices.to(target.device), widen(payload.values).to(target.device),
                          alpha=payload.scale)
