"""The parameter-server strategies (`ps`, `ps-gc`, `ps-bz-gc`): one worker class, one server class.

Per step t (seed 000, section III):
 1. Worker m computes the gradient of its mean loss on its n_m samples and adds weight decay to
    it (pitfall: before accumulation, so decay is compressed and fed back like the gradient).
 2. Tiny and 1-D tensors go dense; the rest is compressed (Top-k of gradient + residual, error
    feedback, per-worker density d_m^t), unless it is a warm-up step.
 3. The server aggregates with alpha_m = n_m / B (eq. 1-2), adds its own residual, keeps the top
    k_s = params * server_k_fraction, keeps the rest as its residual, and sends one reply to all
    (through one relay worker per remote site when the run knows its sites: `trainer.relay`).
 4. Every worker applies the same update with the same SGD optimizer (eq. 3 plus momentum), so
    the replicas stay identical. Under momentum correction (DGC; the default when compressing)
    momentum is accumulated before step 2 instead, and the compressed tensors' update is applied
    without it.
 5. The reply also carries next step's densities (adapted from the transmission times) and batch
    sizes (re-balanced from compute and compression times under `--allocation measured`).

With `--pipeline-chunks N` steps 2-4 run once per chunk of the compressed part, as a pipeline:
the server aggregates chunk c and its update travels back while the workers compress chunk c+1.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer import checkpoint
from trainer.allocation import aggregation_weights, rebalance
from trainer.compression import (
    CompressionState,
    Compressor,
    Identity,
    Payload,
    build_compressor,
)
from trainer.config import TrainConfig, adapt_densities, lr_at
from trainer.data import Dataset, batch_indices, eval_slice
from trainer.metrics import MetricsLogger
from trainer.relay import SERVER, plan_relay
from trainer.transport import Transport
from trainer.wire import Message, decode, encode

log = logging.getLogger("trainer.ps")

CPU = torch.device("cpu")
GRAD, UPDATE, BUFFERS, BUFFERS_AVG, EVAL, EVAL_RESULT = range(1, 7)


@dataclass(frozen=True)
class Layout:
    """Where each parameter lives in the flat gradient: dense tensors first, then compressed ones."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    decay: tuple[bool, ...]
    dense_numel: int
    sparse_numel: int

    @classmethod
    def of(cls, model: nn.Module, dense_numel: int) -> Layout:
        """1-D tensors (biases, norms) and tensors under `dense_numel` elements travel dense."""
        params = list(model.named_parameters())
        is_dense = [p.dim() <= 1 or p.numel() < dense_numel for _, p in params]
        order = [i for i, d in enumerate(is_dense) if d] + [i for i, d in enumerate(is_dense) if not d]
        names, offsets, numels, decay, off = [], [], [], [], 0
        for i in order:
            name, p = params[i]
            names.append(name)
            offsets.append(off)
            numels.append(p.numel())
            decay.append(p.dim() > 1)
            off += p.numel()
        nd = sum(p.numel() for (_, p), d in zip(params, is_dense) if d)
        return cls(tuple(names), tuple(offsets), tuple(numels), tuple(decay), nd, off - nd)

    @property
    def numel(self) -> int:
        """All parameters."""
        return self.dense_numel + self.sparse_numel

    def chunks(self, count: int) -> tuple[tuple[int, int], ...]:
        """`count` contiguous, near-equal (start, stop) ranges tiling the compressed part."""
        if not 1 <= count <= max(1, self.sparse_numel):
            raise ValueError(f"cannot split {self.sparse_numel} compressed elements into {count} chunks")
        bounds = [round(i * self.sparse_numel / count) for i in range(count + 1)]
        return tuple(zip(bounds[:-1], bounds[1:]))


def _join_residuals(states: list[CompressionState]) -> torch.Tensor | None:
    """One flat residual of the chunks' (None until every chunk has one): checkpoints keep the
    same shape whatever the chunking."""
    if any(s.residual is None for s in states):
        return None
    return states[0].residual if len(states) == 1 else torch.cat([s.residual for s in states])


def _split_residual(states: list[CompressionState], residual: torch.Tensor | None,
                    chunks: tuple[tuple[int, int], ...]) -> None:
    for s, (a, b) in zip(states, chunks):
        s.residual = None if residual is None else residual[a:b].clone()


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm running statistics and other float buffers (not trained, so never in gradients)."""
    return [b for _, b in model.named_buffers() if b.dtype.is_floating_point]


class PSWorker:
    """A worker: `run_step`, `run_epoch`, `evaluate`, `save_checkpoint`, `train`."""

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        model: nn.Module,
        data: Dataset,
        transport: Transport,
        metrics: MetricsLogger,
        batch_sizes: list[int],
        device: torch.device = CPU,
    ) -> None:
        self.cfg, self.rank, self.index = cfg, rank, rank - 1
        self.model, self.data, self.transport, self.metrics = model.to(device), data, transport, metrics
        self.device = device
        self.layout = Layout.of(model, cfg.dense_numel)
        self.batch_sizes = list(batch_sizes)
        self.densities = [cfg.density] * cfg.workers
        self.codec: Compressor = (
            build_compressor(cfg.compressor, value_dtype=cfg.value_dtype,
                             error_feedback=cfg.error_feedback, select=cfg.select)
            if cfg.compresses else Identity()
        )
        self.chunks = self.layout.chunks(cfg.pipeline_chunks)
        # One codec state (residual) per chunk: each chunk is compressed on its own.
        self.codec_states = [CompressionState(density=cfg.density, seed=cfg.seed) for _ in self.chunks]
        self.relay = plan_relay(cfg.sites, cfg.workers)
        self.last_tx_s = 0.0
        self.step = 0
        self.stopped = False
        self._params = dict(model.named_parameters())
        self.flat_grad = torch.zeros(self.layout.numel, device=device)
        self._bind_grads()
        # Momentum correction (DGC, Lin et al. 2018): applied after compression, momentum repeats
        # for ~1/(1 - m) steps every burst that error feedback held back in the residual, and the
        # replicas lurch. Accumulated here, before compression, the velocity itself is what is
        # compressed and sent; a sent coordinate restarts its velocity (DGC's momentum factor
        # masking), and the optimizer applies the compressed tensors' updates without momentum.
        self.velocity = (torch.zeros(self.layout.sparse_numel, device=device)
                         if cfg.compresses and cfg.momentum_correction and cfg.momentum else None)
        groups: list[dict] = [{"params": list(model.parameters())}]
        if self.velocity is not None:
            compressed = {n for n, off in zip(self.layout.names, self.layout.offsets)
                          if off >= self.layout.dense_numel}
            groups = [{"params": [p for n, p in self._params.items() if n not in compressed]},
                      {"params": [p for n, p in self._params.items() if n in compressed], "momentum": 0.0}]
        # weight_decay=0: decay is added to the local gradient in step 1 instead.
        self.optimizer = torch.optim.SGD([g for g in groups if g["params"]], lr=cfg.lr, momentum=cfg.momentum)
        self.x_train, self.y_train = data.x_train.to(device), data.y_train.to(device)

    # -- flat gradient -----------------------------------------------------------------------
    def _bind_grads(self) -> None:
        for name, off, n in zip(self.layout.names, self.layout.offsets, self.layout.numels):
            p = self._params[name]
            p.grad = self.flat_grad[off : off + n].view_as(p)

    def _grads_are_views(self) -> bool:
        base = self.flat_grad.data_ptr()
        end = base + self.flat_grad.numel() * self.flat_grad.element_size()
        return all(p.grad is not None and base <= p.grad.data_ptr() < end for p in self._params.values())

    def _collect_grads(self) -> None:
        """Autograd accumulates into the bound views; copy back if it ever replaced one."""
        if self._grads_are_views():
            return
        for name, off, n in zip(self.layout.names, self.layout.offsets, self.layout.numels):
            g = self._params[name].grad
            self.flat_grad[off : off + n].copy_(g.reshape(-1) if g is not None else 0)
        self._bind_grads()

    # -- one step ----------------------------------------------------------------------------
    def compute(self, step: int) -> tuple[float, int, float]:
        """Step 1: local loss, its gradient plus weight decay in `flat_grad`; (loss, n, seconds)."""
        t0 = time.perf_counter()
        idx = batch_indices(step, self.index, tuple(self.batch_sizes), len(self.y_train), self.cfg.seed)
        idx = idx.to(self.device)
        x, y = self.x_train[idx], self.y_train[idx]
        self.model.train()
        self.flat_grad.zero_()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self._collect_grads()
        if self.cfg.weight_decay:
            with torch.no_grad():
                for name, decays in zip(self.layout.names, self.layout.decay):
                    if decays:
                        p = self._params[name]
                        p.grad.add_(p, alpha=self.cfg.weight_decay)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        if self.cfg.emulate_speeds and self.cfg.speeds:
            # Stretch compute to what a device of relative speed s_m would take.
            slow = max(self.cfg.speeds) / self.cfg.speeds[self.index]
            time.sleep(elapsed * (slow - 1.0))
            elapsed *= slow
        return float(loss.item()), len(idx), elapsed

    def compress(self, step: int, chunk: int = 0) -> list[Payload]:
        """Step 2 for one chunk: [dense part (chunk 0 only; empty otherwise), the chunk through
        the codec] (the chunk dense in warm-up)."""
        nd = self.layout.dense_numel if chunk == 0 else 0
        dense = Payload(nd, self.flat_grad[:nd].cpu())
        a, b = self.chunks[chunk]
        grad = self.flat_grad[self.layout.dense_numel + a : self.layout.dense_numel + b]
        # Under momentum correction the velocity is what travels (the gradient is in it). It is
        # accumulated here, chunk by chunk, not in `compute`: a per-parameter cost, it belongs
        # with compression time, which re-balancing treats as fixed rather than per sample.
        sparse = grad if self.velocity is None else self.velocity[a:b].mul_(self.cfg.momentum).add_(grad)
        if step <= self.cfg.warmup_steps or not self.cfg.compresses:
            return [dense, Payload(sparse.numel(), sparse.cpu())]
        state = self.codec_states[chunk]
        state.density = self.densities[self.index]
        state.step = step
        p = self.codec.compress(sparse, state)
        if self.velocity is not None and p.indices is not None:
            self.velocity[a:b].index_fill_(0, p.indices, 0.0)
        return [dense, Payload(p.numel, p.values.cpu(), None if p.indices is None else p.indices.cpu(), p.seed)]

    def apply(self, step: int, reply: Message, chunk: int = 0) -> None:
        """Step 4: the server's update of one chunk into `flat_grad`; after the last chunk's, one
        optimizer step and the next step's densities and batch sizes."""
        dense, sparse = reply.payloads
        nd = self.layout.dense_numel
        if chunk == 0:
            self.flat_grad[:nd].copy_(dense.values.to(self.device, torch.float32))
        a, b = self.chunks[chunk]
        part = self.flat_grad[nd + a : nd + b]
        if sparse.indices is None:
            part.copy_(sparse.values.to(self.device, torch.float32))
        else:
            part.zero_()
            part.index_add_(0, sparse.indices.to(self.device), sparse.values.to(self.device, torch.float32))
        if chunk < len(self.chunks) - 1:
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg)
        self.optimizer.step()
        m = self.cfg.workers
        self.densities = [float(d) for d in reply.scalars[1 : 1 + m]]
        self.batch_sizes = [int(n) for n in reply.scalars[1 + m : 1 + 2 * m]]

    def _receive_updates(self, out: queue.Queue) -> None:
        """Each chunk's update from the server (or the site's relay), forwarded on as received,
        before decoding: the site's peers wait on it. Runs beside the sends of later chunks."""
        try:
            source, forwards = self.relay.source(self.rank), self.relay.forwards_of(self.rank)
            for _ in self.chunks:
                raw = self.transport.recv(source)
                t1 = time.perf_counter()
                self.transport.send_many(forwards, raw)
                out.put((raw, t1, time.perf_counter() - t1))
        except BaseException as exc:  # raised again in the stepping thread
            out.put(exc)

    def run_step(self, step: int) -> float:
        """One synchronous step (and the evaluation when due); returns the local loss.

        With several chunks the step is a pipeline: chunk c+1 is compressed while chunk c is on
        the wire and being aggregated by the server, whose update of chunk c comes back meanwhile.
        """
        loss, n, compute_s = self.compute(step)
        density = self.densities[self.index] if step > self.cfg.warmup_steps and self.cfg.compresses else 1.0
        updates: queue.Queue = queue.Queue()
        receiver = threading.Thread(target=self._receive_updates, args=(updates,), daemon=True,
                                    name=f"updates-{step}")
        receiver.start()
        t0 = time.perf_counter()
        topk_s = encode_s = tx_s = 0.0
        waits = []
        for c in range(len(self.chunks)):
            tc = time.perf_counter()
            payloads = self.compress(step, c)
            te = time.perf_counter()
            topk_s += te - tc
            scalars = [loss, n, compute_s, self.last_tx_s, topk_s, c]
            frame = encode(Message(GRAD, step, self.rank, scalars, payloads))
            ts = time.perf_counter()
            encode_s += ts - te
            waits.append(self.transport.post_many([SERVER], frame))
            tx_s += time.perf_counter() - ts
        ts = time.perf_counter()
        for wait in waits:
            wait()
        sent = time.perf_counter()
        tx_s += sent - ts
        forward_s, last_arrival = 0.0, sent
        for c in range(len(self.chunks)):
            try:
                item = updates.get(timeout=self.cfg.timeout_s)
            except queue.Empty:
                raise TimeoutError(f"rank {self.rank}: no update of step {step} (chunk {c}) within "
                                   f"{self.cfg.timeout_s:.0f} s") from None
            if isinstance(item, BaseException):
                raise item
            raw, last_arrival, fwd = item
            forward_s += fwd
            reply = decode(raw)
            if reply.kind != UPDATE or reply.step != step:
                raise RuntimeError(f"rank {self.rank}: expected the update of step {step}, got kind {reply.kind} step {reply.step}")
            self.apply(step, reply, c)
        receiver.join()
        self.last_tx_s = tx_s
        self.step = step
        total = time.perf_counter() - t0 + compute_s
        mlog = self.metrics.log
        mlog(step, "loss", loss)
        mlog(step, "batch_size", n)
        mlog(step, "samples_per_s", n / total)
        mlog(step, "compute_s", compute_s)
        mlog(step, "compress_s", topk_s + encode_s)
        mlog(step, "comm_s", tx_s + forward_s)
        mlog(step, "wait_s", max(0.0, last_arrival - sent))
        mlog(step, "density", density)
        if self.eval_due(step):
            self.evaluate(step)
        # After the evaluation, so its bytes count in this step's single record per link.
        self.metrics.log_bytes(step, *self.transport.take_counts())
        return loss

    def eval_due(self, step: int) -> bool:
        """Evaluate every `eval_every` steps and at the last one."""
        return step % self.cfg.eval_every == 0 or step == self.cfg.max_steps

    def run_epoch(self, epoch: int) -> None:
        """The steps of 0-based `epoch` (an epoch is n_train // B steps)."""
        per_epoch = len(self.y_train) // sum(self.batch_sizes)
        for step in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1):
            self.run_step(step)

    # -- evaluation --------------------------------------------------------------------------
    def sync_buffers(self, step: int) -> None:
        """Pitfall: BatchNorm statistics are averaged by batch share before evaluation."""
        buffers = float_buffers(self.model)
        if not buffers:
            return
        flat = torch.cat([b.reshape(-1).float().cpu() for b in buffers])
        n = self.batch_sizes[self.index]
        self.transport.send(SERVER, encode(Message(BUFFERS, step, self.rank, [n], [Payload(flat.numel(), flat)])))
        avg = decode(self.transport.recv(SERVER)).payloads[0].values
        off = 0
        with torch.no_grad():
            for b in buffers:
                b.copy_(avg[off : off + b.numel()].view_as(b))
                off += b.numel()

    @torch.no_grad()
    def evaluate(self, step: int) -> float:
        """Held-out accuracy of the (identical) replicas; each worker scores one slice."""
        self.sync_buffers(step)
        part = eval_slice(len(self.data.y_test), self.index, tuple(self.batch_sizes))
        x, y = self.data.x_test[part], self.data.y_test[part]
        self.model.eval()
        correct = 0
        for i in range(0, len(y), 1024):
            logits = self.model(x[i : i + 1024].to(self.device))
            correct += int((logits.argmax(1).cpu() == y[i : i + 1024]).sum())
        self.transport.send(SERVER, encode(Message(EVAL, step, self.rank, [correct, len(y)])))
        accuracy, stop = decode(self.transport.recv(SERVER)).scalars[:2]
        self.stopped = bool(stop)
        return accuracy

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Model, optimizer (momentum), residual, velocity, densities, batch sizes, last transmission
        time."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "residual": _join_residuals(self.codec_states),
            "densities": self.densities,
            "batch_sizes": self.batch_sizes,
            "last_tx_s": self.last_tx_s,
            "velocity": self.velocity,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; the flat-gradient views are re-bound afterwards."""
        if (self.velocity is not None) != (state.get("velocity") is not None):
            raise ValueError(
                "the checkpoint was written with momentum correction "
                f"{'on' if state.get('velocity') is not None else 'off'}: resume with the same "
                "--momentum-correction setting")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        residual = state["residual"]
        _split_residual(self.codec_states, None if residual is None else residual.to(self.device), self.chunks)
        self.densities = list(state["densities"])
        self.batch_sizes = list(state["batch_sizes"])
        self.last_tx_s = state["last_tx_s"]
        if self.velocity is not None:
            self.velocity.copy_(state["velocity"])
        self.step = state["step"]
        self._bind_grads()

    def save_checkpoint(self, step: int) -> None:
        """This rank's state of `step`."""
        checkpoint.save(self.cfg.checkpoint_dir, step, self.rank, self.state_dict(), self.cfg)

    def train(self, start_step: int = 0) -> None:
        """Steps start_step+1 .. max_steps, evaluating and checkpointing on schedule."""
        for step in range(start_step + 1, self.cfg.max_steps + 1):
            self.run_step(step)
            last = self.stopped or step == self.cfg.max_steps
            if self.cfg.checkpoint_every and (step % self.cfg.checkpoint_every == 0 or last):
                self.save_checkpoint(step)
            if self.stopped:
                break


class ParameterServer:
    """Rank 0: owns the aggregation state (server residual, densities, batch sizes, timings)."""

    def __init__(
        self,
        cfg: TrainConfig,
        layout: Layout,
        transport: Transport,
        metrics: MetricsLogger,
        batch_sizes: list[int],
        has_buffers: bool = True,
    ) -> None:
        self.cfg, self.layout, self.transport, self.metrics = cfg, layout, transport, metrics
        self.workers = list(range(1, cfg.workers + 1))
        self.relay = plan_relay(cfg.sites, cfg.workers)
        self.batch_sizes = list(batch_sizes)
        self.densities = [cfg.density] * cfg.workers
        self.has_buffers = has_buffers
        self.codec: Compressor = (
            build_compressor("topk", value_dtype=cfg.value_dtype, error_feedback=cfg.error_feedback,
                             select=cfg.select)
            if cfg.compresses else Identity()
        )
        self.chunks = layout.chunks(cfg.pipeline_chunks)
        # Each chunk keeps k_s * its share of the elements, with its own residual.
        self.codec_states = [CompressionState(density=cfg.server_k_fraction, seed=cfg.seed) for _ in self.chunks]
        self.compute_window: list[list[float]] = []
        self.overhead_window: list[list[float]] = []
        self.elapsed_s = 0.0
        self.reached_at: float | None = None
        self.step = 0
        self.stopped = False
        self._t0 = time.time()
        self._last_print = 0.0

    def aggregate(self, step: int, msgs: list[Message], chunk: int = 0) -> Message:
        """Steps 3 and 5 for one chunk: the alpha-weighted sum (eq. 1-2) and server compression;
        with the last chunk, next step's plan."""
        ns = [m.scalars[1] for m in msgs]
        alphas = aggregation_weights(ns)
        a, b = self.chunks[chunk]
        dense = torch.zeros(self.layout.dense_numel if chunk == 0 else 0)
        sparse = torch.zeros(b - a)
        for alpha, m in zip(alphas, msgs):
            d, s = m.payloads
            # Widen to fp32 before weighting and summing (fp16 values would lose the small terms).
            dense.add_(d.values.float(), alpha=alpha)
            if s.indices is None:
                sparse.add_(s.values.float(), alpha=alpha)
            else:
                sparse.index_add_(0, s.indices, s.values.float(), alpha=alpha)
        if step <= self.cfg.warmup_steps or not self.cfg.compresses:
            update = Payload(sparse.numel(), sparse)
        else:
            state = self.codec_states[chunk]
            state.step = step
            update = self.codec.compress(sparse, state)
        scalars: list[float] = []
        if chunk == len(self.chunks) - 1:
            # The last chunk's frames carry the step's full timings (compression summed); its
            # update carries the step's loss and the next step's plan.
            self._plan(step, msgs)
            loss = sum(w * m.scalars[0] for w, m in zip(alphas, msgs))
            scalars = [loss, *self.densities, *self.batch_sizes]
        return Message(UPDATE, step, SERVER, scalars, [Payload(dense.numel(), dense), update])

    def _plan(self, step: int, msgs: list[Message]) -> None:
        """Densities from last transmission times (step 3); batch sizes from compute and
        compression times."""
        if self.cfg.compresses and step > self.cfg.warmup_steps + 1:
            # A link's time is the longer of the worker's own send time (previous step) and the
            # frame's arrival time seen here (this step): the first alone misses a shaped link
            # whose bytes sit in a socket buffer, the second alone an emulated --link-mbps.
            times = [max(m.scalars[3], self.transport.wire_s.get(m.sender, 0.0)) for m in msgs]
            self.densities = adapt_densities(
                self.densities, times, target=self.cfg.density,
                low=self.cfg.density_min, high=self.cfg.density_max, gamma=self.cfg.density_gamma,
                floor=self.cfg.density_time_floor_s,
            )
        # `measured` refines whatever split the run started from (--batch-sizes from the
        # control plane's plan, or the speeds): the plan's FLOPs ignore that a device is
        # less efficient on a smaller batch, which only observed compute times reveal.
        # Compression time counts as a fixed per-step cost: a slow node spends longer on the same
        # top-k, so balancing compute alone leaves its frame last (trainer.allocation.rebalance).
        if self.cfg.allocation == "measured" and self.cfg.workers > 1:
            self.compute_window.append([m.scalars[2] for m in msgs])
            self.overhead_window.append([m.scalars[4] for m in msgs])
            if len(self.compute_window) >= self.cfg.rebalance_every:
                means = [sum(col) / len(col) for col in zip(*self.compute_window)]
                overheads = [sum(col) / len(col) for col in zip(*self.overhead_window)]
                self.batch_sizes = rebalance(sum(self.batch_sizes), self.batch_sizes, means, overheads)
                self.compute_window, self.overhead_window = [], []

    def run_step(self, step: int) -> float:
        """Receive every worker's gradient, aggregate, send one update to all (or to the relays;
        then evaluate when due); returns the global loss."""
        t0 = time.perf_counter()
        wait_s = compress_s = comm_s = 0.0
        waits, sent = [], 0
        before = t0
        # With several chunks, chunk c is aggregated and its update sent while the workers
        # compress and send chunk c+1.
        for chunk, frames in enumerate(self.transport.recv_rounds(self.workers, len(self.chunks))):
            t1 = time.perf_counter()
            wait_s += t1 - before
            msgs = [decode(frames[r]) for r in self.workers]
            bad = [(r, m.kind, m.step, m.scalars[5:6]) for r, m in zip(self.workers, msgs)
                   if m.kind != GRAD or m.step != step or m.scalars[5:6] != [chunk]]
            if bad:
                raise RuntimeError(f"server: expected chunk {chunk} of the gradients of step {step}, "
                                   f"got (rank, kind, step, [chunk]) {bad}")
            reply = self.aggregate(step, msgs, chunk)
            sent += reply.payloads[1].count
            frame = encode(reply)
            t2 = time.perf_counter()
            compress_s += t2 - t1
            waits.append(self.transport.post_many(self.relay.server_sends, frame))
            before = time.perf_counter()
            comm_s += before - t2
        for wait in waits:
            wait()
        t3 = time.perf_counter()
        comm_s += t3 - before
        self.step = step
        loss = reply.scalars[0]
        mlog = self.metrics.log
        mlog(step, "loss", loss)
        mlog(step, "batch_size", sum(self.batch_sizes))
        mlog(step, "samples_per_s", sum(m.scalars[1] for m in msgs) / max(t3 - t0, 1e-9))
        mlog(step, "wait_s", wait_s)
        mlog(step, "compress_s", compress_s)
        mlog(step, "comm_s", comm_s)
        mlog(step, "density", sent / max(1, self.layout.sparse_numel))
        self._progress(step, loss)
        if step % self.cfg.eval_every == 0 or step == self.cfg.max_steps:
            self.evaluate(step)
        self.metrics.log_bytes(step, *self.transport.take_counts())
        return loss

    def _progress(self, step: int, loss: float, accuracy: float | None = None) -> None:
        now = time.time()
        if accuracy is None and now - self._last_print < 2.0 and step != self.cfg.max_steps:
            return
        self._last_print = now
        acc = f" accuracy {accuracy:.4f}" if accuracy is not None else ""
        print(f"[ps] step {step}/{self.cfg.max_steps} loss {loss:.4f}{acc} elapsed {self.elapsed():.1f}s",
              file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        """Training seconds so far, across resumes."""
        return self.elapsed_s + time.time() - self._t0

    def evaluate(self, step: int) -> float:
        """Average buffers by batch share, then combine the workers' counts into one accuracy."""
        if self.has_buffers:
            msgs = [decode(f) for f in self.transport.recv_many(self.workers).values()]
            alphas = aggregation_weights([m.scalars[0] for m in msgs])
            avg = sum(a * m.payloads[0].values for a, m in zip(alphas, msgs))
            self.transport.send_many(self.workers, encode(Message(BUFFERS_AVG, step, SERVER, [], [Payload(avg.numel(), avg)])))
        msgs = [decode(f) for f in self.transport.recv_many(self.workers).values()]
        accuracy = sum(m.scalars[0] for m in msgs) / max(1.0, sum(m.scalars[1] for m in msgs))
        target = self.cfg.target_accuracy
        reached = target is not None and accuracy >= target
        self.stopped = reached and self.cfg.stop_at_target
        self.transport.send_many(self.workers, encode(Message(EVAL_RESULT, step, SERVER, [accuracy, float(self.stopped)])))
        self.metrics.log(step, "accuracy", accuracy)
        if reached and self.reached_at is None:
            self.reached_at = self.elapsed()
            self.metrics.log(step, "time_to_accuracy_s", self.reached_at)
        self._progress(step, self.metrics.last.get("loss", float("nan")), accuracy)
        return accuracy

    def state_dict(self) -> dict:
        """Server residual, densities, batch sizes, timing window, elapsed time."""
        return {
            "residual": _join_residuals(self.codec_states),
            "densities": self.densities,
            "batch_sizes": self.batch_sizes,
            "compute_window": self.compute_window,
            "overhead_window": self.overhead_window,
            "elapsed_s": self.elapsed(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`."""
        _split_residual(self.codec_states, state["residual"], self.chunks)
        self.densities = list(state["densities"])
        self.batch_sizes = list(state["batch_sizes"])
        self.compute_window = [list(r) for r in state["compute_window"]]
        # A checkpoint from before the overhead window was kept has none: that window then
        # re-balances from compute alone.
        self.overhead_window = [list(r) for r in state.get("overhead_window", [])]
        self.elapsed_s = state["elapsed_s"]
        self._t0 = time.time()
        self.step = state["step"]

    def save_checkpoint(self, step: int) -> None:
        """The server's state of `step`."""
        checkpoint.save(self.cfg.checkpoint_dir, step, SERVER, self.state_dict(), self.cfg)

    def train(self, start_step: int = 0) -> None:
        """Serve steps start_step+1 .. max_steps in lockstep with the workers."""
        self._t0 = time.time()
        for step in range(start_step + 1, self.cfg.max_steps + 1):
            self.run_step(step)
            last = self.stopped or step == self.cfg.max_steps
            if self.cfg.checkpoint_every and (step % self.cfg.checkpoint_every == 0 or last):
                self.save_checkpoint(step)
            if self.stopped:
                break
