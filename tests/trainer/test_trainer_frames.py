"""Every frame of the parameter-server protocol survives pack/unpack with its fields; expect()
says what came instead of what it wanted; LayoutSpec names the first difference of two models."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.compression import Payload, random_indices
from trainer.frames import (
    check,
    Abort,
    Buffers,
    BuffersAvg,
    Bye,
    Eval,
    EvalResult,
    Grad,
    Hello,
    LayoutSpec,
    ProtocolError,
    Route,
    SiteGrad,
    SiteMean,
    State,
    Update,
    Welcome,
    expect,
    pack,
    unpack,
)

LAYOUT = LayoutSpec(("conv.weight", "conv.bias", "fc.weight"), (72, 8, 640), 80, 16)


def roundtrip(frame):
    out = unpack(pack(frame))
    assert type(out) is type(frame)
    return out


def dense(values: list[float]) -> Payload:
    return Payload(len(values), torch.tensor(values, dtype=torch.float32))


def sparse(numel: int, indices: list[int], values: list[float]) -> Payload:
    return Payload(numel, torch.tensor(values, dtype=torch.float32), torch.tensor(indices, dtype=torch.int64))


def assert_payload_equal(got: Payload, want: Payload) -> None:
    assert got.numel == want.numel
    assert torch.equal(got.values.float(), want.values.float())
    if want.indices is None:
        assert got.indices is None
    else:
        assert torch.equal(got.indices.long(), want.indices.long())


def test_hello_round_trips_its_layout_and_sample_count():
    out = roundtrip(Hello(3, LAYOUT, 1438))
    assert (out.sender, out.layout, out.train_samples) == (3, LAYOUT, 1438)


def test_hello_round_trips_a_stream_without_a_sample_count():
    assert roundtrip(Hello(1, LAYOUT, None)).train_samples is None


def test_welcome_round_trips_the_plan():
    frame = Welcome((5, 11), (0.25, 0.01), 400, start_step=120)
    assert roundtrip(frame) == frame


def test_route_round_trips_forwards_and_peer_addresses():
    route = Route(7, (3, 5), {5: ("10.0.0.9", 40123)})
    assert unpack(pack(route)) == route


def test_route_round_trips_a_new_update_source():
    route = Route(7, (), source=0)
    assert unpack(pack(route)).source == 0 and unpack(pack(Route(7, ()))).source is None


def test_state_round_trips_parameters_and_buffers():
    params, buffers = torch.randn(720), torch.randn(16)
    out = roundtrip(State(1, params, buffers))
    assert out.sender == 1
    assert torch.equal(out.params, params) and torch.equal(out.buffers, buffers)


def test_state_flattens_parameters_to_fp32():
    out = roundtrip(State(1, torch.ones(2, 3, dtype=torch.float64), torch.zeros(0)))
    assert out.params.dtype == torch.float32 and out.params.shape == (6,)
    assert out.buffers.numel() == 0


def test_grad_round_trips_its_scalars_and_both_payloads():
    d, s = dense([1.0, -2.0, 3.5]), sparse(1000, [3, 400, 999], [0.5, -0.25, 8.0])
    out = roundtrip(Grad(7, 2, 1, 0.693, 32, 0.012, 0.004, 0.001, d, s, site_s=0.25))
    assert (out.step, out.sender, out.chunk, out.samples) == (7, 2, 1, 32)
    assert (out.loss, out.compute_s, out.last_tx_s, out.topk_s, out.site_s) == (0.693, 0.012, 0.004, 0.001, 0.25)
    assert_payload_equal(out.dense, d)
    assert_payload_equal(out.sparse, s)


def test_grad_round_trips_a_nan_loss():
    out = roundtrip(Grad(1, 1, 0, math.nan, 8, 0.0, 0.0, 0.0, dense([0.0]), sparse(10, [1], [1.0])))
    assert math.isnan(out.loss)


def test_grad_round_trips_a_seeded_random_k_payload():
    idx = random_indices(5000, 50, seed=42)
    payload = Payload(5000, torch.randn(50), idx, seed=42)
    out = roundtrip(Grad(2, 1, 0, 1.0, 8, 0.0, 0.0, 0.0, dense([1.0]), payload))
    assert out.sparse.seed == 42
    assert_payload_equal(out.sparse, payload)


def test_grad_round_trips_fp16_values():
    payload = Payload(100, torch.tensor([0.5, -1.5], dtype=torch.float16), torch.tensor([10, 90]))
    out = roundtrip(Grad(2, 1, 0, 1.0, 8, 0.0, 0.0, 0.0, dense([1.0]), payload))
    assert out.sparse.values.dtype == torch.float16
    assert_payload_equal(out.sparse, payload)


def test_grad_round_trips_fp8_values_and_their_scale():
    values = torch.tensor([448.0, -0.5, 2.0]).to(torch.float8_e4m3fn)
    payload = Payload(100, values, torch.tensor([3, 40, 99]), scale=2.0**-18)  # scales travel as fp32
    out = roundtrip(Grad(2, 1, 0, 1.0, 8, 0.0, 0.0, 0.0, dense([1.0]), payload))
    assert out.sparse.values.dtype == torch.float8_e4m3fn
    assert out.sparse.scale == payload.scale
    assert_payload_equal(out.sparse, payload)
    assert out.sparse.decoded()[0] == 448 * 2.0**-18


def test_update_round_trips_loss_densities_and_batch_sizes():
    d, s = dense([0.1, 0.2]), sparse(64, [0, 63], [1.0, -1.0])
    out = roundtrip(Update(9, 3, d, s, loss=1.25, densities=(0.1, 0.05, 0.2), batch_sizes=(8, 4, 20)))
    assert (out.step, out.chunk, out.loss) == (9, 3, 1.25)
    assert out.densities == (0.1, 0.05, 0.2) and out.batch_sizes == (8, 4, 20)
    assert_payload_equal(out.dense, d)
    assert_payload_equal(out.sparse, s)


def test_update_of_a_middle_chunk_round_trips_without_densities_and_a_nan_loss():
    out = roundtrip(Update(9, 0, dense([1.0]), sparse(8, [], [])))
    assert math.isnan(out.loss)
    assert out.densities == () and out.batch_sizes == ()
    assert out.sparse.count == 0 and out.sparse.numel == 8


def test_buffers_round_trip_their_values_and_sample_weight():
    values = torch.randn(16)
    out = roundtrip(Buffers(4, 2, 24, values))
    assert (out.step, out.sender, out.samples) == (4, 2, 24)
    assert torch.equal(out.values, values)


def test_averaged_buffers_round_trip():
    values = torch.randn(16)
    out = roundtrip(BuffersAvg(4, values))
    assert out.step == 4 and torch.equal(out.values, values)


def test_a_site_members_gradient_piece_round_trips_its_samples_and_exact_values():
    values = torch.randn(16)
    out = roundtrip(SiteGrad(7, 4, 2, 24, values))
    assert (out.step, out.sender, out.piece, out.samples) == (7, 4, 2, 24)
    assert torch.equal(out.values, values)


def test_a_sites_mean_piece_round_trips_its_exact_values():
    values = torch.randn(16)
    out = roundtrip(SiteMean(7, 3, 1, values))
    assert (out.step, out.sender, out.piece) == (7, 3, 1) and torch.equal(out.values, values)


def test_bf16_site_pieces_round_trip_exactly_at_two_bytes_a_value():
    values = torch.randn(1000).to(torch.bfloat16)
    grad, mean = SiteGrad(7, 4, 2, 24, values), SiteMean(7, 3, 1, values)
    assert pack(grad).numel() == pack(SiteGrad(7, 4, 2, 24, values.float())).numel() - 2 * 1000
    for out in (roundtrip(grad), roundtrip(mean)):
        assert out.values.dtype == torch.bfloat16 and torch.equal(out.values, values)


def test_eval_round_trips_sums_with_unicode_metric_names():
    frame = Eval(50, 2, {"accuracy": 97.0, "val_loss": 12.5, "précision_µ": 3.0, "損失": 1.5}, 120)
    assert roundtrip(frame) == frame


def test_eval_round_trips_no_metrics():
    frame = Eval(50, 1, {}, 0)
    assert roundtrip(frame) == frame


def test_eval_result_round_trips_values_and_the_stop_flag():
    for stop in (True, False):
        frame = EvalResult(50, {"accuracy": 0.91, "val_loss": 0.3}, stop)
        assert roundtrip(frame) == frame


def test_bye_round_trips():
    assert roundtrip(Bye(400, 3)) == Bye(400, 3)


def test_abort_round_trips_a_unicode_reason():
    frame = Abort(2, "worker 2: CUDA out of memory — batch 512 × 3 GiB")
    assert roundtrip(frame) == frame


def test_unpack_rejects_an_unknown_kind():
    raw = pack(Bye(1, 1)).clone()
    raw[3] = 200
    with pytest.raises(ProtocolError, match="unknown frame kind 200"):
        unpack(raw)


def test_expect_returns_the_frame_of_the_expected_kind_and_step():
    assert expect(pack(Bye(5, 2)), Bye, 5) == Bye(5, 2)


def test_expect_names_the_expected_and_the_actual_kind():
    with pytest.raises(ProtocolError, match=r"expected GRAD from rank 2, got BYE"):
        expect(pack(Bye(5, 2)), Grad, peer=2)


def test_expect_names_the_wanted_and_the_actual_step():
    with pytest.raises(ProtocolError, match=r"expected BYE of step 6 from the peer, got step 5"):
        expect(pack(Bye(5, 2)), Bye, 6)


def test_expect_raises_an_aborts_reason():
    with pytest.raises(ProtocolError, match=r"^worker 3 ran out of memory$"):
        expect(pack(Abort(3, "worker 3 ran out of memory")), Update, 4)


def test_check_takes_a_frame_unpacked_already_as_expect_takes_raw_bytes():
    frame = unpack(pack(Bye(5, 2)))
    assert check(frame, Bye, 5, peer=2) is frame
    with pytest.raises(ProtocolError, match=r"expected GRAD from rank 2, got BYE"):
        check(frame, Grad, peer=2)


def test_layout_difference_is_none_for_equal_layouts():
    assert LAYOUT.difference(LayoutSpec(LAYOUT.names, LAYOUT.numels, 80, 16)) is None


def test_layout_difference_names_a_parameter_missing_on_one_side():
    other = LayoutSpec(("conv.weight", "conv.bias", "head.weight"), (72, 8, 640), 80, 16)
    text = LAYOUT.difference(other)
    assert "fc.weight" in text and "head.weight" in text


def test_layout_difference_names_a_parameter_of_another_size():
    other = LayoutSpec(LAYOUT.names, (72, 8, 1280), 80, 16)
    assert LAYOUT.difference(other) == "parameter fc.weight has 640 elements on one side and 1280 on the other"


def test_layout_difference_names_a_reordering():
    other = LayoutSpec(tuple(reversed(LAYOUT.names)), tuple(reversed(LAYOUT.numels)), 80, 16)
    assert "different order" in LAYOUT.difference(other)


def test_layout_difference_names_a_buffer_size_difference():
    other = LayoutSpec(LAYOUT.names, LAYOUT.numels, 80, 32)
    assert "buffers 16 vs 32" in LAYOUT.difference(other)


def test_layout_counts_its_dense_and_sparse_parts():
    assert (LAYOUT.numel, LAYOUT.sparse_numel) == (720, 640)


def test_state_carries_its_optimizer_bytes_exactly_and_as_they_are():
    # Raw bytes, not base64 text: a checkpoint's optimizer state is as large as the model.
    optimizer = bytes(range(256)) * 40
    params = torch.randn(720)
    raw = pack(State(1, params, torch.zeros(0), 5, optimizer))
    assert unpack(raw).optimizer == optimizer
    assert raw.numel() < 4 * params.numel() + len(optimizer) + 100


def test_state_without_optimizer_state_round_trips_empty():
    assert roundtrip(State(1, torch.ones(3), torch.zeros(0))).optimizer == b""


def test_a_frames_head_is_read_without_decoding_its_payloads():
    from trainer.wire import peek_head

    update = Update(12, 3, Payload(4, torch.arange(4.0)), Payload(0, torch.zeros(0)), 0.5)
    assert peek_head(pack(update)) == (Update.kind, 12, 3.0)
    assert peek_head(pack(Bye(7, 2, leaving=True))) == (Bye.kind, 7, 1.0)
