"""The parameter-server strategies (`ps`, `ps-gc`, `ps-bz-gc`, and local SGD's `diloco`,
`diloco-gc`): the worker's side (`PSClient`), over the frames of `trainer.frames` and the pure
steps of `trainer.algorithm`; the server is `trainer.server.ParameterServer`.

Per step t (seed 000, section III), `PSClient.push_pull` is the whole of it:
 1. The user's code (or the task loop) computes worker m's gradient on its n_m samples; for an
    SGD optimizer its weight decay joins the local gradient here, before compression, so decay
    is compressed and fed back like the gradient (`trainer.sgd_rules`).
 2. `Uplink.send`: tiny and 1-D tensors dense, the rest through `worker_sparsify` (error
    feedback, momentum correction, the worker's density) unless it is a warm-up step, chunk by
    chunk (`--pipeline-chunks`), through the site's relay under `--aggregate-at-sites`.
 3. The server aggregates (eq. 1-2), re-sparsifies and sends one reply for all (through one
    relay worker per remote site: `trainer.relay`, `trainer.site_relay`).
 4. `UpdateApplier.apply`: every worker applies the same update with its own optimizer (eq. 3),
    so the replicas stay identical; under `--apply-in-forward` all chunks but the first during
    the next forward pass (`trainer.pass_hooks`).
 5. The reply also carries next step's densities (`adapt_densities` over transmission times)
    and batch sizes (re-balanced from compute and compression times under `measured`).

Local SGD (DiLoCo, Douillard et al. 2023, algorithm 1; `trainer.local_sgd`): steps 2-4 run
every H-th step only, on the pseudo-gradient (the change since the last outer step) instead of
the gradient; the other steps are the task's optimizer on the worker's own gradient
(`_inner_step`), or under `--site-replicas` on its site's mean gradient (`trainer.site_replica`),
and step 4 is the outer Nesterov step; `trainer.outer_steps.OuterSteps` sends the change and
applies the outer steps, at once, overlapped with `--outer-delay` inner steps, under
`--async-outer` as soon as each update has arrived, and fragment by fragment under `--fragments`
(the two combine: each fragment's round is then an outer step of its own).

What a worker hears from the server is `trainer.server_link`'s; its state for a joiner or a
checkpoint `trainer.replica_state`'s; its part in its site's relays `trainer.site_relay`'s.
docs/trainer.md, steps 1-11, says why and what each costs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from trainer.algorithm import Layout, chunk_count, chunks, float_buffers
from trainer.codec_state import join_residuals, split_residual
from trainer.config import TrainConfig, initial_batch_sizes
from trainer.flat_model import FlatModel
from trainer.frames import LAST_KINDS, Buffers, BuffersAvg, Bye, Eval, EvalResult, Hello, State, Update, Welcome, pack
from trainer.local_sgd import LocalSGD
from trainer.metrics import MetricsLogger
from trainer.outer_steps import OuterSteps
from trainer.pass_hooks import ApplyInForward
from trainer.relay import SERVER
from trainer.replica_state import load_state, state_frame
from trainer.server_link import ServerLink
from trainer.sgd_rules import SgdRules, adapt_sgd, add_decay
from trainer.site_relay import SiteRelay
from trainer.site_replica import SiteReplica
from trainer.transport import Inbox, Transport
from trainer.uplink import Upload, Uplink
from trainer.updates import UpdateApplier

CPU = torch.device("cpu")


class PSClient:
    """A worker's side of the protocol: hand it a step's gradients (`push_pull`), it does steps
    2-5; `start`, `leave` and `close` are its place in the run (docs/elastic.md)."""

    def __init__(self, cfg: TrainConfig, rank: int, transport: Transport, model: nn.Module,
                 optimizer: torch.optim.Optimizer, metrics: MetricsLogger, *, device: torch.device = CPU,
                 train_samples: int | None = None) -> None:
        self.cfg, self.rank, self.index = cfg, rank, rank - 1
        self.transport, self.model, self.optimizer, self.metrics = transport, model, optimizer, metrics
        self.device, self.train_samples = device, train_samples
        # The run's plan as the server last sent it: where this worker is, its batch and density.
        self.step = 0
        self.max_steps = cfg.max_steps
        self.batch_sizes = initial_batch_sizes(cfg)
        self.densities = [cfg.densities[0]] * cfg.workers
        self.stopped = False
        self.left = False
        self.layout = Layout.of(model, cfg.dense_numel, forward=cfg.applies_in_forward)
        self.flat = FlatModel(model, self.layout, device)
        self.bounds = chunks(self.layout.sparse_numel, chunk_count(self.layout.sparse_numel, cfg.exchange_chunks))
        # Local SGD: the common parameters of the last outer step and the outer optimizer; the
        # inner steps use the task's optimizer as it is. Streaming: a fragment per chunk, the
        # dense part with the first.
        nd = self.layout.dense_numel
        spans = (tuple((0 if p == 0 else nd + a, nd + b) for p, (a, b) in enumerate(self.bounds))
                 if cfg.streams else None)
        local = (LocalSGD(cfg.sync_every, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                          numel=self.layout.numel, device=device, spans=spans) if cfg.is_local_sgd else None)
        if local is not None:
            local.reset(self.flat.values(), 0)
        correct = local is None and cfg.compresses and cfg.momentum_correction
        self.rules = (SgdRules() if local is not None else
                      adapt_sgd(optimizer, self.flat.compressed if correct else frozenset(), momentum_correction=correct))
        # Momentum correction (DGC, Lin et al. 2018): applied after compression, momentum repeats
        # for ~1/(1 - m) steps every burst that error feedback held back in the residual, and the
        # replicas lurch. Accumulated before compression, the velocity itself is what travels.
        self.velocity = torch.zeros(self.layout.sparse_numel, device=device) if self.rules.momentum else None
        self.relay = SiteRelay(cfg, rank, transport, self.bounds)
        self.uplink = Uplink(cfg, rank, self.flat, self.bounds, transport, self.relay, velocity=self.velocity,
                             momentum=self.rules.momentum)
        # Site replicas: the site's workers average every inner step through its relay.
        self.site = (SiteReplica(cfg, rank, transport, self.relay, self.flat, self.uplink.step_times)
                     if cfg.site_replicas and local is not None else None)
        # The server may pause below --min-workers: a worker waits that long on top.
        wait = cfg.timeout_s + (cfg.min_workers_wait_s if cfg.min_workers > 1 else 0.0)
        self.inbox = Inbox(transport, [SERVER], timeout_s=wait, last_kinds=LAST_KINDS,
                           on_frame=self.relay.on_frame if self.site is None else self.site.on_frame)
        self.relay.inbox = self.inbox
        self.link = ServerLink(rank, self.inbox, self.relay, len(self.bounds), answer_fetch=self._answer_fetch,
                               on_end=self._ended)
        self.applier = UpdateApplier(self.flat, optimizer, self.bounds, velocity=self.velocity,
                                     outer=local is not None)
        self.in_forward = (ApplyInForward(model, optimizer, self.applier, self.link, self._take, self._caught_up)
                           if ApplyInForward.wanted(cfg.applies_in_forward, self.applier) else None)
        # Local SGD's rounds: the inner steps' ends, the pseudo-gradient's send and the outer steps
        # on their way back (trainer.outer_steps).
        self.outer = (OuterSteps(cfg, local, self.flat, metrics, read_round=self._read_round,
                                 update_arrived=self._update_arrived, ended=lambda: self.link.ended,
                                 buffers=lambda: float_buffers(model))
                      if local is not None else None)
        self._flushed_for: int | None = None

    @property
    def local(self) -> LocalSGD | None:
        """Local SGD's state (`OuterSteps.local`: the common parameters and the outer optimizer);
        None for the other strategies."""
        return self.outer.local if self.outer is not None else None

    @property
    def ended_by_server(self) -> bool:
        """The server has ended the run (its BYE)."""
        return self.link.ended

    def _ended(self) -> None:
        self.max_steps = min(self.max_steps, self.step)

    @property
    def sent_step(self) -> int:
        """The last step whose gradient this worker has sent: `step`, or one more while that
        step's update is still being applied in the forward pass."""
        pending = self.in_forward.pending if self.in_forward is not None else None
        return self.step if pending is None else pending

    # -- joining the run ------------------------------------------------------------------------
    def start(self) -> None:
        """HELLO, then the server's plan, then the run's state: the replicas' common starting
        weights, or (joining, resuming) the run's current model and optimizer state."""
        self._start()
        if self.outer is not None:
            self.outer.keep_buffers()  # the common model's, until the next outer step

    def _start(self) -> None:
        cfg = self.cfg
        listen = getattr(self.transport, "listen_port", None)
        site = cfg.sites[self.rank] if self.rank < len(cfg.sites) else None
        speed = cfg.speeds[self.index] if self.index < len(cfg.speeds) else None
        self.transport.send(SERVER, pack(Hello(self.rank, self.layout.spec, self.train_samples, cfg.join, speed,
                                               site, listen)))
        welcome = self.link.expect(Welcome)
        self.batch_sizes, self.densities = list(welcome.batch_sizes), list(welcome.densities)
        self.max_steps, self.step = welcome.max_steps, welcome.start_step
        self.relay.take_welcome(welcome)
        if welcome.donor == self.rank:
            self.transport.send(SERVER, pack(self.state_frame()))
            return
        state = self.link.expect(State)
        if state is None:
            return
        self.load_state(state)
        if welcome.catch_up:
            # A joiner has the state of the last step; the next step's update, which the others
            # are computing now, brings it level with them (under local SGD, the next outer step's).
            upto = self.next_round(self.step)
            self._read_round(upto)
            if not self.ended_by_server:
                self.step = upto

    def next_round(self, step: int) -> int:
        """The step of the next update after `step`: the next step, or local SGD's next outer step."""
        return step + 1 if self.local is None else self.local.next(step, self.max_steps)

    def state_frame(self) -> State:
        """This replica's state for a joiner or a checkpoint (`trainer.replica_state`)."""
        return state_frame(self.rank, self.step, self.flat, self.model, self.optimizer, self.local)

    def load_state(self, state: State) -> None:
        """Take the run's weights, buffers and (when sent) optimizer state."""
        load_state(state, self.flat, self.model, self.optimizer, self.local)

    def _answer_fetch(self) -> None:
        # Posted, not waited for: the sender thread writes it while this worker applies the
        # update and computes (a checkpoint's state is tens of MB); a failed write shows at the
        # next send on the link.
        self.transport.post_many([SERVER], pack(self.state_frame()))

    # -- one step -------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the flat gradient, keeping every parameter's .grad a view of it."""
        self.flat.zero()
        # The bytes so far are the last step's (and its evaluation's): this step's start now.
        self.flush_bytes()
        self._flushed_for = self.sent_step + 1

    def flush_bytes(self) -> None:
        """Log the bytes since the last flush under the last step sent: a step's record per link
        then holds the step and whatever followed it before the next (an evaluation; the
        start-up exchange is step 0's), once, since the control plane keeps one record per step."""
        self.metrics.log_bytes(self.sent_step, *self.transport.take_counts())

    def push_pull(self, step: int, *, loss: float, samples: int, compute_s: float) -> None:
        """Steps 1-5 of one step; the gradients are in the parameters' .grad."""
        t0 = time.perf_counter()
        if self._flushed_for != step:  # zero_grad() was not called
            self.flush_bytes()
        self._flushed_for = None
        self.flat.collect()
        add_decay(self.optimizer, self.rules)  # step 1
        # The forward pass's waits for the last update's chunks are communication exposed in
        # this step, not per-sample work.
        blocked = self._take_blocked()
        own_s = max(0.0, compute_s - blocked)
        upload = Upload(step, samples, loss, own_s)
        if self.outer is not None:
            inner = self._inner_step(step, loss=loss, samples=samples, compute_s=own_s)
            if inner is None:
                return
            own_s = inner
            self.outer.send(upload, self.max_steps)
        density = self.densities[self.index]
        self.uplink.send(upload, self.inbox, density, self._round(step))  # step 2
        self.uplink.wait(upload)
        sent = time.perf_counter()
        self._receive(step)  # steps 3-5
        if self.ended_by_server:
            return
        arrived = time.perf_counter()
        self.uplink.delivered(upload)
        if self.in_forward is None or self.in_forward.pending is None:
            self.step = step
        self._account(upload, step, loss=loss, samples=samples, compute_s=own_s,
                      total_s=compute_s + time.perf_counter() - t0, wait_s=arrived - sent + blocked,
                      density=1.0 if self.uplink.dense_step(step) else density)

    def _account(self, upload: Upload, step: int, *, loss: float, samples: int, compute_s: float,
                 total_s: float, wait_s: float, density: float) -> None:
        """A synchronised step's figures. Communication is all of the step this worker did not
        spend computing or compressing: its sends, the server's work and the update's way back
        (the bill's granularity is compute_s / comm_s). The send alone, at the link's rate
        (trainer.linkclock), is what the density rule reads."""
        self.uplink.step_times.append(total_s)
        compress_s = upload.topk_s + upload.encode_s
        self._log_step(step, loss=loss, samples=samples, total_s=total_s, compute_s=compute_s,
                       comm_s=max(0.0, total_s - compute_s - compress_s))
        self.metrics.log(step, "compress_s", compress_s)
        self.metrics.log(step, "wait_s", wait_s)
        self.metrics.log(step, "density", density)

    def _take_blocked(self) -> float:
        if self.in_forward is None:
            return 0.0
        blocked, self.in_forward.blocked_s = self.in_forward.blocked_s, 0.0
        return blocked

    def _receive(self, step: int) -> None:
        """Steps 3-5: the server's update of `step`, applied now; or, under apply-in-forward, its
        first chunk now and the rest in the next forward pass (the run's last step takes all at
        once); or, with --outer-delay, the outer step a few inner steps later."""
        if self.outer is not None and step in self.outer.pending:
            return
        if self.in_forward is not None and step < self.max_steps:
            self.in_forward.hold(step)
        else:
            self._read_round(step)

    def _round(self, step: int) -> tuple[int, ...]:
        """The chunks of `step`'s exchange: all, or streaming's fragments that sync after it."""
        return self.cfg.round_chunks(step, len(self.bounds), self.max_steps)

    def _read_round(self, step: int) -> None:
        """Read and take every chunk of `step`'s update."""
        chunks = self._round(step)
        self.link.read_update(step, self._take, start=chunks[0], stop=chunks[-1] + 1)

    def _update_arrived(self, step: int) -> bool:
        """Whether `step`'s update is here to read without waiting: its round's own last chunk
        (streaming: a fragment's round ends at that fragment's chunk)."""
        return self.link.update_arrived(step, self._round(step)[-1])

    def _take(self, update: Update, hyper: list[dict] | None = None) -> None:
        """Step 4 for one chunk; the chunk carrying the next batch split sets it, the last the
        next densities (and under local SGD the outer step)."""
        complete = self.applier.apply(update, hyper, last=self._round(update.step)[-1])
        if update.batch_sizes:
            self.batch_sizes = list(update.batch_sizes)
        if not complete:
            return
        self.densities = list(update.densities)
        if self.outer is not None:
            self.outer.apply(update.step, self.max_steps)

    def _caught_up(self, step: int) -> None:
        self.step = step

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

    # -- local SGD ------------------------------------------------------------------------------
    def _inner_step(self, step: int, *, loss: float, samples: int, compute_s: float) -> float | None:
        """The task's optimizer steps on this worker's gradient alone, or under site replicas on
        its site's mean gradient (trainer.outer_steps does the rest). When the outer step follows
        (the caller sends the pseudo-gradient), the step's compute, its optimizer step included;
        else None: the step is done here."""
        waited = self.site.average(step, samples) if self.site is not None else 0.0
        started = time.perf_counter()
        self.optimizer.step()
        # The task's optimizer step is this worker's own work, slower on a slower device: it
        # counts as compute, so that the re-split at the outer step sees it (docs/trainer.md).
        compute_s += time.perf_counter() - started
        due, late = self.outer.after_inner_step(step, self.max_steps, loss=loss, samples=samples,
                                                compute_s=compute_s, site_s=waited)
        if due:
            return compute_s
        waited += late
        self.step = step
        self.uplink.step_times.append(compute_s + waited)
        self._log_step(step, loss=loss, samples=samples, total_s=compute_s + waited, compute_s=compute_s,
                       comm_s=waited)
        return None

    @contextmanager
    def global_model(self) -> Iterator[None]:
        """The run's model in the parameters for the block: under local SGD the common one of
        the last outer step (an evaluation scores that, not one worker's drift since)."""
        if self.outer is None:
            yield
            return
        with self.outer.global_model(self.step):
            yield

    def evaluation_would_wait(self) -> bool:
        """Whether an evaluation now would first wait for an outer step on its way that every
        worker applies after the same later inner step (a fixed --outer-delay, one fragment):
        the task loop evaluates after that step instead (asynchronous and streaming runs, whose
        workers land their outer steps at different steps or always have one on its way, wait)."""
        return (self.outer is not None and bool(self.outer.pending) and not self.cfg.asynchronous
                and self.outer.local.fragments == 1)

    def drain(self) -> None:
        """Apply whatever update is still on its way (apply-in-forward's later chunks; local SGD's
        overlapped outer step), so that the model is the run's current one: before an
        evaluation, a checkpoint, leaving, the end."""
        if self.outer is not None:
            self.outer.land(self.step)
        if self.in_forward is not None:
            self.in_forward.drain()

    # -- evaluation -----------------------------------------------------------------------------
    def average_buffers(self, step: int) -> None:
        """Pitfall: BatchNorm statistics are averaged by batch share before evaluation."""
        self.drain()
        buffers = float_buffers(self.model)
        if not buffers:
            return
        flat = torch.cat([b.reshape(-1).float().cpu() for b in buffers])
        self.transport.send(SERVER, pack(Buffers(step, self.rank, self.batch_sizes[self.index], flat)))
        reply = self.link.expect(BuffersAvg, step)
        if reply is None:
            return
        off = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(reply.values[off : off + b.numel()].view_as(b))
                off += b.numel()

    def combine_eval(self, step: int, sums: dict[str, float], count: int,
                     seconds: float = 0.0) -> tuple[dict[str, float], bool]:
        """Send this worker's metric sums and how long it evaluated; the server answers with the
        run's means and whether the target stops the run."""
        self.drain()
        self.transport.send(SERVER, pack(Eval(step, self.rank, sums, count, seconds)))
        result = self.link.expect(EvalResult, step)
        if result is None:
            self.stopped = True
            return {}, True
        self.stopped = result.stop
        return result.values, result.stop

    # -- leaving and the end ----------------------------------------------------------------------
    def close(self) -> None:
        """BYE to the server once every update is applied; returns once the server has said BYE
        too. The run ends with every replica equal to the model the server's updates make (under
        local SGD the common one of the last outer step: a run stopped between outer steps)."""
        if self.left:
            return
        self.drain()
        if self.outer is not None:
            self.outer.end_on_common(self.step)
        if self.ended_by_server:
            return
        self._bye(leaving=False)
        # A relay forwards the server's BYE to its peers from the inbox thread, which ends theirs.
        self.link.expect(Bye)
        self.link.wait_for_byes({self.relay.update_source, *self.relay.site})
        self.flush_bytes()

    def leave(self) -> None:
        """Leave a run that goes on (a spot notice): BYE with `leaving` at this step boundary;
        returns once the server has let this worker go."""
        if self.left:
            return
        self.drain()
        self.left = self.relay.left = True
        self._bye(leaving=True)
        self.link.expect(Bye)
        self.flush_bytes()

    def _bye(self, *, leaving: bool) -> None:
        frame = pack(Bye(self.step, self.rank, leaving=leaving))
        self.transport.send(SERVER, frame)
        if self.relay.up != SERVER:  # ends the relay's wait on this worker's chunks
            self.transport.send(self.relay.up, frame)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Residual, velocity, densities, batch sizes, last transmission time (the model and
        optimizer are the caller's, current once this returns: a pending update is applied)."""
        self.drain()
        combiner = self.relay.combiner
        return {
            "residual": join_residuals(self.uplink.states),
            "densities": self.densities,
            "batch_sizes": self.batch_sizes,
            "last_tx_s": self.uplink.last_tx_s,
            "velocity": self.velocity,
            "site_residual": join_residuals(combiner.states) if combiner is not None else None,
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
        split_residual(self.uplink.states, None if residual is None else residual.to(self.device), self.bounds)
        self.densities = list(state["densities"])
        self.batch_sizes = list(state["batch_sizes"])
        self.uplink.last_tx_s = state["last_tx_s"]
        if self.velocity is not None:
            self.velocity.copy_(state["velocity"])
        if self.relay.combiner is not None:
            split_residual(self.relay.combiner.states, state.get("site_residual"), self.bounds)
        self.flat.bind()
