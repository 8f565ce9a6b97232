"""The parameter-server strategies (`ps`, `ps-gc`, `ps-bz-gc`): the worker's side of a step
(`PSClient`), over the frames of `trainer.frames` and the pure steps of `trainer.algorithm`;
the server is `trainer.server.ParameterServer`, and the two share `trainer.codec_state`. How a
torch optimizer is adapted (steps 1 and 4 below) is `trainer.sgd_rules`.

Per step t (seed 000, section III; the numbers are `trainer.algorithm`'s):
 1. The user's code (or the task loop) computes worker m's gradient on its n_m samples; for an
    SGD optimizer, its weight decay joins the local gradient here (pitfall: before compression,
    so decay is compressed and fed back like the gradient).
 2. `PSClient.push_pull`: tiny and 1-D tensors go dense, the rest through `worker_sparsify`
    (error feedback, momentum correction, the worker's density) unless it is a warm-up step.
 3. `ParameterServer`: `aggregate` (eq. 1-2) and `server_sparsify`, one reply for all (through
    one relay worker per remote site when the run knows its sites: `trainer.relay`, and the
    relay's side, `trainer.site_relay`).
 4. Every worker applies the same update with its own optimizer (eq. 3), so the replicas stay
    identical. Under momentum correction the compressed tensors' update is applied as plain
    SGD (their momentum is in the velocity already).
 5. The reply also carries next step's densities (`adapt_densities` over transmission times)
    and batch sizes (re-balanced from compute and compression times under `measured`).

Protocol choices (the paper is silent): with `--pipeline-chunks N` steps 2-4 run once per chunk
of the compressed part, so the server aggregates chunk c and its update travels back while the
workers compress chunk c+1. The server is model-agnostic: it learns the layout from every
worker's HELLO (a different one aborts the run at once, naming the difference) and forwards
worker 1's weights to the others, so the replicas start equal whatever the model factory did.
With `--overlap` a chunk leaves as soon as the backward pass has produced its gradients; with
`--aggregate-at-sites` a remote site's relay combines its site's chunks into one frame (the
mirror of the update's relay: `trainer.site_combine`). With `--delayed-updates` step t's update is applied at step
t+1's push_pull, after step t+1's gradient has left, so the server's work and the reply's way
back overlap the next forward and backward passes (one step of staleness); whatever needs the
current model drains it first (`PSClient.drain`). With `--apply-in-forward` step() applies the
update's first chunk and returns; each later chunk is applied by a forward pre-hook just before
the first layer holding it runs, so the rest of the reply's way back overlaps the next forward
pass with nothing stale (the hooks of both: `trainer.pass_hooks`). docs/trainer.md, steps 7-11,
says why and what each costs.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from trainer.algorithm import Layout, apply_payload, chunks, float_buffers, worker_sparsify
from trainer.codec_state import codec, dense_chunk, join_residuals, sends_dense, split_residual
from trainer.compression import CompressionState, Payload
from trainer.config import TrainConfig, initial_batch_sizes
from trainer.frames import (
    LAST_KINDS,
    Buffers,
    BuffersAvg,
    Eval,
    EvalResult,
    Grad,
    Update,
    pack,
)
from trainer.in_place import InPlaceUpdates
from trainer.linkclock import LinkClock
from trainer.local_sgd import LocalSGD
from trainer.membership import relay_wait_s
from trainer.metrics import MetricsLogger
from trainer.pass_hooks import ApplyInForward, OverlapHooks
from trainer.relay import SERVER
from trainer.session import Session
from trainer.sgd_rules import SgdRules, adapt_sgd, add_decay, hyperparameter_values, hyperparameters, sgd_step
from trainer.site_relay import SiteRelay
from trainer.transport import Inbox, Transport

log = logging.getLogger("trainer.ps")

CPU = torch.device("cpu")


@dataclass
class _Sending:
    """One step's sends so far: which chunk goes next, their waits and their times."""

    step: int
    samples: int
    next_chunk: int = 0
    waits: list = field(default_factory=list)
    topk_s: float = 0.0
    encode_s: float = 0.0
    tx_s: float = 0.0
    nbytes: int = 0
    # Overlap: params whose gradient the backward pass has produced, and whose SGD decay is in.
    ready: set = field(default_factory=set)


class PSClient(OverlapHooks, ApplyInForward, InPlaceUpdates, SiteRelay, Session):
    """A worker's side of the protocol: hand it the gradients of a step, it does steps 2-5;
    its place in the run (start, joining, leaving) is `trainer.session.Session`'s, its part in
    its site's relays `trainer.site_relay.SiteRelay`'s."""

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        transport: Transport,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        metrics: MetricsLogger,
        *,
        device: torch.device = CPU,
        train_samples: int | None = None,
    ) -> None:
        self.cfg, self.rank, self.index = cfg, rank, rank - 1
        self.transport, self.model, self.optimizer, self.metrics = transport, model, optimizer, metrics
        self.device = device
        self.layout = Layout.of(model, cfg.dense_numel, forward=cfg.applies_in_forward)
        self.batch_sizes = initial_batch_sizes(cfg)
        self.densities = [cfg.densities[0]] * cfg.workers
        self.max_steps = cfg.max_steps
        self.codec = codec(cfg, cfg.compressor)
        self.bounds = chunks(self.layout.sparse_numel, cfg.pipeline_chunks)
        # One codec state (residual) per chunk: each chunk is compressed on its own.
        self.codec_states = [CompressionState(density=cfg.densities[0], seed=cfg.seed) for _ in self.bounds]
        self.last_tx_s = 0.0
        self.link_clock = LinkClock()
        self.step = 0
        self.stopped = False
        self.train_samples = train_samples
        self._params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
        # The tensors that go through the codec: the layout is the run's, so the set is too.
        self._compressed = frozenset(self._params[n] for n, off in zip(self.layout.names, self.layout.offsets)
                                     if off >= self.layout.dense_numel)
        self.flat_grad = torch.zeros(self.layout.numel, device=device)
        self._bind_grads()
        # Local SGD: the common parameters of the last outer step and the outer optimizer
        # (trainer.local_sgd); the inner steps use the task's optimizer as it is.
        self.local = (LocalSGD(cfg.sync_every, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                               numel=self.layout.numel, device=device) if cfg.is_local_sgd else None)
        if self.local is not None:
            self.local.reset(self._flat_params(), 0)
        self.rules = SgdRules() if self.local is not None else self._adapt_optimizer(optimizer)
        # Momentum correction (DGC, Lin et al. 2018): applied after compression, momentum repeats
        # for ~1/(1 - m) steps every burst that error feedback held back in the residual, and the
        # replicas lurch. Accumulated before compression, the velocity itself is what travels.
        self.velocity = (torch.zeros(self.layout.sparse_numel, device=device)
                         if self.rules.momentum else None)
        # Which chunk carries the dense part (1-D and small tensors): the first, or with
        # overlap the last, since their gradients are complete only at the end of backward.
        self.dense_chunk = dense_chunk(cfg)
        self._sending: _Sending | None = None
        self._chunk_params = self._params_by_chunk()
        if cfg.overlap:
            for name in self._chunk_params_names():
                self._params[name].register_post_accumulate_grad_hook(self._on_grad)
        self._init_site_relay()
        # A relay waits for its members in proportion to the step time, as the server's loss
        # deadline does (trainer.membership.relay_wait_s).
        self._step_times: deque[float] = deque(maxlen=20)
        # The server may pause below --min-workers: a worker waits that long on top.
        wait = cfg.timeout_s + (cfg.min_workers_wait_s if cfg.min_workers > 1 else 0.0)
        self.inbox = Inbox(transport, [SERVER], timeout_s=wait, last_kinds=LAST_KINDS, on_frame=self._forward)
        self.left = False
        self.ended_by_server = False
        # Delayed updates: the step whose gradient has been sent but whose update is not applied
        # yet (always self.step + 1), and the optimizer's hyperparameters as they were at that
        # step's push_pull: a schedule steps them before the update is applied, and the update
        # of step t must move the weights with step t's learning rate, as it would without delay.
        self._pending: int | None = None
        # Local SGD with --outer-delay: the outer step whose change was sent but whose update is
        # applied a few inner steps later (trainer.local_sgd.LocalSGD.parameters_after).
        self._outer_pending: int | None = None
        self._pending_hyper: list[dict] | None = None
        self._applying_hyper: list[dict] | None = None
        # Apply-in-forward: step() applies the update's first chunk and leaves the rest pending
        # (`_pending`, from `_pending_chunk` on) for forward pre-hooks, each applying the chunks
        # up to the last one its module's parameters lie in; `_blocked_s` is how long they
        # waited for chunks still on the way (communication, not compute, for re-balancing).
        self._pending_chunk = 0
        self._blocked_s = 0.0
        # Under momentum correction the compressed tensors take plain SGD, so each chunk of an
        # update goes straight into the parameters it spans, touching only its own elements
        # (`_apply_in_place`), rather than through the flat gradient and then one pass over the
        # whole model on the step's tail (a third to a half less time, bench/compression.py).
        self._pieces = self._chunk_pieces() if self._applies_in_place() else None
        self._in_forward = self._applies_in_forward()
        if self._in_forward:
            self._hook_modules()

    # -- the optimizer --------------------------------------------------------------------------
    def _adapt_optimizer(self, optimizer: torch.optim.Optimizer) -> SgdRules:
        correct = self.cfg.compresses and self.cfg.momentum_correction
        return adapt_sgd(optimizer, self._compressed if correct else frozenset(), momentum_correction=correct)

    # -- the flat gradient ------------------------------------------------------------------------
    def _bind_grads(self) -> None:
        for name, off, n in zip(self.layout.names, self.layout.offsets, self.layout.numels):
            p = self._params[name]
            p.grad = self.flat_grad[off : off + n].view_as(p)

    def _grads_are_views(self) -> bool:
        base = self.flat_grad.data_ptr()
        end = base + self.flat_grad.numel() * self.flat_grad.element_size()
        return all(p.grad is not None and base <= p.grad.data_ptr() < end for p in self._params.values())

    def zero_grad(self) -> None:
        """Zero the flat gradient, keeping every parameter's .grad a view of it; the next
        step's sends may start (with overlap, from the backward pass)."""
        self.flat_grad.zero_()
        self._bind_grads()
        # The bytes so far are the last step's (and its evaluation's): this step's may start now.
        self.flush_bytes()
        self._sending = _Sending(self.sent_step + 1, self.batch_sizes[self.index])

    def collect_grads(self, done: set | frozenset = frozenset()) -> None:
        """Autograd accumulates into the bound views; copy back if user code replaced one, then
        add an SGD optimizer's weight decay (step 1) to the gradients not in `done` (those sent
        early already have theirs)."""
        if not self._grads_are_views():
            for name, off, n in zip(self.layout.names, self.layout.offsets, self.layout.numels):
                if self._params[name] in done:
                    continue
                g = self._params[name].grad
                self.flat_grad[off : off + n].copy_(g.reshape(-1) if g is not None else 0)
            self._bind_grads()
        add_decay(self.optimizer, self.rules, done)

    # -- start and end: trainer.session ------------------------------------------------------------
    def _flat_params(self) -> torch.Tensor:
        return torch.cat([self._params[n].detach().reshape(-1).float() for n in self.layout.names])

    @property
    def sent_step(self) -> int:
        """The last step whose gradient this worker has sent: `step`, or one more while that
        step's update is pending (delayed updates)."""
        return self.step if self._pending is None else self._pending

    def flush_bytes(self) -> None:
        """Log the bytes since the last flush under the last step sent: a step's record per link
        then holds the step and whatever followed it before the next (an evaluation; the
        start-up exchange is step 0's), once, since the control plane keeps one record per step.
        With delayed updates a step's record holds the previous step's update."""
        self.metrics.log_bytes(self.sent_step, *self.transport.take_counts())

    # -- one step -----------------------------------------------------------------------------------
    def compress(self, step: int, chunk: int) -> tuple[Payload, Payload]:
        """Step 2 for one chunk: (the dense part, on the dense chunk only; the chunk through the
        codec)."""
        nd = self.layout.dense_numel if chunk == self.dense_chunk else 0
        dense = Payload(nd, self.flat_grad[:nd].cpu())
        a, b = self.bounds[chunk]
        grad = self.flat_grad[self.layout.dense_numel + a : self.layout.dense_numel + b]
        state = self.codec_states[chunk]
        state.density = self.densities[self.index]
        state.step = step
        # The velocity is accumulated here, chunk by chunk, not with the gradient: a
        # per-parameter cost, it belongs with compression time, which re-balancing treats as
        # fixed rather than per sample.
        sparse = worker_sparsify(
            grad, codec=self.codec, state=state,
            velocity=None if self.velocity is None else self.velocity[a:b],
            momentum=self.rules.momentum, dense_step=self.dense_step(step))
        return dense, replace(sparse, values=sparse.values.cpu(),
                              indices=None if sparse.indices is None else sparse.indices.cpu())

    def dense_step(self, step: int) -> bool:
        """Warm-up steps and uncompressed strategies send the whole gradient."""
        return sends_dense(self.cfg, step)

    def apply(self, update: Update) -> None:
        """Step 4 for one chunk. Under momentum correction it goes straight into the parameters
        (`_apply_in_place`); otherwise into `flat_grad`, and after the last chunk one optimizer
        step. The last chunk brings the next step's plan."""
        if self._pieces is not None:
            self._apply_in_place(update)
            return
        nd = self.layout.dense_numel
        if update.chunk == self.dense_chunk:
            self.flat_grad[:nd].copy_(update.dense.values.to(self.device, torch.float32))
        a, b = self.bounds[update.chunk]
        apply_payload(self.flat_grad[nd + a : nd + b], update.sparse)
        if update.chunk < len(self.bounds) - 1:
            return
        if self.local is not None:
            # The flat buffer holds the workers' mean pseudo-gradient: the outer step.
            norm = self.local.apply(self.flat_grad, update.step)
            # Overlapped, the inner steps since the send stay on top (a copy of the parameters only then).
            overlapped = self.local.drift_from is not None
            self._set_params(self.local.parameters_after(self._flat_params()) if overlapped else self.local.common)
            self.metrics.log(update.step, "outer_norm", norm)
        else:
            self._optimizer_step()
        self.densities = list(update.densities)
        self.batch_sizes = list(update.batch_sizes)

    def _set_params(self, flat: torch.Tensor) -> None:
        """Every parameter from `flat` (layout order)."""
        with torch.no_grad():
            for name, off, n in zip(self.layout.names, self.layout.offsets, self.layout.numels):
                p = self._params[name]
                p.copy_(flat[off : off + n].view_as(p))

    def _optimizer_step(self) -> None:
        with hyperparameters(self.optimizer, self._applying_hyper):
            if self.velocity is None:
                self.optimizer.step()
            else:
                self._step_with_momentum_correction()

    def _step_with_momentum_correction(self) -> None:
        sgd_step(self.optimizer, self._compressed)
        self._step_dense()

    def _step_dense(self) -> None:
        """The optimizer's step on the dense tensors alone: the compressed ones have had theirs
        (plain SGD under momentum correction), so they go without a gradient, which SGD skips."""
        for p in self._compressed:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            self._bind_grads()

    def _send_chunk(self, sending: _Sending, c: int, loss: float, compute_s: float) -> None:
        """Compress chunk `c` of `sending`'s step and post it to the server."""
        tc = time.perf_counter()
        dense, sparse = self.compress(sending.step, c)
        te = time.perf_counter()
        sending.topk_s += te - tc
        grad = Grad(sending.step, self.rank, c, loss, sending.samples, compute_s, self.last_tx_s,
                    sending.topk_s, dense, sparse)
        if self.combiner is not None:
            wait_s = relay_wait_s(self._step_times, self.cfg.timeout_s)
            grad = self.combiner.combine(grad, self.inbox, density=self.densities[self.index],
                                         dense_step=self.dense_step(sending.step), wait_s=wait_s)  # fmt: skip
            te = time.perf_counter()
            sending.topk_s = grad.topk_s
        frame = pack(grad)
        if self.up != SERVER:
            self.unacked.append((grad.step, frame))
        ts = time.perf_counter()
        sending.encode_s += ts - te
        sending.waits.append(self.transport.post_many([self.up], frame))
        sending.nbytes += frame.numel()
        sending.tx_s += time.perf_counter() - ts
        sending.next_chunk = c + 1

    def push_pull(self, step: int, *, loss: float, samples: int, compute_s: float) -> None:
        """Steps 2-5 of one synchronous step; the gradients are in the parameters' .grad.

        With several chunks the step is a pipeline: chunk c+1 is compressed while chunk c is on
        the wire and being aggregated by the server, whose update of chunk c comes back meanwhile.
        """
        t0 = time.perf_counter()
        sending = self._sending if self._sending is not None and self._sending.step == step else None
        if sending is None:  # zero_grad() was not called: nothing went early, and bytes were not flushed
            sending = _Sending(step, samples)
            self.flush_bytes()
        self._sending = None  # a late hook (a second backward) must not send into the next step
        self.collect_grads(sending.ready)
        # What the frame reports: this step's own figures, or under local SGD the whole round's.
        sent_loss, sent_compute_s = loss, compute_s
        outer_later = False
        if self.local is not None:
            if not self._inner_step(step, loss=loss, samples=samples, compute_s=compute_s):
                return
            self._apply_outer()  # an overlapped one still on its way (--outer-delay >= H: none)
            round_ = self.local.progress
            sending.samples, sent_loss, sent_compute_s = round_.samples, round_.loss, round_.compute_s
            local = self._flat_params()
            self.local.delta(local, out=self.flat_grad)
            # Overlapped: the outer step is applied --outer-delay inner steps later; the run's
            # last one at once, so that the run ends on the common model.
            outer_later = self.cfg.outer_delay > 0 and step < self.max_steps
            self.local.sent(local if outer_later else None)
        density = self.densities[self.index] if not self.dense_step(step) else 1.0
        self._forward_s = 0.0
        # Chunks sent from the backward pass spent that time compressing and posting, not
        # computing: re-balancing reads compute_s as per-sample work.
        step_s = compute_s
        # Apply-in-forward: the forward pass's waits for the last update's chunks are
        # communication exposed in this step, not per-sample work.
        blocked, self._blocked_s = self._blocked_s, 0.0
        overhead = blocked + sending.topk_s + sending.encode_s + sending.tx_s
        compute_s = max(0.0, compute_s - overhead)
        sent_compute_s = max(0.0, sent_compute_s - overhead)
        while sending.next_chunk < len(self.bounds):
            self._send_chunk(sending, sending.next_chunk, sent_loss, sent_compute_s)
        ts = time.perf_counter()
        for wait in sending.waits:
            wait()
        sent = time.perf_counter()
        topk_s, encode_s, tx_s = sending.topk_s, sending.encode_s, sending.tx_s + sent - ts
        # Delayed updates: the previous step's update is applied now, after this step's gradient
        # has left, and this step's waits for the next push_pull while the next step computes.
        # The run's last step takes its own at once, so the run ends with every update applied.
        self.drain()
        if self.ended_by_server:
            return
        if self.cfg.delayed_updates and step < self.max_steps:
            self._pending, self._pending_hyper = step, hyperparameter_values(self.optimizer)
        elif outer_later:
            self._outer_pending = step
        elif self._in_forward and step < self.max_steps:
            # The first chunk brings the dense part and the next step's batch split; the rest
            # is applied during the next forward pass (the run's last step takes all at once).
            self._pending, self._pending_hyper, self._pending_chunk = step, hyperparameter_values(self.optimizer), 0
            self._pull_through(0)
        else:
            self._read_updates(step)
        if self.ended_by_server:
            return
        last_arrival = time.perf_counter()
        # By now the server has the whole upload and its ACKs are back: the rate sample is the
        # upload's own. (With delayed updates it may be the previous upload's: the clock keeps
        # the best of several steps anyway.)
        self.link_clock.note(self.transport.delivery_rate(self.up))
        self.last_tx_s = self.link_clock.send_s(sending.nbytes, tx_s)
        if self._pending is None:
            self.step = step
        total = step_s + time.perf_counter() - t0
        self._step_times.append(total)
        # Communication is all of the step this worker did not spend computing or compressing:
        # its sends, the server's work and the update's way back (the bill's granularity is
        # compute_s / comm_s). The send alone, at the link's rate (trainer.linkclock), is what
        # the density rule reads.
        self._log_step(step, loss=loss, samples=samples, total_s=total, compute_s=compute_s,
                       comm_s=max(0.0, total - compute_s - topk_s - encode_s))
        mlog = self.metrics.log
        mlog(step, "compress_s", topk_s + encode_s)
        mlog(step, "wait_s", max(0.0, last_arrival - sent) + blocked)
        mlog(step, "density", density)

    def _log_step(self, step: int, *, loss: float, samples: int, total_s: float, compute_s: float,
                  comm_s: float) -> None:
        """A step's own figures, as every strategy reports them."""
        mlog = self.metrics.log
        if math.isfinite(loss):
            mlog(step, "loss", loss)
        mlog(step, "batch_size", samples)
        mlog(step, "samples_per_s", samples / max(total_s, 1e-9))
        mlog(step, "compute_s", compute_s)
        mlog(step, "comm_s", comm_s)

    def _inner_step(self, step: int, *, loss: float, samples: int, compute_s: float) -> bool:
        """Local SGD: the task's optimizer steps on this worker's gradient alone. True when the
        outer step follows (the caller sends the pseudo-gradient); else the step is done here."""
        self.optimizer.step()
        self.local.progress.note(loss, samples, compute_s)
        if self.local.due(step, self.max_steps):
            return True
        waited = 0.0
        if self._outer_pending is not None and step >= self._outer_pending + self.cfg.outer_delay:
            t0 = time.perf_counter()
            self._apply_outer()
            # Waiting for an outer step that is late is communication, not compute.
            waited = time.perf_counter() - t0
            self.metrics.log(step, "wait_s", waited)
        self.step = step
        self._step_times.append(compute_s + waited)
        self._log_step(step, loss=loss, samples=samples, total_s=compute_s + waited, compute_s=compute_s,
                       comm_s=waited)
        return False

    def _apply_outer(self) -> None:
        """Read and apply the overlapped outer step still on its way (a no-op without one)."""
        if self._outer_pending is None or self.ended_by_server:
            return
        step, self._outer_pending = self._outer_pending, None
        self._read_updates(step)

    @contextmanager
    def global_model(self) -> Iterator[None]:
        """The run's model in the parameters for the block: under local SGD the common one of
        the last outer step (an evaluation scores that, not one worker's drift since)."""
        if self.local is None or self.local.synced_step == self.step:
            yield
            return
        own = self._flat_params()
        self._set_params(self.local.common)
        try:
            yield
        finally:
            self._set_params(own)

    def drain(self) -> None:
        """Apply the update still pending (under --delayed-updates; under apply-in-forward, the
        chunks not applied yet; a no-op otherwise), so that the model is the run's current one:
        before an evaluation, a checkpoint, leaving, the end. Under local SGD, an overlapped
        outer step still on its way."""
        self._apply_outer()
        if self._pending is None or self.ended_by_server:
            return
        if self._in_forward:
            self._pull_through(len(self.bounds) - 1)
            return
        step, hyper = self._pending, self._pending_hyper
        self._pending = self._pending_hyper = None
        # Between zero_grad() and push_pull() the flat buffer holds the next step's gradient (with
        # --overlap partly sent already); an update that passes through that buffer (not applied
        # in place) puts it back.
        held = self.flat_grad.clone() if self._sending is not None and self._pieces is None else None
        self._applying_hyper = hyper
        try:
            self._read_updates(step)
        finally:
            self._applying_hyper = None
            if held is not None:
                self.flat_grad.copy_(held)
        if not self.ended_by_server:
            self.step = step

    # -- evaluation --------------------------------------------------------------------------------
    def average_buffers(self, step: int) -> None:
        """Pitfall: BatchNorm statistics are averaged by batch share before evaluation (the
        pending update, if any, applied first: the run evaluates its current model)."""
        self.drain()
        buffers = float_buffers(self.model)
        if not buffers:
            return
        flat = torch.cat([b.reshape(-1).float().cpu() for b in buffers])
        self.transport.send(SERVER, pack(Buffers(step, self.rank, self.batch_sizes[self.index], flat)))
        reply = self._from_server(BuffersAvg, step)
        if reply is None:
            return
        avg = reply.values
        off = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(avg[off : off + b.numel()].view_as(b))
                off += b.numel()

    def combine_eval(self, step: int, sums: dict[str, float], count: int,
                     seconds: float = 0.0) -> tuple[dict[str, float], bool]:
        """Send this worker's metric sums and how long it evaluated; the server answers with the
        run's means and whether the target stops the run."""
        self.drain()
        self.transport.send(SERVER, pack(Eval(step, self.rank, sums, count, seconds)))
        result = self._from_server(EvalResult, step)
        if result is None:
            self.stopped = True
            return {}, True
        self.stopped = result.stop
        return result.values, result.stop

    # -- leaving and the end: trainer.session, with the pending update applied first ---------------
    def close(self) -> None:
        """Apply the pending update (delayed updates), then BYE (`Session.close`): the run ends
        with every replica equal to the model the server's updates make (under local SGD, the
        common one of the last outer step: a run stopped at its target between outer steps)."""
        if not self.left:
            self.drain()
        if self.local is not None and self.local.synced_step != self.step:
            self._set_params(self.local.common)
        super().close()

    def leave(self) -> None:
        """Apply the pending update (delayed updates), then leave (`Session.leave`): the server
        answers the last step this worker sent before it lets the worker go."""
        if not self.left:
            self.drain()
        super().leave()

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Residual, velocity, densities, batch sizes, last transmission time (the model and
        optimizer are the caller's, current once this returns: a pending update is applied)."""
        self.drain()
        return {
            "residual": join_residuals(self.codec_states),
            "densities": self.densities,
            "batch_sizes": self.batch_sizes,
            "last_tx_s": self.last_tx_s,
            "velocity": self.velocity,
            "site_residual": join_residuals(self.combiner.states) if self.combiner is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` (after applying a pending update, which the state replaces)."""
        self.drain()
        if (self.velocity is not None) != (state.get("velocity") is not None):
            raise ValueError(
                "the checkpoint was written with momentum correction "
                f"{'on' if state.get('velocity') is not None else 'off'}: resume with the same "
                "--momentum-correction setting")
        residual = state["residual"]
        split_residual(self.codec_states, None if residual is None else residual.to(self.device), self.bounds)
        self.densities = list(state["densities"])
        self.batch_sizes = list(state["batch_sizes"])
        self.last_tx_s = state["last_tx_s"]
        if self.velocity is not None:
            self.velocity.copy_(state["velocity"])
        if self.combiner is not None:
            split_residual(self.combiner.states, state.get("site_residual"), self.bounds)
        self._bind_grads()
