"""The parameter server (rank 0 of the `ps*` strategies): steps 3 and 5 of `trainer.ps`'s
outline. It owns the aggregation state (its residual, the densities, the batch sizes, the
timing windows) and answers the workers' frames (GRAD, BUFFERS, EVAL) round by round until
each has said BYE; it never holds the model, only the layout every worker's HELLO carries.
Between rounds the workers may change (trainer.boundary, docs/elastic.md)."""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, replace

from hybridtrain.contract import EVAL_S, parse_target
from trainer.algorithm import adapt_densities, aggregate_sparsified, chunks
from trainer.allocation import aggregation_weights, rebalance
from trainer.boundary import Boundary
from trainer.codec_state import codec, dense_chunk, join_residuals, sends_dense, split_residual
from trainer.compression import CompressionState, Payload
from trainer.config import TrainConfig
from trainer.frames import (
    LAST_KINDS,
    SERVER,
    Abort,
    Buffers,
    BuffersAvg,
    Bye,
    Eval,
    EvalResult,
    Grad,
    LayoutSpec,
    ProtocolError,
    Update,
    expect,
    pack,
    unpack,
)
from trainer.membership import Member, Roster
from trainer.metrics import MetricsLogger
from trainer.transport import Inbox, Transport

log = logging.getLogger("trainer.server")


@dataclass(frozen=True)
class _Row:
    """One worker's own figures of a step, as the server plans from them."""

    rank: int
    loss: float
    samples: int
    compute_s: float
    last_tx_s: float
    topk_s: float


def worker_rows(grads: list[Grad]) -> list[_Row]:
    """Each worker's figures in rank order, a site's combined frame expanded into its members."""
    rows = [_Row(int(r[0]), r[1], int(r[2]), r[3], r[4], r[5]) for g in grads for r in (g.members or (g.own(),))]
    return sorted(rows, key=lambda r: r.rank)


class ParameterServer(Boundary):
    """Rank 0: owns the aggregation state (server residual, densities, batch sizes, timings) and
    answers the workers' frames until each has said BYE; between steps it changes who is in
    (trainer.boundary)."""

    def __init__(self, cfg: TrainConfig, transport: Transport, metrics: MetricsLogger) -> None:
        self.cfg, self.transport, self.metrics = cfg, transport, metrics
        self.roster = Roster(cfg)
        self.codec = codec(cfg, "topk")
        self.target = parse_target(cfg.target) if cfg.target else None
        self.layout = None
        self.bounds: tuple[tuple[int, int], ...] = ()
        self.codec_states: list[CompressionState] = []
        self.compute_window: list[list[float]] = []
        self.overhead_window: list[list[float]] = []
        self._window_ranks: list[int] = []
        # Apply-in-forward: each worker's compression time of its last whole step, the fixed cost
        # the next split counts when it is planned at the first chunk.
        self._compress_s: dict[int, float] = {}
        self.max_steps = cfg.max_steps
        self.elapsed_s = 0.0
        self.reached_at: float | None = None
        self.step = 0
        self.start_step = 0
        self.stopped = False
        self._t0 = time.time()
        self._last_print = 0.0
        self._resume_state: dict | None = None
        self._warned_target = False
        self.inbox = Inbox(transport, [], timeout_s=cfg.timeout_s, last_kinds=LAST_KINDS)
        Boundary.__init__(self)

    @property
    def workers(self) -> list[int]:
        """The live workers."""
        return self.roster.ranks()

    @property
    def batch_sizes(self) -> list[int]:
        return self.roster.batch_sizes

    @property
    def densities(self) -> list[float]:
        return self.roster.densities

    @densities.setter
    def densities(self, values: list[float]) -> None:
        self.roster.densities = list(values)

    # -- the loop ------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Handshake, then answer GRAD, BUFFERS and EVAL rounds until every worker says BYE;
        membership changes at the boundaries between rounds."""
        try:
            self._handshake()
            while True:
                self.boundary()
                round_start = time.perf_counter()
                first, frames = self._gather_round()
                if not frames:
                    continue  # everyone in the round was lost or left: the boundary decides
                kind = self._round_kind(frames)
                if kind is Grad:
                    self._serve_step(frames, {w: t for w, (_, t) in first.items()}, round_start)
                elif kind is Buffers:
                    self._serve_buffers(frames)
                elif kind is Eval:
                    self._serve_eval(frames)
                elif kind is Bye:
                    self.finish()
                    return
                else:
                    raise ProtocolError(f"unexpected {kind.__name__} from the workers")
        except ProtocolError as exc:
            self._abort(str(exc))
            raise
        finally:
            self.close_store()

    def _gather_round(self) -> tuple[dict, dict]:
        """The next frame of every worker in the round: the GRAD senders first; if that is not
        a step, everyone. Lost workers are dropped and leaving ones let go on the way."""
        first = self._collect(self.roster.senders(), first_s=self.cfg.timeout_s)
        frames = {w: unpack(raw) for w, (raw, _) in first.items()}
        frames = self._let_leavers_go(frames)
        if frames and not all(isinstance(f, Grad) for f in frames.values()):
            # Not a step: every worker takes part (an evaluation, the goodbye).
            rest = [w for w in self.roster.active() if w not in first and w not in self._gone]
            # The round is under way (its first frames are in): the rest (under per-site
            # aggregation, the relays' site workers) are held to the loss deadline too.
            more = self._collect(rest, first_s=self.roster.loss_deadline_s())
            first.update(more)
            frames.update(self._let_leavers_go({w: unpack(raw) for w, (raw, _) in more.items()}))
            # A worker admitted just before an evaluation starts at the step after it: its
            # gradient waits until the others have evaluated the step it did not train.
            done = {f.step for f in frames.values() if not isinstance(f, Grad) and hasattr(f, "step")}
            for w in [w for w, f in frames.items() if isinstance(f, Grad) and done and f.step > max(done)]:
                self.inbox.unget(w, first.pop(w))
                del frames[w]
        first = {w: v for w, v in sorted(first.items()) if w in frames}
        return first, dict(sorted(frames.items()))

    def _round_kind(self, frames: dict) -> type:
        kinds = {type(f) for f in frames.values()}
        aborts = [f for f in frames.values() if isinstance(f, Abort)]
        if aborts:
            raise ProtocolError(aborts[0].reason)
        if len(kinds) != 1:
            said = ", ".join(f"rank {w}: {type(f).__name__}" + (f" step {f.step}" if hasattr(f, "step") else "")
                             for w, f in frames.items())
            raise ProtocolError(f"the workers disagree on what comes next ({said}): every "
                                "worker must run the same steps and evaluations")
        return kinds.pop()

    def _abort(self, reason: str) -> None:
        try:
            # Everyone connected hears it, also workers not admitted yet (a failed start).
            self.transport.send_many([w for w in self.inbox.peers if w not in self._gone],
                                     pack(Abort(SERVER, reason)))
        except Exception:  # noqa: BLE001 - the run is failing already; the reason is what matters
            log.debug("could not tell the workers to abort", exc_info=True)

    def flush_bytes(self) -> None:
        """Log the bytes since the last flush under the last step (see `PSClient.flush_bytes`)."""
        self.metrics.log_bytes(self.step, *self.transport.take_counts())

    def configure(self, layout: LayoutSpec) -> None:
        """Size the aggregation state for the workers' model (and restore a resumed run's)."""
        self.layout = layout
        if not self.roster:  # configured without a handshake: the run's planned workers
            for w in range(1, self.cfg.workers + 1):
                self.roster.add(Member(w))
        self.bounds = chunks(layout.sparse_numel, self.cfg.pipeline_chunks)
        # Each chunk keeps k_s * its share of the elements, with its own residual.
        self.codec_states = [CompressionState(density=self.cfg.densities[3], seed=self.cfg.seed)
                             for _ in self.bounds]
        if self._resume_state is not None:
            self._load(self._resume_state)

    def _serve_step(self, first: dict, wire: dict[int, float], t0: float) -> None:
        """One step's rounds, chunk by chunk; `t0` is when the server began waiting for it."""
        # This step's first frames are already consumed: their bytes belong to this step.
        sent, recv = self.transport.take_counts()
        firsts = {w: pack(f).numel() + 8 for w, f in first.items()}
        self.metrics.log_bytes(self.step, sent, {w: n - firsts.get(w, 0) for w, n in recv.items()})
        for w, n in firsts.items():
            self.transport.bytes_recv[w] += n
        step = next(iter(first.values())).step
        if any(f.step != step for f in first.values()):
            raise ProtocolError(f"the workers are out of step: {[(w, f.step) for w, f in first.items()]}")
        before = t0
        wait_s = compress_s = comm_s = 0.0
        waits, sent = [], 0
        arrival = dict(wire)
        frames = first
        self.last_updates = []
        last = len(self.bounds) - 1
        for chunk in range(len(self.bounds)):
            if chunk:
                got = self._collect([w for w in frames if w in self.roster], first_s=self.cfg.timeout_s)
                frames = {w: expect(raw, Grad, step, peer=w) for w, (raw, _) in got.items()}
                for w, (_, t) in got.items():
                    arrival[w] += t
            # Per-site aggregation: the workers of a relay lost this step send this chunk
            # themselves unless the relay passed it on first.
            late = [w for w, upto in self._covered.items()
                    if w in self.roster and w not in frames and upto < (step, chunk)]
            if late:
                got = self._collect(late, first_s=self.cfg.timeout_s)
                frames = dict(sorted({**frames, **{w: expect(raw, Grad, step, peer=w)
                                                   for w, (raw, _) in got.items()}}.items()))
                for w, (_, t) in got.items():
                    arrival[w] = arrival.get(w, 0.0) + t
            if not frames:
                raise ProtocolError(f"every worker of step {step} was lost mid-step")
            t1 = time.perf_counter()
            wait_s += t1 - before
            grads = list(frames.values())
            if any(g.chunk != chunk for g in grads):
                raise ProtocolError(f"server: expected chunk {chunk} of step {step}, got "
                                    f"{[(g.sender, g.chunk) for g in grads]}")
            if self.cfg.site_aggregation:
                for w in frames:
                    self._relayed[w] = (step, chunk)
                if chunk == last:
                    for g in grads:
                        if g.members:
                            self.settle_site(g.sender, tuple(int(r[0]) for r in g.members))
            update = self.aggregate(step, grads, chunk, arrival)
            sent += update.sparse.count
            frame = pack(update)
            self.last_updates.append(frame)
            t2 = time.perf_counter()
            compress_s += t2 - t1
            waits.append(self.transport.post_many(self.roster.update_targets(), frame))
            before = time.perf_counter()
            comm_s += before - t2
        for wait in waits:
            wait()
        t3 = time.perf_counter()
        comm_s += t3 - before
        self.step = step
        self.roster.note_step(t3 - t0)
        self.roster.caught_up()
        mlog = self.metrics.log
        if math.isfinite(update.loss):
            mlog(step, "loss", update.loss)
        mlog(step, "batch_size", sum(g.samples for g in grads))  # a site's frame counts its site
        mlog(step, "samples_per_s", sum(g.samples for g in grads) / max(t3 - t0, 1e-9))
        mlog(step, "wait_s", wait_s)
        mlog(step, "compress_s", compress_s)
        mlog(step, "comm_s", comm_s)
        mlog(step, "density", sent / max(1, self.layout.sparse_numel))
        self._progress(step, update.loss)

    def aggregate(self, step: int, grads: list[Grad], chunk: int, arrival: dict[int, float] | None = None) -> Update:
        """Steps 3 and 5 for one chunk: the weighted sum (eq. 1-2) and server compression; with
        the last chunk, the step's loss and next step's plan."""
        a, b = self.bounds[chunk]
        state = self.codec_states[chunk]
        state.step = step
        dense_step = sends_dense(self.cfg, step)
        dense, payload = aggregate_sparsified(grads, self.layout.dense_numel if chunk == dense_chunk(self.cfg) else 0,
                                              b - a, codec=self.codec, state=state, dense_step=dense_step)
        last = len(self.bounds) - 1
        ahead = self.cfg.applies_in_forward
        if chunk == 0 and ahead and last:
            # Apply-in-forward: the workers take the next batch split from the first chunk, before
            # the rest arrives, so it is planned here: from this step's compute times (every
            # chunk's frame carries them) and each worker's compression of its last whole step.
            rows = [replace(r, topk_s=self._compress_s.get(r.rank, r.topk_s * len(self.bounds)))
                    for r in worker_rows(grads)]
            self._plan(step, rows, {}, densities=False)
            return Update(step, chunk, Payload(dense.numel(), dense), payload,
                          densities=tuple(self.densities), batch_sizes=tuple(self.batch_sizes))
        if chunk < last:
            return Update(step, chunk, Payload(dense.numel(), dense), payload)
        # The last chunk's frames carry the step's full timings (compression summed); a site's
        # combined frame carries each of its workers' own.
        rows = worker_rows(grads)
        if ahead:
            self._compress_s.update({r.rank: r.topk_s for r in rows})
        self._plan(step, rows, arrival or {}, batches=not ahead)
        alphas = aggregation_weights([r.samples for r in rows])
        losses = [r.loss for r in rows]
        loss = sum(w * x for w, x in zip(alphas, losses)) if all(map(math.isfinite, losses)) else math.nan
        return Update(step, chunk, Payload(dense.numel(), dense), payload, loss,
                      tuple(self.densities), tuple(self.batch_sizes))

    def _plan(self, step: int, rows: list[_Row], arrival: dict[int, float], *, densities: bool = True,
              batches: bool = True) -> None:
        """Densities from last transmission times (step 5); batch sizes from compute and
        compression times. Only the workers still in the run are planned for."""
        rows = [r for r in rows if r.rank in self.roster]
        if not rows:
            return
        ranks = [r.rank for r in rows]
        if batches:
            self.roster.note_rates([(r.rank, r.samples, r.compute_s) for r in rows])
            self.roster.note_spread([r.compute_s + r.topk_s for r in rows])
        if densities and self.cfg.compresses and step > self.cfg.warmup_steps + 1:
            # A link's time is the longer of the worker's own send time (previous step, its bytes
            # at the rate TCP measured: trainer.linkclock) and the frame's arrival time seen here
            # (this step): each clock can read short where the other does not.
            times = [max(r.last_tx_s, arrival.get(r.rank, 0.0)) for r in rows]
            target, low, high, _ = self.cfg.densities
            adapted = adapt_densities(
                [self.densities[k - 1] for k in ranks], times, target=target,
                low=low, high=high, gamma=self.cfg.density_gamma,
                floor=self.cfg.density_time_floor_s,
            )
            for k, d in zip(ranks, adapted):
                self.roster.densities[k - 1] = d
        # `measured` refines whatever split the run started from; compression time counts as a
        # fixed per-step cost (trainer.allocation.rebalance).
        if batches and self.cfg.allocation == "measured" and len(self.roster) > 1:
            if ranks != self._window_ranks or ranks != self.roster.ranks():
                # Membership changed: a window over other workers says nothing about these.
                self.compute_window, self.overhead_window, self._window_ranks = [], [], ranks
                if ranks != self.roster.ranks():
                    return
            self.compute_window.append([r.compute_s for r in rows])
            self.overhead_window.append([r.topk_s for r in rows])
            if len(self.compute_window) >= self.cfg.rebalance_every:
                means = [sum(col) / len(col) for col in zip(*self.compute_window)]
                overheads = [sum(col) / len(col) for col in zip(*self.overhead_window)]
                shares = self.roster.shares(ranks)
                self.roster.set_shares(ranks, rebalance(sum(shares), shares, means, overheads))
                self.compute_window, self.overhead_window = [], []

    def _serve_buffers(self, frames: dict) -> None:
        msgs = list(frames.values())
        alphas = aggregation_weights([m.samples for m in msgs])
        avg = sum(a * m.values.float() for a, m in zip(alphas, msgs))
        self.transport.send_many(list(frames), pack(BuffersAvg(msgs[0].step, avg)))

    def _serve_eval(self, frames: dict) -> None:
        msgs = list(frames.values())
        step = msgs[0].step
        count = sum(m.count for m in msgs)
        names = sorted(set().union(*(m.sums for m in msgs)))
        values = {n: sum(m.sums.get(n, 0.0) for m in msgs) / max(1, count) for n in names}
        reached = False
        if self.target is not None:
            if self.target.metric in values:
                reached = self.target.reached(values[self.target.metric])
            elif not self._warned_target:
                self._warned_target = True
                print(f"[ps] warning: the target {self.target} names a metric the evaluation does not "
                      f"report (it reports {', '.join(names) or 'none'})", file=sys.stderr, flush=True)
        self.stopped = reached and self.cfg.stop_at_target
        self.transport.send_many(list(frames), pack(EvalResult(step, values, self.stopped)))
        for name, value in values.items():
            self.metrics.log(step, name, value)
        # The slowest worker's evaluation is what it cost the run (the others wait on it).
        self.metrics.log(step, EVAL_S, max(m.seconds for m in msgs))
        if reached and self.reached_at is None:
            self.reached_at = self.elapsed()
            self.metrics.log(step, "time_to_target_s", self.reached_at)
        self._progress(step, self.metrics.last.get("loss", math.nan), values)

    def _progress(self, step: int, loss: float, values: dict[str, float] | None = None) -> None:
        now = time.time()
        if values is None and now - self._last_print < 2.0 and step != self.max_steps:
            return
        self._last_print = now
        extra = "".join(f" {k} {v:.4f}" for k, v in (values or {}).items())
        print(f"[ps] step {step}/{self.max_steps} loss {loss:.4f}{extra} elapsed {self.elapsed():.1f}s",
              file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        """Training seconds so far, across resumes."""
        return self.elapsed_s + time.time() - self._t0

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Server residual, densities, batch sizes (and whose), timing windows, elapsed time: a
        snapshot, which later rounds leave alone (a scheduled checkpoint is written after them)."""
        residual = join_residuals(self.codec_states)
        # One chunk's residual is the codec's own tensor, which the next rounds update in place.
        if residual is not None and len(self.codec_states) == 1:
            residual = residual.clone()
        return {
            "residual": residual,
            "ranks": self.roster.ranks(),
            "densities": list(self.densities),
            "batch_sizes": list(self.batch_sizes),
            "compute_window": [list(r) for r in self.compute_window],
            "overhead_window": [list(r) for r in self.overhead_window],
            "elapsed_s": self.elapsed(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` once the layout is known (at the handshake)."""
        self._resume_state = state
        self.start_step = state["step"]
        self.step = state["step"]

    def _load(self, state: dict) -> None:
        split_residual(self.codec_states, state["residual"], self.bounds)
        self.elapsed_s = state["elapsed_s"]
        # The split and densities were planned for the workers of then: kept only for the same set.
        if state.get("ranks") == self.roster.ranks():
            self.roster.densities = list(state["densities"])
            self.roster.batch_sizes = list(state["batch_sizes"])
            self.compute_window = [list(r) for r in state["compute_window"]]
            self.overhead_window = [list(r) for r in state.get("overhead_window", [])]
            self._window_ranks = self.roster.ranks()


def serve_in_thread(server: ParameterServer) -> tuple[threading.Thread, list[BaseException]]:
    """Run `server.serve()` on a thread (tests, in-process demos); errors land in the list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.serve()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            errors.append(exc)

    thread = threading.Thread(target=run, name="parameter-server", daemon=True)
    thread.start()
    return thread, errors
