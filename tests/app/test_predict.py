"""The performance model on hand-computed cases: one link, two sites sharing a pipe, a relay
saving a WAN copy, the all-reduce ring paced by its slowest link, pipelining, warm-up, dense
frames' encode and decode, PowerSGD's work, the densities' path and fixed point, and an hour of
it priced through the bill, and local SGD with sites as replicas."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from app.billing import EgressKey, InstanceKey, InstancePrice, NodeUsage, Provider, Site, StaticPriceTable, TrafficClass
from app.perfmodel.predict import (
    BACKWARD_SHARE,
    DDP_OVERLAP,
    PIPELINE_EFFICIENCY,
    CompressionSpec,
    LinkSpec,
    NodeSpec,
    PredictError,
    TaskSpec,
    predict,
    predict_costs,
)
from app.perfmodel.steps import chunk_pipeline
from hybridtrain.wiresize import grad_frame_bytes, kept_for, update_frame_bytes

T0 = datetime(2024, 1, 1, tzinfo=UTC)
TASK = TaskSpec(params=1000, dense_params=100, buffer_numel=0)
DENSE_UP = 8 + 23 + 7 * 8 + (10 + 100 * 4) + (10 + 900 * 4)  # GRAD, both payloads fp32


def node(i: int, site: int = 1, sps: float = 100.0, *, agg: float = 0.0, wc: float = 0.0, sc: float = 0.0,
         dagg: float = 0.0, denc: float = 0.0, psgd: float = 0.0, psgd_rank: int = 0) -> NodeSpec:
    return NodeSpec(i, f"n{i}", site, sps, worker_compress_s=wc, server_compress_s=sc, aggregate_s=agg,
                    dense_aggregate_s_per_element=dagg, dense_encode_s_per_element=denc, powersgd_s=psgd,
                    powersgd_rank=psgd_rank)


def mesh(nodes, lan=LinkSpec(1000, 1.0, "assumed"), wan=LinkSpec(100, 40.0, "assumed"), **overrides):
    """A link for every ordered pair: `lan` within a site, `wan` across; overrides by id pair."""
    links = {(a.node_id, b.node_id): (lan if a.site_id == b.site_id else wan)
             for a in nodes for b in nodes if a.node_id != b.node_id}
    links.update(overrides)
    return links


def xfer(nbytes: float, mbps: float, rtt_ms: float) -> float:
    return nbytes * 8 / (mbps * 1e6) + rtt_ms / 2000


def test_one_link_dense_step_adds_compute_encode_upload_server_download_and_decode():
    w, s = node(1, dagg=4e-6, denc=3e-6), node(2, agg=0.5, dagg=1e-6, denc=2e-6)
    link = LinkSpec(100, 10.0, "measured")
    p = predict("ps", workers=[(w, 10)], server=s, links={(1, 2): link, (2, 1): link}, task=TASK)
    down = 8 + 23 + (3 + 2) * 8 + (10 + 400) + (10 + 3600)
    assert DENSE_UP == grad_frame_bytes(100, 900, None) and down == update_frame_bytes(100, 900, None, workers=1)
    # All 1000 elements dense: the worker encodes them, the server decodes and adds its one frame
    # and encodes the update (aggregate_s is a compressed frame's, unused), the worker decodes.
    expected = 10 / 100 + 1000 * 3e-6 + xfer(DENSE_UP, 100, 10) + 1000 * (1e-6 + 2e-6) + xfer(down, 100, 10) + 1000 * 4e-6
    assert p.step_s == pytest.approx(expected, rel=1e-12)
    assert p.samples_per_s == pytest.approx(10 / expected)
    assert p.bytes_per_step == [(1, 2, DENSE_UP), (2, 1, down)]
    assert p.breakdown["upload_s"] == pytest.approx(xfer(DENSE_UP, 100, 10))


def test_two_cloud_workers_share_one_site_to_site_pipe():
    s, a, b = node(1, site=1), node(2, site=2), node(3, site=2)
    p = predict("ps", workers=[(a, 8), (b, 8)], server=s, links=mesh([s, a, b]), task=TASK, relay=False)
    assert [r["upload_s"] for r in p.per_worker] == pytest.approx([xfer(2 * DENSE_UP, 100, 40)] * 2)


def test_cloud_workers_whose_compute_ends_far_apart_each_have_the_pipe_to_themselves():
    # b computes 0.8 s, a 0.08 s: a's upload (37 ms) is long done when b's starts.
    s, a, b = node(1, site=1), node(2, site=2), node(3, site=2, sps=10)
    p = predict("ps", workers=[(a, 8), (b, 8)], server=s, links=mesh([s, a, b]), task=TASK, relay=False)
    assert [r["upload_s"] for r in p.per_worker] == pytest.approx([xfer(DENSE_UP, 100, 40)] * 2)


def test_an_upload_that_starts_while_another_is_under_way_shares_its_pipe():
    # b's compute ends 9 ms after a's, within a's upload (20 ms).
    s, a, b = node(1, site=1), node(2, site=2), node(3, site=2, sps=90)
    p = predict("ps", workers=[(a, 8), (b, 8)], server=s, links=mesh([s, a, b]), task=TASK, relay=False)
    assert [r["upload_s"] for r in p.per_worker] == pytest.approx([xfer(2 * DENSE_UP, 100, 40)] * 2)


def test_granularity_is_compute_over_upload_and_download():
    s, a = node(1, site=1), node(2, site=2, sps=50)
    p = predict("ps", workers=[(a, 10)], server=s, links=mesh([s, a]), task=TASK)
    row = p.per_worker[0]
    assert row["comm_s"] == pytest.approx(row["upload_s"] + row["download_s"])
    assert p.granularity == pytest.approx(0.2 / row["comm_s"])
    assert row["granularity"] == pytest.approx(p.granularity)


def test_relay_sends_the_update_across_the_wan_once():
    s, a, b = node(1, site=1), node(2, site=2), node(3, site=2)
    links = mesh([s, a, b])
    direct = predict("ps", workers=[(a, 8), (b, 8)], server=s, links=links, task=TASK, relay=False)
    relayed = predict("ps", workers=[(a, 8), (b, 8)], server=s, links=links, task=TASK, relay=True)
    down = update_frame_bytes(100, 900, None, workers=2)
    wan_bytes = lambda p: sum(n for src, dst, n in p.bytes_per_step if src == 1)  # noqa: E731
    assert wan_bytes(direct) == 2 * down and wan_bytes(relayed) == down
    assert (2, 3, down) in relayed.bytes_per_step
    assert direct.per_worker[1]["download_s"] == pytest.approx(xfer(2 * down, 100, 40))
    assert relayed.per_worker[1]["download_s"] == pytest.approx(xfer(down, 100, 40) + xfer(down, 1000, 1))
    assert relayed.per_worker[0]["relay_for"] == [3]


def test_allreduce_ring_is_paced_by_its_slowest_link():
    nodes = [node(1, sps=1e6), node(2, sps=1e6), node(3, sps=1e6)]
    links = mesh(nodes)
    links[(2, 3)] = LinkSpec(10, 1.0, "measured")
    p = predict("allreduce", workers=[(n, 4) for n in nodes], server=None, links=links, task=TASK)
    ring = 2 * 2 * xfer(4000 / 3, 10, 1.0)
    compute = 4 / 1e6
    assert p.breakdown["upload_s"] == pytest.approx(ring)
    assert p.step_s == pytest.approx(compute + ring - DDP_OVERLAP * BACKWARD_SHARE * compute)
    assert p.bytes_per_step == [(1, 2, round(2 * 2 / 3 * 4000)), (2, 3, round(2 * 2 / 3 * 4000)),
                                (3, 1, round(2 * 2 / 3 * 4000))]


def test_allreduce_hides_part_of_the_ring_behind_the_backward_pass():
    nodes = [node(1, sps=10), node(2, sps=10)]
    p = predict("allreduce", workers=[(n, 10) for n in nodes], server=None, links=mesh(nodes), task=TASK)
    ring = p.breakdown["upload_s"]
    assert ring < BACKWARD_SHARE * 1.0
    assert p.step_s == pytest.approx(1.0 + (1 - DDP_OVERLAP) * ring)


def test_powersgd_factors_follow_the_matrix_shapes():
    nodes = [node(1, sps=1e6), node(2, sps=1e6)]
    task = TaskSpec(params=100 * 100 + 100, dense_params=100, matrix_shapes=((100, 100),))
    p = predict("allreduce-powersgd", workers=[(n, 2) for n in nodes], server=None, links=mesh(nodes), task=task,
                compression=CompressionSpec(powersgd_start=2), max_steps=1000)
    # (100 + 100) * 2 factor elements + the 100 biases, fp32, 2(W-1)/W = 1 of it per worker.
    steady = (400 + 100) * 4
    warm = 10100 * 4
    assert dict(((s, d), b) for s, d, b in p.bytes_per_step)[(1, 2)] == round((998 * steady + 2 * warm) / 1000)


def test_one_chunk_is_the_plain_step():
    assert chunk_pipeline([1.0], [0.2], [0.4], [0.0], 0.6, [0.4], [0.2], 1) == pytest.approx(2.8)


def test_two_chunks_overlap_compression_upload_server_and_download():
    # chunk 0: compressed by 1.1, sent by 1.3, summed by 1.6, back by 1.8, applied by 1.9;
    # chunk 1: compressed by 1.2, sent by 1.5, summed by 1.9, back by 2.1, applied by 2.2.
    assert chunk_pipeline([1.0], [0.2], [0.4], [0.0], 0.6, [0.4], [0.2], 2) == pytest.approx(2.2)


def test_a_worker_applies_the_updates_only_once_its_own_sends_are_done():
    # The first update is back at 0.5, but the worker still sends until 1.0 (trainer/ps.py
    # waits for its sends before it reads an update): 1.0 + 0.2 + 0.2, not 1.0 + 0.2.
    assert chunk_pipeline([0.0], [0.0], [1.0], [0.0], 0.0, [0.0], [0.4], 2) == pytest.approx(1.4)


def test_the_server_takes_a_chunk_once_every_worker_has_sent_it():
    # The slow worker's chunks arrive at 1.5 and 2.0: the server sums at 1.5-1.6 and 2.0-2.1.
    step = chunk_pipeline([0.0, 1.0], [0.0, 0.0], [0.2, 1.0], [0.0, 0.0], 0.2, [0.0, 0.0], [0.0, 0.0], 2)
    assert step == pytest.approx(2.1)


def test_a_chunks_latency_is_paid_once_not_in_series():
    # Up: 0.2 s of bytes + 0.1 s latency; each chunk's bytes leave 0.1 s apart and land 0.1 s
    # later (0.2, 0.3); the updates likewise (0.4, 0.5).
    assert chunk_pipeline([0.0], [0.0], [0.3], [0.1], 0.0, [0.3], [0.0], 2) == pytest.approx(0.5)


def test_pipelined_ps_step_gets_its_share_of_the_chunks_timeline():
    w, s = node(1, sps=1e9), node(2, agg=0.01, dagg=1e-7)
    links = mesh([w, s], lan=LinkSpec(100, 0.0, "measured"))
    task = TaskSpec(params=100_100, dense_params=100)
    one = predict("ps", workers=[(w, 1)], server=s, links=links, task=task)
    two = predict("ps", workers=[(w, 1)], server=s, links=links, task=task,
                  compression=CompressionSpec(pipeline_chunks=2))
    up, srv, down = (two.breakdown[k] for k in ("upload_s", "server_s", "download_s"))
    sent = [1e-9 + up / 2, 1e-9 + up]
    summed = [sent[0] + srv / 2, max(sent[0] + srv / 2, sent[1]) + srv / 2]
    back = [summed[0] + down / 2, max(summed[1], summed[0] + down / 2) + down / 2]
    plain = 1e-9 + up + srv + down
    assert two.step_s == pytest.approx(plain + PIPELINE_EFFICIENCY * (max(sent[1], back[1]) - plain))
    assert two.breakdown["overlap_s"] == pytest.approx(two.step_s - plain)
    assert two.step_s < one.step_s


def test_compression_costs_move_along_their_line_with_what_is_kept():
    n = NodeSpec(1, "n1", 1, 100.0, worker_compress_s=0.05, worker_compress_s_per_kept=1e-8,
                 worker_compress_density=0.01)
    # 1M elements at 0.1 keep 90,000 more than at 0.01: 0.05 s + 90,000 x 1e-8 s.
    assert n.worker_compress_at(1_000_000, 0.1) == pytest.approx(0.05 + 0.0009)
    assert n.worker_compress_at(1_000_000, 0.01) == pytest.approx(0.05)


def test_a_profile_without_the_slope_keeps_compression_flat_in_k():
    assert node(1, wc=0.05, sc=0.02).worker_compress_at(1_000_000, 0.1) == 0.05
    assert node(1, wc=0.05, sc=0.02).server_compress_at(1_000_000, 0.5) == 0.02


def test_compressed_server_zeroes_the_sum_once_and_decodes_each_frame_at_its_density():
    s = NodeSpec(1, "n1", 1, 100.0, aggregate_s=0.03, aggregate_s_per_kept=1e-6, aggregate_fixed_s=0.01,
                 server_compress_s=0.02, server_compress_s_per_kept=2e-6, worker_compress_density=0.01,
                 server_compress_k_fraction=0.1)
    a, b = node(2), node(3)
    task = TaskSpec(params=10_100, dense_params=100)
    p = predict("ps-gc", workers=[(a, 8), (b, 8)], server=s, links=mesh([s, a, b]), task=task,
                densities=[0.02, 0.05], compression=CompressionSpec(server_k_fraction=0.2))
    # Frames: 0.03 - 0.01 + (200 - 100) x 1e-6 and 0.03 - 0.01 + (500 - 100) x 1e-6; the zeroing
    # once; the update at k 0.2: 0.02 + (2000 - 1000) x 2e-6.
    assert p.breakdown["server_s"] == pytest.approx(0.01 + 0.0201 + 0.0204 + 0.022)


def test_dense_server_decodes_every_workers_frame_and_encodes_the_update_once():
    s, a, b = node(1, agg=0.5, sc=0.5, dagg=1e-6, denc=2e-6), node(2), node(3)
    p = predict("ps", workers=[(a, 8), (b, 8)], server=s, links=mesh([s, a, b]), task=TASK)
    assert p.breakdown["server_s"] == pytest.approx(2 * 1000 * 1e-6 + 1000 * 2e-6)


def test_compressed_server_pays_dense_costs_on_the_dense_part_only():
    s, a, b = node(1, agg=0.01, sc=0.02, dagg=1e-6, denc=2e-6), node(2, wc=0.03, denc=5e-6), node(3)
    p = predict("ps-gc", workers=[(a, 8), (b, 8)], server=s, links=mesh([s, a, b]), task=TASK)
    # 100 dense elements: decoded twice and encoded once at the server, encoded at each worker.
    assert p.breakdown["server_s"] == pytest.approx(2 * (0.01 + 100 * 1e-6) + 0.02 + 100 * 2e-6)
    assert p.per_worker[0]["compress_s"] == pytest.approx(0.03 + 100 * 5e-6)


def test_powersgd_steps_add_each_workers_factorisation_before_the_ring():
    fast, slow = node(1, sps=100, psgd=0.2, psgd_rank=2), node(2, sps=100, psgd=0.5, psgd_rank=2)
    task = TaskSpec(params=100 * 100 + 100, dense_params=100, matrix_shapes=((100, 100),))
    links = mesh([fast, slow], lan=LinkSpec(8, 0.0, "measured"))
    comp = CompressionSpec(powersgd_rank=4)
    p = predict("allreduce-powersgd", workers=[(fast, 10), (slow, 10)], server=None, links=links, task=task,
                compression=comp)
    # Rank 4 doubles the profile's rank-2 work: 1.0 s on the slow node, after its 0.1 s compute;
    # the ring moves (200 * 4 + 100) fp32 elements, half of them each of 2 rounds, at 8 Mbit/s.
    ring = 2 * xfer((200 * 4 + 100) * 4 / 2, 8, 0.0)
    assert p.step_s == pytest.approx(0.1 + 1.0 + ring)
    assert p.breakdown["compress_s"] == pytest.approx(1.0)


def test_a_profile_without_dense_costs_is_named_in_the_assumptions():
    old, measured = node(1, site=1), node(2, site=2, dagg=1e-9, denc=1e-9)
    p = predict("ps", workers=[(measured, 8)], server=old, links=mesh([old, measured]), task=TASK)
    [note] = [a for a in p.assumptions if "not in the profile" in a]
    assert "of n1:" in note and "n2" not in note


def _fast_and_slow_uplink():
    """A server and two workers, each in its own site: one uploads at 200 Mbit/s, one at 50."""
    s, fast, slow = node(1, site=1), node(2, site=2), node(3, site=3)
    links = mesh([s, fast, slow], wan=LinkSpec(200, 0.0, "measured"))
    links[(3, 1)] = LinkSpec(50, 0.0, "measured")
    return s, fast, slow, links, TaskSpec(params=2_000_000, dense_params=0)


def test_densities_follow_the_rules_path_from_the_target():
    s, fast, slow, links, task = _fast_and_slow_uplink()
    comp = CompressionSpec(warmup_steps=2, density_time_floor_s=0.0)
    p = predict("ps-gc", workers=[(fast, 10), (slow, 10)], server=s, links=links, task=task, compression=comp,
                max_steps=40)
    # Equal bytes at equal densities, each timed at its own link's rate as the trainer's link
    # clock times it (b / 200, b / 50): times 1 : 4, so step 5 moves the densities by
    # (T_mean / T_m)^0.5, renormalised to the target: x sqrt(2) and / sqrt(2).
    dense, first, second = p.phases[:3]
    assert (dense["first_step"], dense["last_step"], dense["densities"]) == (1, 2, [1.0, 1.0])
    assert (first["first_step"], first["last_step"], first["densities"]) == (3, 4, [0.01, 0.01])
    assert (second["first_step"], second["last_step"]) == (5, 5)
    assert second["densities"] == pytest.approx([0.01 * 2 ** 0.5, 0.01 / 2 ** 0.5])
    assert p.phases[-1]["last_step"] == 40
    assert p.time_to_max_steps_s == pytest.approx(
        sum((ph["last_step"] - ph["first_step"] + 1) * ph["step_s"] for ph in p.phases))


def test_diloco_gcs_densities_follow_the_rules_path_one_outer_step_a_round():
    s, fast, slow, links, task = _fast_and_slow_uplink()
    comp = CompressionSpec(sync_every=10, density_time_floor_s=0.0)
    p = predict("diloco-gc", workers=[(fast, 10), (slow, 10)], server=s, links=links, task=task, compression=comp,
                max_steps=100)
    # Rounds of H = 10 inner steps: the first two at outer_density (the rule reads the step
    # before), then each round's densities one adaptation further, as the ps-gc path above.
    first, second = p.phases[:2]
    assert (first["first_step"], first["last_step"], first["densities"]) == (1, 20, [0.1, 0.1])
    assert (second["first_step"], second["last_step"]) == (21, 30)
    assert second["densities"] == pytest.approx([0.1 * 2 ** 0.5, 0.1 / 2 ** 0.5])
    assert p.phases[-1]["last_step"] == 100 and p.phases[-1]["densities"] == pytest.approx([0.2, 0.05])


def test_a_short_run_averages_its_transient_not_just_the_fixed_point():
    s, fast, slow, links, task = _fast_and_slow_uplink()
    comp = CompressionSpec(warmup_steps=0, density_time_floor_s=0.0)
    settled = predict("ps-gc", workers=[(fast, 10), (slow, 10)], server=s, links=links, task=task, compression=comp)
    short = predict("ps-gc", workers=[(fast, 10), (slow, 10)], server=s, links=links, task=task, compression=comp,
                    max_steps=3)
    # Steps 1 and 2 run at the target 0.01 (the slow worker sends more than at its fixed point),
    # step 3 at the first adapted densities.
    slow_bytes = lambda p: dict(((a, b), n) for a, b, n in p.bytes_per_step)[(3, 1)]  # noqa: E731
    at = lambda d: grad_frame_bytes(0, 2_000_000, kept_for(2_000_000, d))  # noqa: E731
    assert slow_bytes(short) == pytest.approx((2 * at(0.01) + at(0.01 / 2 ** 0.5)) / 3, abs=1)
    assert slow_bytes(short) > slow_bytes(settled)


def test_warmup_steps_are_amortised_over_max_steps():
    s, a = node(1, site=1), node(2, site=2, wc=0.001, sc=0.002)
    links = mesh([s, a])
    task = TaskSpec(params=200_000, dense_params=1000)
    comp = CompressionSpec(warmup_steps=5)
    dense = predict("ps", workers=[(a, 10)], server=s, links=links, task=task)
    steady = predict("ps-gc", workers=[(a, 10)], server=s, links=links, task=task, compression=comp)
    mixed = predict("ps-gc", workers=[(a, 10)], server=s, links=links, task=task, compression=comp, max_steps=20)
    assert mixed.time_to_max_steps_s == pytest.approx(5 * dense.step_s + 15 * steady.step_s)
    assert mixed.step_s == pytest.approx(mixed.time_to_max_steps_s / 20)


def test_compressed_upload_counts_the_kept_elements():
    s, a = node(1), node(2)
    task = TaskSpec(params=1_000_000, dense_params=1000)
    p = predict("ps-gc", workers=[(a, 10)], server=s, links=mesh([s, a]), task=task)
    assert p.per_worker[0]["upload_bytes"] == grad_frame_bytes(1000, 999_000, kept_for(999_000, 0.01))


def test_adaptive_densities_settle_in_proportion_to_bandwidth():
    s, fast, slow = node(1, site=1), node(2, site=2), node(3, site=3)
    task = TaskSpec(params=20_000_000, dense_params=0)
    links = mesh([s, fast, slow], wan=LinkSpec(200, 0.0, "measured"))
    links[(3, 1)] = LinkSpec(50, 0.0, "measured")
    p = predict("ps-bz-gc", workers=[(fast, 10), (slow, 10)], server=s, links=links, task=task)
    d_fast, d_slow = (r["density"] for r in p.per_worker)
    # The rule's fixed point: equal send times at each link's own rate (a frame's bytes per kept
    # element fall as the density rises, so the densities differ by a little more than 4x).
    up = lambda d: grad_frame_bytes(0, 20_000_000, kept_for(20_000_000, d))  # noqa: E731
    assert up(d_fast) / 200 == pytest.approx(up(d_slow) / 50, rel=0.02)
    assert math.sqrt(d_fast * d_slow) == pytest.approx(0.01, rel=1e-6)


def test_predict_names_the_missing_link():
    with pytest.raises(PredictError) as err:
        predict("ps", workers=[(node(1), 4)], server=node(2), links={}, task=TASK)
    assert err.value.field == "links"


def test_predict_refuses_a_ps_strategy_without_a_server():
    with pytest.raises(PredictError) as err:
        predict("ps-gc", workers=[(node(1), 4)], server=None, links={}, task=TASK)
    assert err.value.field == "server"


def test_a_worker_on_the_server_node_uses_loopback():
    s = node(1)
    p = predict("ps", workers=[(s, 4)], server=s, links={}, task=TASK)
    assert p.bytes_per_step == [] and p.per_worker[0]["upload_s"] < 1e-4


ONPREM = Site("lab", "onprem", "onprem", "europe")
CLOUD = Site("gcp-eu", "cloud", "gcp", "europe", "europe-west1", "b")
PRICES = StaticPriceTable(
    egress=[(EgressKey(Provider.gcp, TrafficClass.internet), T0, Decimal("0.1"))],
    instances=[(InstanceKey(Provider.gcp, "europe-west1", "g1", "T4", 1), T0,
                InstancePrice(Decimal("0.3"), Decimal("0.9")))],
)


def test_an_hour_is_priced_through_the_bill():
    s, c = node(1, site=1), node(2, site=2)
    p = predict("ps", workers=[(c, 10)], server=s, links=mesh([s, c]), task=TASK)
    usage = [NodeUsage("n1", ONPREM, 0, amortised_usd_per_hour=Decimal("1.0")),
             NodeUsage("n2", CLOUD, 0, instance_type="g1", gpu_model="T4")]
    costs = predict_costs(p, nodes=usage, prices=PRICES, at=T0)
    steps = 3600 / p.step_s
    up_bytes = round(DENSE_UP * steps)
    assert costs.egress_usd_per_h == pytest.approx(up_bytes / 2**30 * 0.1, abs=1e-6)
    assert costs.compute_usd_per_h == pytest.approx(1.9)
    assert costs.bytes_by_class_per_hour["internet"] == up_bytes + round(
        update_frame_bytes(100, 900, None, workers=1) * steps)
    total = costs.egress_usd_per_h + costs.compute_usd_per_h
    assert costs.usd_per_million_samples == pytest.approx(total * 1e6 / (p.samples_per_s * 3600))
    assert costs.egress_share == pytest.approx(costs.egress_usd_per_h / total)


def test_predict_costs_names_a_plan_node_without_pricing():
    s, c = node(1, site=1), node(2, site=2)
    p = predict("ps", workers=[(c, 10)], server=s, links=mesh([s, c]), task=TASK)
    with pytest.raises(PredictError) as err:
        predict_costs(p, nodes=[NodeUsage("n1", ONPREM, 0)], prices=PRICES, at=T0)
    assert err.value.field == "nodes" and "n2" in err.value.message


def test_prediction_to_dict_is_json_ready():
    import json

    s, c = node(1, site=1), node(2, site=2)
    p = predict("ps-bz-gc", workers=[(c, 10)], server=s, links=mesh([s, c]), task=TASK, max_steps=50)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["strategy"] == "ps-bz-gc" and d["bytes_per_step"][0]["src_node_id"] == 1


def test_evaluation_is_amortised_over_the_steps_when_the_held_out_size_is_known():
    w = node(1, sps=100)
    task = TaskSpec(params=1000, dense_params=100, eval_samples=300)
    base = predict("allreduce", workers=[(w, 10)], server=None, links={}, task=TASK, max_steps=120)
    with_eval = predict("allreduce", workers=[(w, 10)], server=None, links={}, task=task, max_steps=120,
                        compression=CompressionSpec(eval_every=50))
    # Steps 50, 100 and the last (120): three evaluations of 300 samples at 3 x 100 samples/s.
    assert with_eval.time_to_max_steps_s == pytest.approx(base.time_to_max_steps_s + 3 * 1.0)


def test_specs_build_from_a_task_profile():
    profile = {"params": 3352906, "dense_params": 2698, "buffer_numel": 2688, "eval_samples": 359,
               "samples_per_s": 105.3, "worker_compress_s": 0.0071, "server_compress_s": 0.0158,
               "aggregate_s": 0.0040}
    task = TaskSpec.from_profile(profile)
    node_spec = NodeSpec.from_profile(7, "op1", 2, profile)
    assert (task.sparse_params, task.eval_samples) == (3352906 - 2698, 359)
    assert (node_spec.samples_per_s, node_spec.aggregate_s) == (105.3, 0.0040)


def test_local_sgd_pays_its_compute_and_an_h_th_of_a_ps_steps_exchange_each_step():
    w, s = node(1), node(2)
    link = LinkSpec(100, 10.0, "measured")
    links = {(1, 2): link, (2, 1): link}
    ps = predict("ps", workers=[(w, 10)], server=s, links=links, task=TASK)
    fp32 = CompressionSpec(value_bytes=4, sync_every=10)
    local = predict("diloco", workers=[(w, 10)], server=s, links=links, task=TASK, compression=fp32)
    compute = ps.breakdown["compute_s"]
    assert local.step_s == pytest.approx(compute + (ps.step_s - compute) / 10)
    # Its bytes a step are a tenth of a PS step's; at fp16 a twentieth.
    assert local.bytes_per_step[0][2] == round(ps.bytes_per_step[0][2] / 10)
    fp16 = predict("diloco", workers=[(w, 10)], server=s, links=links, task=TASK,
                   compression=CompressionSpec(sync_every=10))
    assert fp16.bytes_per_step[0][2] == round(ps.bytes_per_step[0][2] / 20)
    assert any("every 10 steps" in note for note in local.assumptions)


def test_an_overlapped_outer_exchange_hides_up_to_its_delays_compute():
    w, s = node(1, sps=10.0), node(2)
    link = LinkSpec(1, 10.0, "measured")  # slow: the exchange outlasts a step's compute
    links = {(1, 2): link, (2, 1): link}
    spec = CompressionSpec(value_bytes=4, sync_every=10)
    waits = predict("diloco", workers=[(w, 10)], server=s, links=links, task=TASK, compression=spec)
    overlapped = predict("diloco", workers=[(w, 10)], server=s, links=links, task=TASK,
                         compression=replace(spec, outer_delay=2))
    compute = waits.breakdown["compute_s"]
    exchange = waits.breakdown["outer_exchange_s"] * 10
    assert overlapped.breakdown["outer_exchange_s"] == pytest.approx(max(0.0, exchange - 2 * compute) / 10)
    assert overlapped.step_s < waits.step_s and overlapped.bytes_per_step == waits.bytes_per_step


def test_streaming_fragments_each_hide_their_share_of_the_exchange_behind_the_delay():
    w, s = node(1, sps=2000.0), node(2)
    link = LinkSpec(1, 10.0, "measured")  # slow: the whole exchange outlasts the delay's compute
    links = {(1, 2): link, (2, 1): link}
    spec = CompressionSpec(value_bytes=4, sync_every=12, outer_delay=2)
    unhidden = predict("diloco", workers=[(w, 10)], server=s, links=links, task=TASK,
                       compression=replace(spec, outer_delay=0))
    whole = predict("diloco", workers=[(w, 10)], server=s, links=links, task=TASK, compression=spec)
    streamed = predict("diloco", workers=[(w, 10)], server=s, links=links, task=TASK,
                       compression=replace(spec, fragments=4))
    compute = whole.breakdown["compute_s"]
    exchange = unhidden.breakdown["outer_exchange_s"] * 12
    assert exchange > 8 * compute  # a quarter of it outlasts the delay's compute
    # Four exchanges of a quarter each, every 3 steps, each hiding 2 steps' compute.
    assert streamed.breakdown["outer_exchange_s"] == pytest.approx(4 * max(0.0, exchange / 4 - 2 * compute) / 12)
    assert streamed.step_s < whole.step_s and streamed.bytes_per_step == whole.bytes_per_step
    assert any("4 fragments" in note for note in streamed.assumptions)


def test_sites_as_replicas_add_the_in_site_exchange_to_each_step_and_send_one_change_per_site():
    s, a, b = node(1, site=1), node(2, site=2), node(3, site=2)
    spec = CompressionSpec(value_bytes=4, sync_every=10, outer_delay=0, site_replicas=True)
    p = predict("diloco", workers=[(a, 10), (b, 10)], server=s, links=mesh([s, a, b]), task=TASK, compression=spec)
    # In-site: b's 1000 fp32 elements to its relay a (SITE_GRAD: piece, samples) and the mean
    # back (SITE_MEAN: piece), one piece each way over the 1 Gbit/s LAN.
    site_grad, site_mean = 8 + 23 + 2 * 8 + (10 + 4000), 8 + 23 + 1 * 8 + (10 + 4000)
    inner = 10 / 100 + xfer(site_grad, 1000, 1) + xfer(site_mean, 1000, 1)
    # Outer: the site's one change (a's GRAD, dense fp32) over the WAN and the server's reply
    # naming one worker; on the LAN b's change to a and a's copy of the reply to b.
    reply = update_frame_bytes(100, 900, None, workers=1)
    outer = xfer(DENSE_UP, 100, 40) + xfer(reply, 100, 40) + xfer(DENSE_UP, 1000, 1) + xfer(reply, 1000, 1)
    assert p.step_s == pytest.approx(inner + outer / 10, rel=1e-12)
    assert p.breakdown["site_exchange_s"] == pytest.approx(inner - 10 / 100)
    assert dict(((src, dst), n) for src, dst, n in p.bytes_per_step) == {
        (2, 1): round(DENSE_UP / 10), (1, 2): round(reply / 10),
        (3, 2): round(site_grad + DENSE_UP / 10), (2, 3): round(site_mean + reply / 10)}
    assert [r["relay_for"] for r in p.per_worker] == [[3], []]
    assert any("sites as replicas" in note for note in p.assumptions)


def test_sites_as_replicas_cut_the_wan_uploads_by_the_workers_per_site():
    s, *cloud = node(1, site=1), node(2, site=2), node(3, site=2), node(4, site=2)
    workers = [(w, 10) for w in cloud]
    spec = CompressionSpec(sync_every=10, site_replicas=True)

    def uploads(p) -> int:
        return sum(n for src, dst, n in p.bytes_per_step if dst == s.node_id)

    plain = predict("diloco", workers=workers, server=s, links=mesh([s, *cloud]), task=TASK,
                    compression=replace(spec, site_replicas=False))
    replicas = predict("diloco", workers=workers, server=s, links=mesh([s, *cloud]), task=TASK, compression=spec)
    assert uploads(replicas) == pytest.approx(uploads(plain) / 3, abs=1)


def test_sites_as_replicas_pipeline_the_in_site_exchange_over_the_gradients_pieces():
    # 3 pieces of 2^20 bf16 elements: one piece through upload and download, then two more at
    # the pace of the slower stage (both equal here), so 4/3 of one direction, not 2.
    s, a, b = node(1, site=1, sps=1e6), node(2, site=2, sps=1e6), node(3, site=2, sps=1e6)
    task = TaskSpec(params=3 * 2**20, dense_params=0)
    lan = LinkSpec(1000, 0.0, "assumed")
    spec = CompressionSpec(sync_every=10, site_replicas=True)
    p = predict("diloco", workers=[(a, 1), (b, 1)], server=s, links=mesh([s, a, b], lan=lan), task=task,
                compression=spec)
    site_grad = 3 * (8 + 23 + 2 * 8 + 10 + 2 * 2**20)  # SITE_MEAN: one scalar fewer a piece
    up, down = xfer(site_grad, 1000, 0), xfer(site_grad - 3 * 8, 1000, 0)
    assert p.breakdown["site_exchange_s"] == pytest.approx((up + down) / 3 + 2 / 3 * up, rel=1e-12)


def test_sites_as_replicas_exchange_fp32_in_a_run_of_fp32_values():
    s, a, b = node(1, site=1, sps=1e6), node(2, site=2, sps=1e6), node(3, site=2, sps=1e6)
    task, lan = TaskSpec(params=2**20, dense_params=0), LinkSpec(1000, 0.0, "assumed")
    seconds = [predict("diloco", workers=[(a, 1), (b, 1)], server=s, links=mesh([s, a, b], lan=lan), task=task,
                       compression=CompressionSpec(sync_every=10, site_replicas=True, value_bytes=v)
                       ).breakdown["site_exchange_s"] for v in (2, 4)]
    assert seconds[1] == pytest.approx(2 * seconds[0], rel=1e-4)


def test_local_sgds_inner_steps_are_paced_by_the_slowest_compute_not_the_last_upload():
    # a computes 0.2 s on a fast link, b 0.1 s on a slow one whose upload reaches the server last.
    s, a, b = node(1), node(2, sps=50), node(3)
    fast, slow = LinkSpec(1000, 0.0, "assumed"), LinkSpec(0.1, 0.0, "assumed")
    links = {(2, 1): fast, (1, 2): fast, (3, 1): slow, (1, 3): slow}
    spec = CompressionSpec(value_bytes=4, sync_every=10, outer_delay=0)
    p = predict("diloco", workers=[(a, 10), (b, 10)], server=s, links=links, task=TASK, compression=spec)
    ps = predict("ps", workers=[(a, 10), (b, 10)], server=s, links=links, task=TASK, relay=False)
    assert p.breakdown["compute_s"] == pytest.approx(0.2)
    assert p.step_s == pytest.approx(0.2 + (ps.step_s - 0.2) / 10, rel=1e-12)
