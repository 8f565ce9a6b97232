"""A site's relay combines its members' chunks with its own (trainer.site_combine), over an
in-memory transport: no processes, no network."""

from __future__ import annotations

import time

import torch

from trainer.compression import Identity, Payload, build_compressor
from trainer.frames import BYE, Bye, Grad, pack
from trainer.site_combine import SiteCombiner
from trainer.transport import InMemoryHub, Inbox

RELAY = 1
BOUNDS = [(0, 8), (8, 16)]


def _grad(sender: int, samples: int, value: float, *, step: int = 3, chunk: int = 0) -> Grad:
    return Grad(step, sender, chunk, 0.5 * sender, samples, 0.1 * sender, 0.01, 0.02,
                Payload(2, torch.full((2,), value)), Payload(8, torch.full((8,), value)))  # fmt: skip


def _site(members: tuple[int, ...], codec=None) -> tuple[InMemoryHub, Inbox, SiteCombiner]:
    hub = InMemoryHub(timeout_s=5.0)
    inbox = Inbox(hub.transport(RELAY), members, timeout_s=5.0, last_kinds=frozenset({BYE}))
    combiner = SiteCombiner(RELAY, members, BOUNDS, codec or Identity(), seed=0)
    return hub, inbox, combiner


def test_the_sites_frame_weights_each_chunk_by_its_batch_share_and_counts_the_sites_samples():
    hub, inbox, combiner = _site((2, 3))
    hub.transport(2).send(RELAY, pack(_grad(2, 2, 3.0)))
    hub.transport(3).send(RELAY, pack(_grad(3, 1, 6.0)))
    frame = combiner.combine(_grad(RELAY, 1, 1.0), inbox, density=0.25, dense_step=True, wait_s=5.0)
    # (1 * 1 + 2 * 3 + 1 * 6) / 4
    assert torch.equal(frame.sparse.values, torch.full((8,), 3.25))
    assert torch.equal(frame.dense.values, torch.full((2,), 3.25))
    assert (frame.sender, frame.samples) == (RELAY, 4)


def test_the_last_chunks_frame_carries_every_members_own_figures_for_the_servers_plan():
    hub, inbox, combiner = _site((2,))
    hub.transport(2).send(RELAY, pack(_grad(2, 2, 3.0, chunk=1)))
    frame = combiner.combine(_grad(RELAY, 1, 1.0, chunk=1), inbox, density=0.25, dense_step=True, wait_s=5.0)
    assert [m[:3] for m in frame.members] == [(RELAY, 0.5, 1), (2, 1.0, 2)]


def test_the_re_sparsified_sum_keeps_what_it_leaves_out_in_the_relays_own_residual():
    hub, inbox, combiner = _site((2,), build_compressor("topk", value_dtype="fp32"))
    own = _grad(RELAY, 1, 0.0)
    own.sparse.values[:] = torch.arange(8.0)
    hub.transport(2).send(RELAY, pack(_grad(2, 1, 0.0)))
    frame = combiner.combine(own, inbox, density=0.25, dense_step=False, wait_s=5.0)
    assert sorted(frame.sparse.indices.tolist()) == [6, 7]  # the top 2 of 8 of the mean
    residual = combiner.states[0].residual
    assert residual is not None and torch.allclose(residual[:6], torch.arange(6.0) / 2)


def test_a_member_that_says_bye_is_left_out_of_this_frame_and_the_next():
    hub, inbox, combiner = _site((2, 3))
    hub.transport(2).send(RELAY, pack(Bye(3, 2)))
    hub.transport(3).send(RELAY, pack(_grad(3, 1, 6.0)))
    frame = combiner.combine(_grad(RELAY, 1, 2.0), inbox, density=0.25, dense_step=True, wait_s=5.0)
    assert (frame.samples, combiner.members) == (2, (3,))
    assert torch.equal(frame.sparse.values, torch.full((8,), 4.0))


def test_a_silent_member_is_left_out_after_the_wait_which_is_not_counted_as_compression():
    hub, inbox, combiner = _site((2,))
    t0 = time.monotonic()
    frame = combiner.combine(_grad(RELAY, 1, 2.0), inbox, density=0.25, dense_step=True, wait_s=0.3)
    assert time.monotonic() - t0 >= 0.3
    assert (frame.samples, combiner.members) == (1, ())
    assert frame.topk_s < 0.02 + 0.2  # its own 0.02 s and the combining, not the 0.3 s wait


def test_keeping_the_servers_members_names_the_ones_it_dropped():
    _, _, combiner = _site((2, 3, 4))
    assert combiner.keep([0, 3, 5]) == [2, 4]
    assert combiner.members == (3,)
