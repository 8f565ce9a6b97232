"""Codecs: selection exactness, error feedback, round trips with explicit bounds, the wire format."""

from __future__ import annotations

import pytest
import torch

from trainer.compression import (
    COMPRESSORS,
    CompressionState,
    ErrorFeedback,
    FP8Values,
    FP16Values,
    Identity,
    Payload,
    RandomK,
    TopK,
    build_compressor,
    sample_stride,
    select_topk,
    widen,
)
from trainer.wire import (
    _MSG,
    BITMAP,
    DELTA8,
    DELTA16,
    INT32,
    Message,
    _encoding,
    _index_costs,
    decode,
    encode,
    payload_nbytes,
)

FP16_REL = 2.0**-11  # fp16 has an 11-bit significand: round-to-nearest error <= 2^-11 relative
FP8_REL = 2.0**-4  # e4m3 has a 4-bit significand; scaled, no kept value falls below its normal range


@pytest.mark.parametrize("method", ["threshold", "topk", "sort"])
def test_selection_methods_return_the_exact_top_k(method):
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(1))
    for k in (1, 7, 3000, 30_000):
        got = select_topk(x, k, method)
        ref = torch.topk(x.abs(), k).values
        assert got.numel() == k and torch.equal(got, got.sort().values)
        assert torch.equal(x.abs()[got].sort().values, ref.sort().values)


def test_threshold_selection_is_exact_at_a_quarter_of_the_elements():
    # The server's k = params/4: the largest k the candidate pass still handles.
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(2))
    got = select_topk(x, 100_000, "threshold")
    assert torch.equal(x.abs()[got].sort().values, torch.topk(x.abs(), 100_000).values.sort().values)


def test_threshold_selection_is_exact_when_a_tie_straddles_the_kth_value():
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    x[:50] = 10.0  # 50 equal values, of which the top 40 must keep the first 40 by position
    got = select_topk(x, 40, "threshold")
    assert torch.equal(got, torch.arange(40))


def test_threshold_selection_is_exact_under_heavy_ties():
    x = torch.zeros(200_000)
    x[::7] = 1.0
    got = select_topk(x, 20_000, "threshold")
    assert got.numel() == 20_000 and bool((x[got] == 1.0).all())


@pytest.mark.parametrize("density", [0.02, 0.05, 0.25, 0.5])
def test_estimated_selection_keeps_about_k_of_the_largest(density):
    x = torch.randn(800_000, generator=torch.Generator().manual_seed(4))
    k = int(density * x.numel())
    got = select_topk(x, k, "estimate")
    assert abs(got.numel() - k) <= 0.1 * k and torch.equal(got, got.sort().values)
    # Everything kept is at least as large as everything dropped: a top-k* for k* near k.
    dropped = torch.ones(x.numel(), dtype=torch.bool)
    dropped[got] = False
    assert x.abs()[got].min() >= x.abs()[dropped].max()


def test_estimated_selection_falls_back_to_exact_when_the_sample_misleads():
    # Every sampled (strided) element is large, almost nothing else is: the sample's quantile
    # would keep a few percent of the k asked for.
    x = torch.full((700_000,), 0.01)
    k = 200_000
    x[:: sample_stride(x.numel(), k)] = 1.0
    got = select_topk(x, k, "estimate")
    assert got.numel() == k
    assert torch.equal(x.abs()[got].sort().values, torch.topk(x.abs(), k).values.sort().values)


def test_bitmap_is_chosen_without_scanning_from_an_eighth_of_the_elements():
    n = 80_000
    for k in (n // 8, n // 4):
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(k))[:k].sort().values
        p = Payload(n, torch.ones(k, dtype=torch.float16), idx)
        enc, nbytes = _encoding(p)
        assert enc == BITMAP and nbytes == min(_index_costs(p, 2).values())


def test_error_feedback_conserves_mass():
    codec = build_compressor("topk", value_dtype="fp16", error_feedback=True)
    state = CompressionState(density=0.05)
    gen = torch.Generator().manual_seed(0)
    total_in, total_sent = torch.zeros(10_000), torch.zeros(10_000)
    for step in range(1, 21):
        g = torch.randn(10_000, generator=gen)
        before = state.residual.clone() if state.residual is not None else torch.zeros_like(g)
        p = codec.compress(g, state)
        sent = codec.decompress(p, g)
        # One step: sent + residual = gradient + previous residual (= accumulated).
        torch.testing.assert_close(sent + state.residual, g + before, rtol=0, atol=1e-6)
        total_in += g
        total_sent += sent
    # Over many steps nothing is lost: everything ever fed in is sent or still in the residual.
    torch.testing.assert_close(total_sent + state.residual, total_in, rtol=0, atol=1e-4)


def test_without_error_feedback_the_residual_stays_empty():
    codec = build_compressor("topk", error_feedback=False)
    state = CompressionState(density=0.1)
    codec.compress(torch.randn(1000), state)
    assert state.residual is None


CODECS = {
    "none": lambda: Identity(),
    "topk-fp32": lambda: TopK(),
    "topk-fp16": lambda: FP16Values(TopK()),
    "randomk-fp32": lambda: RandomK(),
    "randomk-fp16": lambda: FP16Values(RandomK()),
    "ef-topk-fp16": lambda: ErrorFeedback(FP16Values(TopK())),
    "ef-randomk-fp16": lambda: ErrorFeedback(FP16Values(RandomK())),
    "topk-fp8": lambda: FP8Values(TopK()),
    "ef-topk-fp8": lambda: ErrorFeedback(FP8Values(TopK())),
    "ef-randomk-fp8": lambda: ErrorFeedback(FP8Values(RandomK())),
}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_round_trip_keeps_sent_values_within_dtype_error_and_zeros_elsewhere(name):
    codec = CODECS[name]()
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(2)) * 3
    p = codec.compress(x, CompressionState(density=0.02, step=3, seed=5))
    wire = decode(encode(Message(1, 3, 1, [], [p]))).payloads[0]
    y = codec.decompress(wire, x)
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[wire.indices if wire.indices is not None else slice(None)] = True
    rel = FP16_REL if "fp16" in name else FP8_REL if "fp8" in name else 0.0
    assert torch.all((y[mask] - x[mask]).abs() <= rel * x[mask].abs() + 1e-12)
    assert torch.all(y[~mask] == 0)
    if name.startswith(("topk", "ef-topk")):
        assert mask.sum() == 1000 and x[mask].abs().min() >= x[~mask].abs().max()


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("shape", [(1,), (2,), (5,), (3, 3), (70_000,)])
def test_every_codec_handles_zeros_and_tiny_tensors(name, shape):
    codec = CODECS[name]()
    for x in (torch.zeros(shape), torch.full(shape, -1.5)):
        p = codec.compress(x, CompressionState(density=0.01, step=1, seed=0))
        assert 1 <= p.count <= x.numel()
        y = codec.decompress(decode(encode(Message(1, 1, 1, [], [p]))).payloads[0], x)
        assert y.shape == x.shape and torch.isfinite(y).all()
        assert torch.all((y == 0) | (y == x))


def test_fp16_values_saturate_instead_of_overflowing():
    codec = FP16Values(TopK())
    p = codec.compress(torch.tensor([1e6, -1e6, 1.0]), CompressionState(density=1.0))
    assert torch.isfinite(p.values.float()).all() and p.values.float().abs().max() == 65504


def test_fp8_values_take_one_byte_each_and_the_largest_maps_to_fp8s_largest():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(4)) * 1e-3
    p = FP8Values(TopK()).compress(x, CompressionState(density=0.01))
    assert p.values.element_size() == 1
    assert p.values.float().abs().max() == 448
    assert p.decoded().abs().max() == pytest.approx(float(x.abs().max()), rel=1e-6)
    # delta8: an index byte and a value byte against fp16's three, and a 4-byte scale.
    fp16 = FP16Values(TopK()).compress(x, CompressionState(density=0.01))
    assert payload_nbytes(p) - 4 - 10 == (payload_nbytes(fp16) - 10) * 2 // 3


def test_fp8_values_saturate_an_infinity_and_keep_a_finite_scale():
    p = FP8Values(TopK()).compress(torch.tensor([float("inf"), -2.0, 1.0]), CompressionState(density=1.0))
    assert p.scale == pytest.approx(2.0 / 448)
    assert p.decoded().tolist()[1:] == pytest.approx([-2.0, 1.0], rel=FP8_REL)
    assert p.decoded()[0] == pytest.approx(2.0)


def test_error_feedback_around_fp8_keeps_the_rounding_for_later_steps():
    codec = ErrorFeedback(FP8Values(TopK()))
    state = CompressionState(density=0.05)
    g = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    p = codec.compress(g, state)
    wire = decode(encode(Message(1, 1, 1, [], [p]))).payloads[0]
    sent = codec.decompress(wire, g)
    # What arrives plus what is kept is exactly what was fed in: the rounding is in the residual.
    torch.testing.assert_close(sent + state.residual, g, rtol=0, atol=1e-6)
    assert state.residual[p.indices].abs().max() > 0


def test_fp8_values_widen_to_the_numbers_torch_decodes():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    torch.testing.assert_close(widen(every), every.float(), equal_nan=True, rtol=0, atol=0)


def test_random_k_draws_the_same_indices_on_every_replica():
    a = RandomK().compress(torch.randn(10_000), CompressionState(density=0.01, step=7, seed=3))
    b = RandomK().compress(torch.randn(10_000), CompressionState(density=0.01, step=7, seed=3))
    c = RandomK().compress(torch.randn(10_000), CompressionState(density=0.01, step=8, seed=3))
    assert torch.equal(a.indices, b.indices) and not torch.equal(a.indices, c.indices)


def _sparse(numel: int, indices: list[int] | torch.Tensor) -> Payload:
    idx = torch.as_tensor(indices, dtype=torch.int64)
    return Payload(numel, torch.randn(idx.numel()).half(), idx)


@pytest.mark.parametrize(
    ("payload", "encoding"),
    [
        (_sparse(10**6, [0, 999_999]), INT32),
        (_sparse(1000, torch.arange(0, 1000, 2)), BITMAP),
        (_sparse(1003, torch.arange(0, 1003, 2)), BITMAP),  # a last byte only partly used
        (_sparse(10**6, torch.arange(0, 10**6, 100)), DELTA8),
        (_sparse(10**6, torch.arange(0, 10**6, 1000)), DELTA16),
    ],
)
def test_wire_round_trips_every_index_encoding(payload, encoding):
    assert _encoding(payload)[0] == encoding
    back = decode(encode(Message(2, 9, 0, [1.5, -2.0], [payload])))
    assert back.kind == 2 and back.step == 9 and back.scalars == [1.5, -2.0]
    got = back.payloads[0]
    assert torch.equal(got.indices, payload.indices)
    assert torch.equal(got.values, payload.values)


def test_delta_coding_round_trips_the_few_gaps_wider_than_its_width():
    # Short gaps throughout and a few that need fillers: exactly one width, one over it, two and
    # many widths (a filler stands for 255 positions in delta8).
    gaps = [1] * 500 + [255] + [3] * 100 + [256] + [2] * 50 + [510, 511, 2000] + [1] * 300
    payload = _sparse(10**6, torch.tensor(gaps).cumsum(0) - 1)
    assert _encoding(payload)[0] == DELTA8
    frame = encode(Message(2, 9, 0, [], [payload]))
    assert frame.numel() == payload_nbytes(payload) + _MSG.size
    got = decode(frame).payloads[0]
    assert torch.equal(got.indices, payload.indices)
    assert torch.equal(got.values, payload.values)


def test_wire_costs_at_most_six_bytes_per_sent_element():
    gen = torch.Generator().manual_seed(0)
    for density in (1e-4, 1e-3, 1e-2, 1 / 32, 0.2):
        x = torch.randn(1_000_000, generator=gen)
        p = FP16Values(TopK()).compress(x, CompressionState(density=density))
        assert payload_nbytes(p) <= 6 * p.count + 26
        assert encode(Message(1, 1, 1, [], [p])).numel() == payload_nbytes(p) + _MSG.size


def test_decode_rejects_a_foreign_frame():
    with pytest.raises(ValueError):
        decode(torch.zeros(40, dtype=torch.uint8))


def test_registry_builds_every_cli_name():
    for name in COMPRESSORS:
        assert build_compressor(name).name == name
    with pytest.raises(ValueError):
        build_compressor("gzip")


def test_raw_bytes_cross_the_wire_dense_and_exactly():
    data = torch.arange(256, dtype=torch.uint8).repeat(3)
    out = decode(encode(Message(1, 1, 1, [], [Payload(data.numel(), data)]))).payloads[0]
    assert out.values.dtype == torch.uint8 and torch.equal(out.values, data)
    with pytest.raises(ValueError, match="dense"):
        encode(Message(1, 1, 1, [], [Payload(1000, data[:3], indices=torch.tensor([1, 5, 9]))]))


def test_a_decoded_frame_owns_its_values():
    # Decoding reads the frame in place: what it returns must not change with the frame's buffer.
    frame = encode(Message(1, 1, 1, [], [Payload(4, torch.ones(4))]))
    values = decode(frame).payloads[0].values
    frame.zero_()
    assert torch.equal(values, torch.ones(4))
