"""The worker's helpers on their own: the flat model's gradient buffer and what the worker hears
from the server (trainer.flat_model, trainer.server_link)."""

from __future__ import annotations

import time

import torch
from trainer_testing import config, tiny_mlp

from trainer.algorithm import Layout, float_buffers
from trainer.compression import Payload
from trainer.flat_model import FlatModel
from trainer.frames import LAST_KINDS, Bye, Fetch, Update, pack
from trainer.relay import SERVER
from trainer.server_link import ServerLink
from trainer.site_relay import SiteRelay
from trainer.transport import InMemoryHub, Inbox


def test_a_gradient_the_users_code_replaced_is_copied_into_the_flat_buffer_and_bound_again():
    model = tiny_mlp()
    flat = FlatModel(model, Layout.of(model, 16), torch.device("cpu"))
    weight = model[0].weight
    weight.grad = torch.full_like(weight, 3.0)  # no longer a view of the buffer
    flat.collect()
    off = flat.layout.offsets[flat.layout.names.index("0.weight")]
    assert torch.equal(flat.grad[off : off + weight.numel()], torch.full((weight.numel(),), 3.0))
    flat.zero()
    assert weight.grad.abs().sum() == 0 and weight.grad.data_ptr() == flat.grad[off:].data_ptr()


def _link(hub: InMemoryHub, chunks: int, fetched: list, ended: list) -> ServerLink:
    transport = hub.transport(1)
    relay = SiteRelay(config(strategy="ps", workers=1, global_batch=8), 1, transport, ((0, 4),) * chunks)
    inbox = Inbox(transport, [SERVER], timeout_s=5.0, last_kinds=LAST_KINDS)
    relay.inbox = inbox
    return ServerLink(1, inbox, relay, chunks, answer_fetch=lambda: fetched.append(True),
                      on_end=lambda: ended.append(True))


def _update(step: int, chunk: int) -> Update:
    return Update(step, chunk, Payload(0, torch.zeros(0)), Payload(4, torch.full((4,), float(chunk))))


def test_a_fetch_that_comes_while_the_worker_reads_an_update_is_answered_and_the_chunks_arrive_in_order():
    hub, fetched, ended, taken = InMemoryHub(), [], [], []
    link = _link(hub, 2, fetched, ended)
    server = hub.transport(SERVER)
    for frame in (_update(3, 0), Fetch(3), _update(3, 1)):
        server.send(1, pack(frame))
    link.read_update(3, lambda u: taken.append(u.chunk))
    assert taken == [0, 1] and fetched == [True] and not link.ended


def test_the_servers_bye_before_an_update_ends_the_run_for_the_worker():
    hub, fetched, ended, taken = InMemoryHub(), [], [], []
    link = _link(hub, 1, fetched, ended)
    hub.transport(SERVER).send(1, pack(Bye(4, SERVER)))
    link.read_update(5, lambda u: taken.append(u))
    assert link.ended and ended == [True] and taken == []


def test_a_fragment_rounds_update_has_arrived_once_its_own_last_chunk_is_here():
    # Streaming, 4 fragments: fragment 1's round carries chunk 1 alone, never chunk 3.
    hub = InMemoryHub()
    link = _link(hub, 4, [], [])
    assert not link.update_arrived(6, 1)
    hub.transport(SERVER).send(1, pack(_update(6, 1)))
    deadline = time.monotonic() + 5.0
    while not link.update_arrived(6, 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert link.update_arrived(6, 1) and not link.update_arrived(6, 3) and not link.update_arrived(7, 1)


def test_the_servers_bye_before_a_later_fragments_round_ends_the_run_for_the_worker():
    hub, ended, taken = InMemoryHub(), [], []
    link = _link(hub, 4, [], ended)
    hub.transport(SERVER).send(1, pack(Bye(5, SERVER)))
    link.read_update(6, taken.append, start=2, stop=3)
    assert link.ended and ended == [True] and taken == []


def test_only_the_buffers_a_model_keeps_in_its_state_dict_are_averaged_and_carried():
    # An attention mask registered with persistent=False is rebuilt by every replica: sending it
    # before each evaluation only crossed the WAN and back.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.ones(8, 8), persistent=False)
    model[0].register_buffer("scale", torch.ones(2))
    model.register_buffer("shared", model[0].scale)  # the same tensor twice: once

    kept = float_buffers(model)

    assert [tuple(b.shape) for b in kept] == [(2,), (4,), (4,)]
    assert kept[0] is model[0].scale and kept[1] is model[1].running_mean and kept[2] is model[1].running_var
    assert Layout.of(model, 0).spec.buffer_numel == 10
