"""The parameter server (rank 0 of the `ps*` and local-SGD strategies): steps 3 to 5 of
`trainer.ps`'s outline. `ParameterServer.serve` is the core loop: greet the workers, then at
each boundary change who takes part and answer one round: a step (GRAD), a buffer average, an
evaluation, or the goodbye. It never holds the model, only the layout every worker's HELLO
carries. Each part of the work is a helper it holds, with its own state:

- `Joiner` (trainer.joiner): the start's HELLOs and WELCOMEs, later joiners, the --min-workers wait;
- `Departures` (trainer.departures): lost and leaving workers, a lost relay's site;
- `Gatherer` (trainer.gathering): a round's frames, with the lost dropped on the way;
- `LateChanges` (trainer.late_changes): asynchronous outer steps' stragglers, left out of a
  round and their change folded into a later one;
- `Donors` (trainer.donors): a live worker's state (FETCH), for a joiner or a checkpoint;
- `Aggregator` (trainer.aggregator): eq. 1-2 and the server's compression, chunk by chunk;
- `Planner` (trainer.planner): the next step's densities and batch split;
- `Checkpointer` (trainer.checkpointing): when to checkpoint, asking a worker, writing the file;
- `RunProgress` (trainer.progress): the run's clock, progress lines and target.

They share the run's `Roster` (trainer.membership) and transport, passed to each explicitly."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict

from hybridtrain.contract import EVAL_S, steps_for_epochs
from trainer.aggregator import Aggregator
from trainer.allocation import aggregation_weights
from trainer.checkpointing import Checkpointer
from trainer.compression import Payload
from trainer.config import TrainConfig
from trainer.departures import Departures
from trainer.donors import Donors
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
from trainer.gathering import Gatherer
from trainer.joiner import Joiner
from trainer.late_changes import Fold, LateChanges
from trainer.membership import Member, Roster
from trainer.metrics import MetricsLogger
from trainer.planner import Planner, WorkerRow
from trainer.progress import RunProgress
from trainer.transport import Inbox, Transport

log = logging.getLogger("trainer.server")


class Preempted(ProtocolError):
    """The server got SIGTERM (a spot notice): it checkpointed and stops the run."""


class ParameterServer:
    """Rank 0: answers the workers' frames round by round until each has said BYE; between
    rounds it changes who is in. Its helpers own the state (see the module's docstring)."""

    def __init__(self, cfg: TrainConfig, transport: Transport, metrics: MetricsLogger) -> None:
        self.cfg, self.transport, self.metrics = cfg, transport, metrics
        self.inbox = Inbox(transport, [], timeout_s=cfg.timeout_s, last_kinds=LAST_KINDS)
        self.roster = Roster(cfg)
        self.checkpoints = Checkpointer(cfg)
        self.departures = Departures(cfg, self.roster, transport, self.inbox, metrics, self.checkpoints)
        self.aggregator = Aggregator(cfg)
        self.late = LateChanges(lambda: self.aggregator.chunks) if cfg.defers_late_changes else None
        self.gatherer = Gatherer(cfg, self.roster, self.inbox, self.departures, self.checkpoints, self.late)
        self.donors = Donors(cfg, self.roster, transport, self.inbox, self.departures)
        self.joiner = Joiner(cfg, self.roster, transport, self.inbox, metrics, self.departures, self.donors,
                             self.checkpoints)
        self.planner = Planner(cfg, self.roster)
        self.progress = RunProgress(cfg)
        self.layout: LayoutSpec | None = None
        self.step = 0
        self.max_steps = cfg.max_steps
        self.preempted = False
        self._resume_state: dict | None = None

    # -- the loop ------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Greet the workers, then answer their rounds until every one has said BYE; membership
        changes at the boundaries between rounds."""
        try:
            self.start()
            done = False
            while not done:
                self.boundary()
                done = self.serve_round()
        except ProtocolError as exc:
            self.abort(str(exc))
            raise
        finally:
            self.checkpoints.close_run(self.metrics)

    def start(self) -> None:
        """The handshake: the workers' HELLOs, the aggregation state sized for their model, then
        each worker's WELCOME and the weights they all start from."""
        first = self.joiner.greet()
        self.configure(first.layout)
        if self.cfg.epochs:
            if not first.train_samples:
                raise ProtocolError("--epochs needs a training set whose length is known (a map-style "
                                    "Dataset); give --max-steps for a streaming one")
            self.max_steps = steps_for_epochs(self.cfg.epochs, first.train_samples, self.cfg.global_batch)
        self.joiner.welcome(self.step, self.max_steps)
        self.metrics.log(self.step, "params", first.layout.numel)
        self.metrics.log(self.step, "max_steps", self.max_steps)
        self.progress.start()

    def boundary(self) -> None:
        """Between rounds: drop the lost, admit newcomers, wait below --min-workers, checkpoint
        when due, stop on a spot notice."""
        layout = self._layout()
        self.departures.drop_failed(self.step)
        self.departures.require_a_worker(self.step)
        self.checkpoints.log_written(self.metrics)
        if self.joiner.elastic:
            self.joiner.admit(layout, self.step, self.max_steps)
        if len(self.roster) < max(1, self.cfg.min_workers):
            self.joiner.wait_for_workers(layout, self.step, self.max_steps)
        if self.checkpoints.wanted(self.step):
            self.checkpoints.ask(self.step, self.donors, self.state_dict)
        if self.preempted:
            self.preempt()

    def serve_round(self) -> bool:
        """Answer the next round; True once it was the goodbye."""
        began = time.perf_counter()
        close_s = self.late.deadline_s(self.roster.loss_deadline_s()) if self.late is not None else None
        first, frames, left_out = self.gatherer.gather_round(self.step, close_s=close_s)
        if not frames:
            return False  # everyone in the round was lost or left: the boundary decides
        kind = round_kind(frames)
        if kind is Grad:
            if left_out and next(iter(frames.values())).step >= self.max_steps:
                # The run's last outer step waits for everyone: the run ends on every change.
                first, left_out = self.wait_for(left_out, first), []
                frames = {w: unpack(raw) for w, (raw, _) in first.items()}
            self.serve_step(frames, {w: t for w, (_, t) in first.items()}, began, left_out=left_out)
        elif kind is Buffers:
            self.serve_buffers(frames)
        elif kind is Eval:
            self.serve_eval(frames)
        elif kind is Bye:
            self.finish()
            return True
        else:
            raise ProtocolError(f"unexpected {kind.__name__} from the workers")
        return False

    def wait_for(self, ranks: list[int], first: dict) -> dict:
        """`first` with the next frames of `ranks` (left out of a round that must not close without
        them), held to the loss deadline."""
        more = self.gatherer.collect(ranks, self.step, first_s=self.roster.loss_deadline_s())
        more = {w: v for w, v in more.items() if w not in self.departures.gone}
        return dict(sorted({**first, **more}.items()))

    # -- a step --------------------------------------------------------------------------------------
    def serve_step(self, frames: dict[int, Grad], arrival: dict[int, float], began: float, *,
                   left_out: list[int] | None = None) -> None:
        """One step (paper section III), chunk by chunk: gather the workers' compressed gradients,
        sum them weighted by their samples and re-sparsify (eq. 1-2, step 3), plan the next step's
        batch split and densities (step 5), and send everyone the one update. Under local SGD the
        same round is an outer step (DiLoCo's algorithm 1): the frames carry pseudo-gradients, and
        the workers apply the outer optimizer to the weighted mean this sends back; streaming, the
        round is of the fragments whose outer step follows this step, a chunk each (the workers
        know which from the same schedule, `TrainConfig.round_chunks`).
        `frames`: the first chunk's, `arrival`: their seconds on the wire, `began`: when the
        server began waiting for them. Asynchronous (trainer.late_changes), `left_out` missed the
        round's deadline, and the late changes whose chunks are all in join the mean."""
        step = self._open_step(frames)
        fold = self.late.fold(self.roster) if self.late is not None else None
        laps = Laps(began)
        waits, kept = [], 0
        self.departures.new_step()
        round_ = self.cfg.round_chunks(step, self.aggregator.chunks, self.max_steps)
        for chunk in round_:
            frames = self.gather_chunk(step, chunk, frames, arrival, first=round_[0])
            laps.add("wait_s")
            self.account_sites(step, chunk, frames)
            update = self.aggregate(step, list(frames.values()), chunk, arrival)
            kept += update.sparse.count
            frame = pack(update)
            self.departures.sent(frame)  # sent again to a relay's workers should it be lost
            laps.add("compress_s")
            waits.append(self.transport.post_many(self.roster.update_targets(), frame))
            laps.add("comm_s")
        for wait in waits:
            wait()
        laps.add("comm_s")
        self.close_step(step, list(frames.values()), update, laps, kept,
                        sum(b - a for a, b in (self.aggregator.bounds[c] for c in round_)),
                        late_samples=fold.samples if fold is not None else 0)
        if self.late is not None and fold is not None:
            self.close_late(step, list(frames.values()), left_out or [], fold)

    def close_late(self, step: int, grads: list[Grad], left_out: list[int], fold: Fold) -> None:
        """Asynchronous outer steps: the round is closed for `LateChanges`; how many workers it went
        on without, and how many late changes it took or dropped, go into the metrics."""
        assert self.late is not None
        self.late.closed(step, grads, left_out)
        mlog = self.metrics.log
        mlog(step, "outer_deferred", len(left_out))
        mlog(step, "outer_folded", fold.folded)
        mlog(step, "outer_dropped", fold.dropped)
        if left_out or fold.dropped:
            log.info("outer step %d went on without ranks %s; folded %d late changes, dropped %d",
                     step, left_out, fold.folded, fold.dropped)

    def _open_step(self, frames: dict[int, Grad]) -> int:
        """The step the first frames are of; the bytes so far logged under the last step."""
        # This step's first frames are already consumed: their bytes belong to this step.
        sent, recv = self.transport.take_counts()
        firsts = {w: pack(f).numel() + 8 for w, f in frames.items()}
        self.metrics.log_bytes(self.step, sent, {w: n - firsts.get(w, 0) for w, n in recv.items()})
        for w, n in firsts.items():
            self.transport.bytes_recv[w] += n
        step = next(iter(frames.values())).step
        if any(f.step != step for f in frames.values()):
            raise ProtocolError(f"the workers are out of step: {[(w, f.step) for w, f in frames.items()]}")
        return step

    def gather_chunk(self, step: int, chunk: int, frames: dict[int, Grad], arrival: dict[int, float], *,
                     first: int = 0) -> dict[int, Grad]:
        """Chunk `chunk` of `step` from every worker still in it (the round's `first` chunk's are
        `frames` already), adding each frame's seconds on the wire to `arrival`."""
        if chunk != first:
            got = self.gatherer.collect([w for w in frames if w in self.roster], self.step, first_s=self.cfg.timeout_s)
            frames = {w: expect(raw, Grad, step, peer=w) for w, (raw, _) in got.items()}
            for w, (_, t) in got.items():
                arrival[w] += t
        # Per-site aggregation: the workers of a relay lost this step send this chunk themselves
        # unless the relay passed it on first.
        late = self.departures.owing(step, chunk, frames)
        if late:
            got = self.gatherer.collect(late, self.step, first_s=self.cfg.timeout_s)
            frames = dict(sorted({**frames, **{w: expect(raw, Grad, step, peer=w)
                                               for w, (raw, _) in got.items()}}.items()))
            for w, (_, t) in got.items():
                arrival[w] = arrival.get(w, 0.0) + t
        if not frames:
            raise ProtocolError(f"every worker of step {step} was lost mid-step")
        if any(g.chunk != chunk for g in frames.values()):
            raise ProtocolError(f"server: expected chunk {chunk} of step {step}, got "
                                f"{[(g.sender, g.chunk) for g in frames.values()]}")
        return frames

    def account_sites(self, step: int, chunk: int, frames: dict[int, Grad]) -> None:
        """Per-site aggregation (and site replicas' outer steps): note whose gradients each frame
        brought; at the last chunk, drop a site's workers its relay went on without."""
        if not self.cfg.combines_at_sites:
            return
        self.departures.passed_on(list(frames), step, chunk)
        if chunk == self.aggregator.chunks - 1:
            for g in frames.values():
                if g.members:
                    self.departures.settle_site(g.sender, tuple(int(r[0]) for r in g.members), self.step)

    def aggregate(self, step: int, grads: list[Grad], chunk: int, arrival: dict[int, float] | None = None) -> Update:
        """Steps 3 and 5 for one chunk: the weighted sum (eq. 1-2) and server compression; with
        the round's last chunk (streaming: its last fragment's), the step's loss and next step's
        plan. Asynchronous, the late changes the round takes (`LateChanges.taking`) join both."""
        fold = self.late.taking if self.late is not None else None
        late = fold.grads(chunk) if fold is not None else []
        if late:
            dense, payload = self.aggregator.combine(step, chunk, grads + [g for g, _ in late],
                                                     [g.samples for g in grads] + [w for _, w in late])
        else:
            dense, payload = self.aggregator.combine(step, chunk, grads)
        last = self.cfg.round_chunks(step, self.aggregator.chunks, self.max_steps)[-1]
        if chunk == 0 and self.cfg.applies_in_forward and last:
            self.planner.plan_early(step, grads, self.aggregator.chunks)
            return Update(step, chunk, Payload(dense.numel(), dense), payload,
                          densities=tuple(self.roster.densities), batch_sizes=tuple(self.roster.batch_sizes))
        if chunk < last:
            return Update(step, chunk, Payload(dense.numel(), dense), payload)
        others = latest_others(grads, fold)
        rows = self.planner.plan_step(step, grads + others, arrival or {})
        # The round's loss is of its own changes, not of a straggler's older one.
        stale = {g.sender for g in others}
        return Update(step, chunk, Payload(dense.numel(), dense), payload,
                      step_loss([r for r in rows if r.rank not in stale]),
                      tuple(self.roster.densities), tuple(self.roster.batch_sizes))

    def close_step(self, step: int, grads: list[Grad], update: Update, laps: Laps, kept: int,
                   sent_numel: int | None = None, *, late_samples: int = 0) -> None:
        """The step is answered: its time for the loss deadline, joiners caught up, its metrics
        (`late_samples`: late changes' samples the round's mean took, trainer.late_changes)."""
        self.step = step
        self.roster.note_step(laps.total())
        self.roster.caught_up()
        mlog = self.metrics.log
        if math.isfinite(update.loss):
            mlog(step, "loss", update.loss)
        samples = sum(g.samples for g in grads) + late_samples  # a site's frame counts its site
        mlog(step, "batch_size", samples)
        mlog(step, "samples_per_s", samples / max(laps.total(), 1e-9))
        for name in ("wait_s", "compress_s", "comm_s"):
            mlog(step, name, laps.seconds[name])
        # Of the elements the round carried (streaming: its fragments').
        sent = self._layout().sparse_numel if sent_numel is None else sent_numel
        mlog(step, "density", kept / max(1, sent))
        self.progress.show(step, self.max_steps, update.loss)

    # -- the other rounds -----------------------------------------------------------------------------
    def serve_buffers(self, frames: dict) -> None:
        """The workers' buffers (batch-norm statistics), averaged weighted by their samples."""
        msgs = list(frames.values())
        alphas = aggregation_weights([m.samples for m in msgs])
        avg = sum(a * m.values.float() for a, m in zip(alphas, msgs))
        self.transport.send_many(list(frames), pack(BuffersAvg(msgs[0].step, avg)))

    def serve_eval(self, frames: dict) -> None:
        """The workers' metric sums combined into means over the whole held-out set; whether the
        target is reached (and the run stops there) goes back with them."""
        msgs = list(frames.values())
        step = msgs[0].step
        count = sum(m.count for m in msgs)
        names = sorted(set().union(*(m.sums for m in msgs)))
        values = {n: sum(m.sums.get(n, 0.0) for m in msgs) / max(1, count) for n in names}
        reached = self.progress.reached(values)
        stop = reached and self.cfg.stop_at_target
        self.transport.send_many(list(frames), pack(EvalResult(step, values, stop)))
        for name, value in values.items():
            self.metrics.log(step, name, value)
        # The slowest worker's evaluation is what it cost the run (the others wait on it).
        self.metrics.log(step, EVAL_S, max(m.seconds for m in msgs))
        if reached:
            self.progress.note_reached(step, self.metrics)
        self.progress.show(step, self.max_steps, self.metrics.last.get("loss", math.nan), values)

    # -- the end -------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Every worker said BYE: the last checkpoint, then BYE to all."""
        self.checkpoints.settle(self.donors, self.step, after_bye=True)
        self.checkpoints.log_written(self.metrics, wait=True)
        if self.checkpoints.scheduled and self.step > self.checkpoints.step:
            self.checkpoint(after_bye=True)
        self.joiner.turn_away(f"the run ended after step {self.step}, before a step boundary could admit "
                              "this worker")
        self.transport.send_many(self.roster.ranks(), pack(Bye(self.step, SERVER)))
        self.flush_bytes()

    def preempt(self) -> None:
        """A spot notice: one last checkpoint (and its upload), then stop the run with the reason."""
        ckpts = self.checkpoints
        ckpts.settle(self.donors, self.step)
        ckpts.log_written(self.metrics, wait=True)
        saved = self.checkpoint() if self.step > ckpts.step else ckpts.step > 0
        uploaded = ckpts.close(60.0)
        where = "written and uploaded" if uploaded else "written"
        raise Preempted(f"the parameter server was preempted (SIGTERM) after step {self.step}; "
                        + (f"checkpoint of step {ckpts.step} {where}: the run resumes from it" if saved
                           else "no checkpoint could be written"))

    def abort(self, reason: str) -> None:
        """Tell every worker connected (also those not admitted yet: a failed start) the run fails."""
        try:
            self.joiner.turn_away(reason)
            self.transport.send_many([w for w in self.inbox.peers if w not in self.departures.gone],
                                     pack(Abort(SERVER, reason)))
        except Exception:  # noqa: BLE001 - the run is failing already; the reason is what matters
            log.debug("could not tell the workers to abort", exc_info=True)

    def flush_bytes(self) -> None:
        """Log the bytes since the last flush under the last step (see `PSClient.flush_bytes`)."""
        self.metrics.log_bytes(self.step, *self.transport.take_counts())

    # -- state ---------------------------------------------------------------------------------------
    def configure(self, layout: LayoutSpec) -> None:
        """Size the aggregation state for the workers' model (and restore a resumed run's)."""
        self.layout = layout
        if not self.roster:  # configured without a handshake: the run's planned workers
            for w in range(1, self.cfg.workers + 1):
                self.roster.add(Member(w))
        self.aggregator.configure(layout)
        self.checkpoints.configure(layout)
        if self._resume_state is not None:
            state = self._resume_state
            self.aggregator.restore(state["residual"])
            self.progress.resumed(state["elapsed_s"])
            self.planner.load_state_dict(state)

    def _layout(self) -> LayoutSpec:
        if self.layout is None:
            raise ProtocolError("the server has no layout before the handshake")
        return self.layout

    def checkpoint(self, *, after_bye: bool = False) -> bool:
        """Write the run's checkpoint of this step (and upload it) now; False without a live worker."""
        return self.checkpoints.take_now(self.step, self.donors, self.state_dict, self.metrics, after_bye=after_bye)

    def state_dict(self) -> dict:
        """Server residual, densities, batch sizes (and whose), timing windows, elapsed time: a
        snapshot, which later rounds leave alone (a scheduled checkpoint is written after them)."""
        return {"residual": self.aggregator.residual(), **self.planner.state_dict(),
                "elapsed_s": self.progress.elapsed()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` once the layout is known (at the handshake)."""
        self._resume_state = state
        self.step = state["step"]

    def resume(self, state: dict) -> None:
        """Continue from a checkpoint (trainer.checkpoint): the workers get its model."""
        self.load_state_dict({**state["server"], "step": state["step"]})
        self.checkpoints.resumed(state["step"])
        self.joiner.resume_from(state)


class Laps:
    """A step's seconds split by what the server did: each `add` books the time since the last."""

    def __init__(self, began: float) -> None:
        self.began = self.mark = began
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def add(self, name: str) -> None:
        """Book the seconds since the last lap under `name`."""
        now = time.perf_counter()
        self.seconds[name] += now - self.mark
        self.mark = now

    def total(self) -> float:
        """From the start to the last lap."""
        return self.mark - self.began


def round_kind(frames: dict) -> type:
    """The one kind of frame every worker sent this round (an ABORT's reason fails the run)."""
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


def latest_others(grads: list[Grad], fold: Fold | None) -> list[Grad]:
    """The newest late frame of each worker with none in `grads`: a straggler's timings, which
    the re-split of the batch needs most (trainer.late_changes)."""
    if fold is None:
        return []
    own = {g.sender for g in grads}
    newest: dict[int, Grad] = {}
    for g in fold.seen:
        if g.sender not in own and (g.sender not in newest or g.step > newest[g.sender].step):
            newest[g.sender] = g
    return [newest[w] for w in sorted(newest)]


def step_loss(rows: list[WorkerRow]) -> float:
    """The step's loss: the workers' losses weighted by their samples (NaN if one is not finite)."""
    alphas = aggregation_weights([r.samples for r in rows])
    losses = [r.loss for r in rows]
    return sum(w * x for w, x in zip(alphas, losses)) if all(map(math.isfinite, losses)) else math.nan


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
