"""Gradient compressors: small typed classes composed by wrapping (step 3 of the algorithm).

A compressor turns a flat fp32 tensor into a `Payload` and back. State that outlives a step (the
density, the step and seed a random codec draws from, the error-feedback residual) lives in an
explicit `CompressionState` that the caller owns and checkpoints. Behaviours compose by wrapping:
`ErrorFeedback(FP16Values(TopK()))` is the paper's worker codec with fp16 values on the wire;
`ErrorFeedback(FP8Values(TopK()))` ships one byte a value instead.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import torch

from hybridtrain.contract import VALUE_DTYPES

FP16_MAX = 65504.0
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Every fp8 value as fp32: a table look-up widens fp8 six times faster than torch's own
# conversion does on a CPU (0.18 against 1.16 ms for 419k values on one core).
_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(FP8).float()


def widen(values: torch.Tensor) -> torch.Tensor:
    """`values` as fp32 (a new tensor unless they are fp32 already)."""
    if values.dtype == FP8 and values.device.type == "cpu":
        return _FP8_TABLE.index_select(0, values.view(torch.uint8).int())
    return values.float()
SELECT_METHODS = ("estimate", "threshold", "topk", "sort")
# How far an estimated top-k may miss k before the exact selection replaces it.
ESTIMATE_TOLERANCE = 0.1


@dataclass
class Payload:
    """A compressed tensor: `values` at `indices` of a flat tensor of `numel` elements.

    `indices` is None for a dense payload. `seed` is set when the indices can be regenerated from
    it (random-k), so the wire carries the seed instead of the indices. Indices are sorted.
    `scale` multiplies every value: fp8 values travel scaled to fp8's range (`FP8Values`), so
    whatever reads them as numbers goes through `decoded` or folds `scale` into its own factor.
    """

    numel: int
    values: torch.Tensor
    indices: torch.Tensor | None = None
    seed: int | None = None
    scale: float = 1.0

    @property
    def count(self) -> int:
        """How many values the payload carries."""
        return int(self.values.numel())

    def decoded(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The values as the fp32 numbers they stand for (scale applied)."""
        values = widen(self.values).to(device or self.values.device)
        return values if self.scale == 1.0 else values * self.scale


@dataclass
class CompressionState:
    """What a codec carries from one step to the next: density, step, seed, residual."""

    density: float = 1.0
    step: int = 0
    seed: int = 0
    residual: torch.Tensor | None = field(default=None, repr=False)


def k_for(numel: int, density: float) -> int:
    """How many elements a density keeps: at least one, at most all."""
    return max(1, min(numel, int(round(density * numel))))


def _where(mask: torch.Tensor) -> torch.Tensor:
    """Sorted positions of a flat mask's true elements (int64). On a CPU numpy's flatnonzero
    is 2.4x torch's nonzero (0.28 against 0.68 ms for 838k elements)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)


# On a CPU, numpy's comparison and selection are the faster kernels for what top-k does on one
# core: `>=` into a mask 0.17 against torch's 0.70 ms (838k elements), the k-th value of a
# 70k sample 0.08-0.2 against torch.kthvalue's 1.1-1.2 ms (a Xeon with AVX-512, torch 2.14,
# 2026-11-28; docs/trainer.md, "Top-k selection"). Both give the same elements and value.
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def _numpy_can(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _NUMPY_FLOATS


def _at_least(magnitude: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Sorted positions (int64) of the elements of a flat tensor at or above `threshold`."""
    if _numpy_can(magnitude):
        # A Python float compares in float32 against a float32 array (NEP 50), as torch does.
        return torch.from_numpy(np.flatnonzero(magnitude.detach().numpy() >= float(threshold)))
    return _where(magnitude >= threshold)


def _kth_smallest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th smallest (1-based) element of a flat tensor, as a 0-d tensor of its dtype."""
    if _numpy_can(values):
        return torch.from_numpy(np.partition(values.detach().numpy(), k - 1)[k - 1 : k]).reshape(())
    return torch.kthvalue(values, k).values


def _sorted_topk(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(magnitude, k, sorted=False).indices.sort().values


def _threshold_topk(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k from a strided-sample threshold, then a selection among the candidates.

    1. Estimate the threshold from a strided 1/stride sample, aiming 25% above k so that one pass
       nearly always yields enough candidates.
    2. Keep every element at or above it (`_at_least` returns them already sorted).
    3. Correct to exactly k: the k-th largest candidate (`_kth_smallest`, linear time) and a
       cumulative count that breaks ties by position. Every element outside the candidate set
       is below the threshold, so the result equals a full top-k.
    """
    n = magnitude.numel()
    want = 1.25 * k
    threshold = _sample_threshold(magnitude, want + sample_stride(n, want))
    candidates = _at_least(magnitude, threshold)
    if candidates.numel() < k:
        return _sorted_topk(magnitude, k)
    if candidates.numel() == k:
        return candidates
    cand_mag = magnitude.index_select(0, candidates)
    kth = _kth_smallest(cand_mag, candidates.numel() - k + 1)
    at_least = cand_mag >= kth
    if int(at_least.sum()) == k:
        # The usual case, no tie across the k-th value: one comparison decides, and the
        # position-ordered tie count below (a cumulative sum over the candidates) is skipped.
        return candidates[at_least]
    above = cand_mag > kth
    need = k - int(above.sum())
    ties = cand_mag == kth
    keep = above | (ties & (ties.cumsum(0) <= need))
    return candidates[keep]


# A threshold's strided sample holds about SAMPLE_HITS elements above it (at most SAMPLE_MAX in
# all): the count it predicts then has a relative standard error near 1/sqrt(2048) = 2.2 %, a
# fifth of the estimate's tolerance and a tenth of the exact selection's 25 % margin, from the
# fewest elements that buys. The quantile's cost grows with the sample (np.partition: 0.36 ms
# for 70 k strided elements, 0.04 ms for 16 k, one core): a fixed 64 k sample was a fifth of
# the estimate's time on an 838 k chunk.
SAMPLE_HITS = 2048
SAMPLE_MAX = 65536


def sample_stride(n: int, want: float) -> int:
    """The stride of the sample that the `want` largest of `n` elements are estimated from."""
    size = min(SAMPLE_MAX, math.ceil(SAMPLE_HITS * n / max(1.0, want)))
    return max(1, n // size)


def _sample_threshold(magnitude: torch.Tensor, want: float) -> torch.Tensor:
    """The magnitude above which about `want` of the elements lie, from a strided sample
    (`sample_stride`; a quantile of the sample)."""
    n = magnitude.numel()
    sample = magnitude[:: sample_stride(n, want)]
    s = sample.numel()
    above = min(s, max(1, math.ceil(want / n * s)))
    return _kth_smallest(sample, s - above + 1)


def _estimated_topk(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """About k largest elements: everything at or above a threshold estimated from a sample.

    One comparison and one `_where` (already sorted), no correction pass: at a quarter of the
    elements this costs half of the exact selection. The count is within ESTIMATE_TOLERANCE of
    k or the exact selection runs instead; error feedback keeps whatever is not sent, so a
    count of k(1 +- 0.1) changes the bytes on the wire, never what the model receives overall.
    """
    candidates = _at_least(magnitude, _sample_threshold(magnitude, k))
    if abs(candidates.numel() - k) <= ESTIMATE_TOLERANCE * k:
        return candidates
    return _threshold_topk(magnitude, k)


def select_topk(
    tensor: torch.Tensor, k: int, method: str = "threshold", workspace: torch.Tensor | None = None
) -> torch.Tensor:
    """Sorted indices of the k largest-magnitude elements of a flat tensor.

    `workspace` (same size, fp32) receives |tensor|: reusing it saves allocating and faulting in
    a gradient-sized buffer every step, which on CPU costs as much as the selection itself.
    """
    n = tensor.numel()
    if k >= n:
        return torch.arange(n, device=tensor.device)
    if workspace is not None and workspace.numel() == n and workspace.device == tensor.device:
        magnitude = torch.abs(tensor, out=workspace)
    else:
        magnitude = tensor.abs()
    if method == "sort":
        return torch.sort(magnitude, descending=True, stable=True).indices[:k].sort().values
    # Below ~64k elements one topk call is as fast as any sample.
    if method == "topk" or n < 65536:
        return _sorted_topk(magnitude, k)
    if method == "estimate":
        return _estimated_topk(magnitude, k)
    if method == "threshold":
        # Above 1/4 density the exact candidate pass cannot beat one topk call.
        return _threshold_topk(magnitude, k) if k * 4 <= n else _sorted_topk(magnitude, k)
    raise ValueError(f"select method {method!r}: expected one of {SELECT_METHODS}")


class Compressor(ABC):
    """compress(tensor, state) -> Payload; decompress(payload, like) -> Tensor."""

    name: ClassVar[str] = ""

    @abstractmethod
    def compress(self, tensor: torch.Tensor, state: CompressionState) -> Payload:
        """Encode a flat fp32 tensor; may read and update `state`."""

    def decompress(self, payload: Payload, like: torch.Tensor) -> torch.Tensor:
        """A dense fp32 tensor shaped like `like` holding the payload's values."""
        if payload.indices is None:
            return payload.decoded(like.device).reshape(like.shape).clone()
        values = widen(payload.values).to(like.device)
        out = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        out.index_add_(0, payload.indices.to(like.device), values, alpha=payload.scale)
        return out.reshape(like.shape)

    @staticmethod
    def ratio(payload: Payload) -> float:
        """Bytes on the wire over the bytes of the dense fp32 tensor (lower is better)."""
        from trainer.wire import payload_nbytes

        return payload_nbytes(payload) / max(1, 4 * payload.numel)


class Identity(Compressor):
    """No compression: the dense tensor."""

    name = "none"

    def compress(self, tensor: torch.Tensor, state: CompressionState) -> Payload:
        """The whole tensor as a dense payload."""
        return Payload(numel=tensor.numel(), values=tensor.reshape(-1).float())


class TopK(Compressor):
    """Top-k by magnitude at the state's density (seed 000, III-B)."""

    name = "topk"

    def __init__(self, method: str = "threshold") -> None:
        if method not in SELECT_METHODS:
            raise ValueError(f"select method {method!r}: expected one of {SELECT_METHODS}")
        self.method = method
        self._workspace: torch.Tensor | None = None  # scratch only: holds nothing between steps

    def compress(self, tensor: torch.Tensor, state: CompressionState) -> Payload:
        """The k = density * numel largest-magnitude elements."""
        flat = tensor.reshape(-1)
        k = k_for(flat.numel(), state.density)
        ws = self._workspace
        if ws is None or ws.numel() != flat.numel() or ws.device != flat.device:
            ws = self._workspace = torch.empty(flat.numel(), device=flat.device)
        indices = select_topk(flat, k, self.method, ws)
        return Payload(numel=flat.numel(), values=flat.index_select(0, indices).float(), indices=indices)


def random_indices(numel: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sorted prefix of a permutation drawn from `seed`: every replica derives the same set."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randperm(numel, generator=gen)[:k].sort().values.to(device)


class RandomK(Compressor):
    """k uniformly random elements; all replicas draw the same ones at a step, so the wire
    carries a seed instead of indices."""

    name = "randomk"

    def compress(self, tensor: torch.Tensor, state: CompressionState) -> Payload:
        """k random elements chosen by (state.seed, state.step)."""
        flat = tensor.reshape(-1)
        k = k_for(flat.numel(), state.density)
        seed = (state.seed * 1_000_003 + state.step) % (2**62)
        indices = random_indices(flat.numel(), k, seed, flat.device)
        return Payload(numel=flat.numel(), values=flat[indices].float(), indices=indices, seed=seed)


class FP16Values(Compressor):
    """Wraps a codec and ships its values as fp16 (saturating, never inf)."""

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self.name = inner.name

    def compress(self, tensor: torch.Tensor, state: CompressionState) -> Payload:
        """The inner payload with values rounded to fp16."""
        payload = self.inner.compress(tensor, state)
        return replace(payload, values=payload.values.clamp(-FP16_MAX, FP16_MAX).half())

    def decompress(self, payload: Payload, like: torch.Tensor) -> torch.Tensor:
        """Decoded by the inner codec after widening to fp32."""
        return self.inner.decompress(payload, like)


class FP8Values(Compressor):
    """Wraps a codec and ships its values as fp8 (e4m3), scaled so that the largest magnitude
    is fp8's largest: one byte a value, each within 1/16 of its own magnitude.

    Choice (the paper sends fp32): top-k keeps the largest values, whose magnitudes span a few
    decades at most, so one scale a payload loses nothing to fp8's range, and under error
    feedback (which decodes what was sent) the rounding is not lost but sent later.
    """

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self.name = inner.name

    def compress(self, tensor: torch.Tensor, state: CompressionState) -> Payload:
        """The inner payload with its values scaled into fp8's range and rounded to fp8."""
        payload = self.inner.compress(tensor, state)
        values = payload.values.float()
        low, high = torch.aminmax(values) if values.numel() else (values.new_zeros(()), values.new_zeros(()))
        amax = max(-float(low), float(high))
        if not math.isfinite(amax):
            # An inf saturates (as FP16Values does) and is left out of the scale, which stays finite.
            amax = float(values.abs().nan_to_num_(0.0, posinf=0.0).max())
        # The scale travels as fp32: rounded here, so what error feedback decodes is what arrives.
        scale = float(torch.tensor(amax / FP8_MAX, dtype=torch.float32)) if amax > 0 else 1.0
        if scale == 0.0:  # magnitudes below fp32's smallest step: they round to zero either way
            scale = 1.0
        return replace(payload, values=(values / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale=scale)

    def decompress(self, payload: Payload, like: torch.Tensor) -> torch.Tensor:
        """Decoded by the inner codec, the scale applied."""
        return self.inner.decompress(payload, like)


class ErrorFeedback(Compressor):
    """Wraps a codec with error feedback: compress(g + r), keep r <- (g + r) - sent.

    The residual is taken against the *decoded* payload, so rounding to fp16 is fed back too and
    sent + residual equals the accumulated tensor up to one fp32 rounding.
    """

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self.name = inner.name

    def compress(self, tensor: torch.Tensor, state: CompressionState) -> Payload:
        """Compress gradient + residual; what is not sent stays in `state.residual`."""
        flat = tensor.reshape(-1).float()
        if state.residual is not None and state.residual.shape == flat.shape:
            # In place: the residual buffer becomes the accumulator, no gradient-sized allocation.
            state.residual.add_(flat)
        else:
            state.residual = flat.clone()
        return self.compress_accumulated(state)

    @staticmethod
    def accumulator(state: CompressionState, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The residual (zeros at first), for a caller that adds this step's tensor into it in
        place and then calls `compress_accumulated`: a sum built there needs no buffer of its own."""
        if state.residual is None or state.residual.numel() != numel:
            state.residual = torch.zeros(numel, device=device)
        return state.residual

    def compress_accumulated(self, state: CompressionState) -> Payload:
        """Compress the residual as the caller left it (gradient added); the rest stays in it."""
        acc = state.residual
        if acc is None:
            raise ValueError("compress_accumulated: no residual to compress (see accumulator)")
        payload = self.inner.compress(acc, state)
        if payload.indices is None:
            acc.sub_(payload.decoded(acc.device))
        else:
            acc.index_add_(0, payload.indices, widen(payload.values).to(acc.device), alpha=-payload.scale)
        return payload

    def decompress(self, payload: Payload, like: torch.Tensor) -> torch.Tensor:
        """Decoded by the inner codec."""
        return self.inner.decompress(payload, like)


COMPRESSORS: dict[str, type[Compressor]] = {c.name: c for c in (Identity, TopK, RandomK)}


def build_compressor(
    name: str, *, value_dtype: str = "fp16", error_feedback: bool = True, select: str = "threshold"
) -> Compressor:
    """Compose a codec from CLI names: error feedback around fp16 (or fp8) values around the selector."""
    try:
        cls = COMPRESSORS[name]
    except KeyError as exc:
        raise ValueError(f"compressor {name!r}: expected one of {sorted(COMPRESSORS)}") from exc
    codec: Compressor = TopK(select) if cls is TopK else cls()
    if value_dtype not in VALUE_DTYPES:
        raise ValueError(f"value dtype {value_dtype!r}: expected one of {VALUE_DTYPES}")
    if value_dtype == "fp16" and cls is not Identity:
        codec = FP16Values(codec)
    elif value_dtype == "fp8" and cls is not Identity:
        codec = FP8Values(codec)
    if error_feedback and cls is not Identity:
        codec = ErrorFeedback(codec)
    return codec
