"""The messages of the parameter-server protocol: one frozen dataclass per kind, each with its
encoding beside it (conventions: messages are typed). Nothing outside this module knows which
scalar of a frame is which.

A worker's life, as the server sees it: HELLO (its model's layout, and for a joiner its speed
and site) -> WELCOME (the plan) -> STATE: at the start the donor named in WELCOME sends its
weights and the server forwards them to every other worker; a joiner, or every worker of a
resumed run, receives the run's current state (from a live worker, asked with FETCH, or from
the checkpoint) -> per step, one GRAD per chunk, answered by one UPDATE per chunk -> now and
then BUFFERS (answered by BUFFERS_AVG) and EVAL (answered by EVAL_RESULT) -> BYE, answered by
BYE; BYE with `leaving` set is a worker leaving a run that goes on (a spot notice). FETCH may
come from the server whenever a worker waits for it: the worker answers with STATE (its
weights and optimizer state as of its last step) and waits on. ROUTE, from the server to a
site's relay, names the workers it forwards the update to from then on (a joiner of its site
added, one dropped); the relay's receiving thread takes it, so its main loop never sees one.
ABORT, either way, carries the reason a run cannot go on. Under site replicas a site's workers
also exchange, every inner step and over their LAN only, SITE_GRAD (a member's gradient, piece by
piece, to the site's relay) and SITE_MEAN (the site's mean gradient, back to each member).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from trainer.compression import Payload
from trainer.wire import Message, decode, encode

SERVER = 0
(HELLO, WELCOME, STATE, GRAD, UPDATE, BUFFERS, BUFFERS_AVG, EVAL, EVAL_RESULT, BYE, ABORT, FETCH, ROUTE,
 SITE_GRAD, SITE_MEAN) = range(1, 16)
KIND_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", STATE: "STATE", GRAD: "GRAD", UPDATE: "UPDATE",
              BUFFERS: "BUFFERS", BUFFERS_AVG: "BUFFERS_AVG", EVAL: "EVAL",
              EVAL_RESULT: "EVAL_RESULT", BYE: "BYE", ABORT: "ABORT", FETCH: "FETCH", ROUTE: "ROUTE",
              SITE_GRAD: "SITE_GRAD", SITE_MEAN: "SITE_MEAN"}
# A peer's last frame: after one of these its receiving thread stops (trainer.transport.Inbox).
LAST_KINDS = frozenset({BYE, ABORT})


def _dense(values: torch.Tensor, *, keep_bf16: bool = False) -> Payload:
    """Dense fp32, or with `keep_bf16` bf16 values kept at their width (the in-site exchange's choice)."""
    values = values.detach().reshape(-1).cpu()
    return Payload(values.numel(), values if keep_bf16 and values.dtype == torch.bfloat16 else values.float())


@dataclass(frozen=True)
class LayoutSpec:
    """What a worker's model looks like on the wire: parameter names and sizes in flat order,
    how many leading elements travel dense, and the float buffers' total size."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    dense_numel: int
    buffer_numel: int

    @property
    def numel(self) -> int:
        """All parameters."""
        return sum(self.numels)

    @property
    def sparse_numel(self) -> int:
        """The compressed part."""
        return self.numel - self.dense_numel

    def difference(self, other: LayoutSpec) -> str | None:
        """A sentence naming the first difference from `other`, or None when equal."""
        if self == other:
            return None
        if self.names != other.names:
            mine, theirs = set(self.names), set(other.names)
            extra, missing = sorted(mine - theirs)[:3], sorted(theirs - mine)[:3]
            if extra or missing:
                return f"parameters {extra} only on one side, {missing} only on the other"
            return "the same parameters in a different order"
        for name, a, b in zip(self.names, self.numels, other.numels):
            if a != b:
                return f"parameter {name} has {a} elements on one side and {b} on the other"
        return (f"dense part {self.dense_numel} vs {other.dense_numel}, buffers "
                f"{self.buffer_numel} vs {other.buffer_numel} elements")


@dataclass(frozen=True)
class Hello:
    """A worker's first frame: its model's layout, and what the server plans a newcomer from
    (its relative speed and site); `listen_port` where its site's peers reach it."""

    sender: int
    layout: LayoutSpec
    train_samples: int | None
    join: bool = False
    speed: float | None = None
    site: str | None = None
    listen_port: int | None = None
    kind: ClassVar[int] = HELLO

    def message(self) -> Message:
        text = json.dumps({"names": self.layout.names, "numels": self.layout.numels,
                           "dense_numel": self.layout.dense_numel,
                           "buffer_numel": self.layout.buffer_numel,
                           "train_samples": self.train_samples, "join": self.join,
                           "speed": self.speed, "site": self.site, "listen_port": self.listen_port})
        return Message(HELLO, 0, self.sender, text=text)

    @classmethod
    def parse(cls, m: Message) -> Hello:
        d = json.loads(m.text)
        layout = LayoutSpec(tuple(d["names"]), tuple(d["numels"]), d["dense_numel"], d["buffer_numel"])
        return cls(m.sender, layout, d["train_samples"], bool(d.get("join")), d.get("speed"), d.get("site"),
                   d.get("listen_port"))


@dataclass(frozen=True)
class Welcome:
    """The server's plan for a worker: batch sizes and densities (per rank - 1, 0 for ranks not
    in the run), the run's length, the step the state it gets is of, who sends the starting
    weights (`donor`; 0: the server forwards the run's state), whether the update of
    `start_step + 1` follows for it to apply (`catch_up`, a joiner), where its updates come from
    (`source`: the server or its site's relay), whom it relays to, and its site peers' addresses."""

    batch_sizes: tuple[int, ...]
    densities: tuple[float, ...]
    max_steps: int
    start_step: int = 0
    donor: int = 1
    catch_up: bool = False
    source: int = SERVER
    peers: dict[int, tuple[str, int]] = field(default_factory=dict)
    forwards: tuple[int, ...] = ()  # the workers this one relays the update to
    kind: ClassVar[int] = WELCOME

    def message(self) -> Message:
        text = json.dumps({"batch_sizes": self.batch_sizes, "densities": self.densities,
                           "max_steps": self.max_steps, "start_step": self.start_step,
                           "donor": self.donor, "catch_up": self.catch_up, "source": self.source,
                           "peers": {str(r): list(a) for r, a in self.peers.items()},
                           "forwards": self.forwards})
        return Message(WELCOME, 0, SERVER, text=text)

    @classmethod
    def parse(cls, m: Message) -> Welcome:
        d = json.loads(m.text)
        peers = {int(r): (a[0], int(a[1])) for r, a in d.get("peers", {}).items()}
        return cls(tuple(d["batch_sizes"]), tuple(d["densities"]), d["max_steps"], d["start_step"],
                   d.get("donor", 1), bool(d.get("catch_up")), d.get("source", SERVER), peers,
                   tuple(d.get("forwards", ())))


@dataclass(frozen=True)
class State:
    """A replica's parameters and float buffers (flat, layout order) as of `step`, and its
    optimizer's state (torch.save bytes; empty at the start of a run): what a worker needs to
    continue the run's model exactly."""

    sender: int
    params: torch.Tensor
    buffers: torch.Tensor
    step: int = 0
    optimizer: bytes = b""
    kind: ClassVar[int] = STATE

    def message(self) -> Message:
        # fp32 payloads: the weights cross exactly. The optimizer state is opaque bytes, carried
        # as a raw-byte payload.
        optimizer = (torch.frombuffer(bytearray(self.optimizer), dtype=torch.uint8) if self.optimizer
                     else torch.zeros(0, dtype=torch.uint8))
        return Message(STATE, self.step, self.sender, payloads=[_dense(self.params), _dense(self.buffers),
                                                                  Payload(optimizer.numel(), optimizer)])

    @classmethod
    def parse(cls, m: Message) -> State:
        params, buffers, optimizer = (p.values for p in m.payloads)
        return cls(m.sender, params, buffers, m.step, optimizer.numpy().tobytes())


@dataclass(frozen=True)
class Fetch:
    """The server asks a worker for its STATE (a joiner's start, a checkpoint)."""

    step: int
    kind: ClassVar[int] = FETCH

    def message(self) -> Message:
        return Message(FETCH, self.step, SERVER)

    @classmethod
    def parse(cls, m: Message) -> Fetch:
        return cls(m.step)


@dataclass(frozen=True)
class Grad:
    """One chunk of a worker's gradient (step 2), with what the server plans from (step 5)."""

    step: int
    sender: int
    chunk: int
    loss: float
    samples: int
    compute_s: float
    last_tx_s: float
    topk_s: float
    dense: Payload
    sparse: Payload
    # A site's combined frame (per-site aggregation): each worker's own figures, which the
    # server plans from, as (rank, loss, samples, compute_s, last_tx_s, topk_s, site_s).
    members: tuple[tuple[float, ...], ...] = ()
    # Sites as replicas: the seconds the round's inner steps spent averaging over the site's LAN
    # (waits for the site's other workers included; the server takes the site's least).
    site_s: float = 0.0
    kind: ClassVar[int] = GRAD

    def message(self) -> Message:
        scalars = [self.chunk, self.loss, self.samples, self.compute_s, self.last_tx_s, self.topk_s, self.site_s]
        text = json.dumps(self.members) if self.members else ""
        return Message(GRAD, self.step, self.sender, scalars, [self.dense, self.sparse], text)

    @classmethod
    def parse(cls, m: Message) -> Grad:
        chunk, loss, samples, compute_s, last_tx_s, topk_s, site_s = m.scalars
        members = tuple(tuple(r) for r in json.loads(m.text)) if m.text else ()
        return cls(m.step, m.sender, int(chunk), loss, int(samples), compute_s, last_tx_s, topk_s,
                   m.payloads[0], m.payloads[1], members, site_s)

    def own(self) -> tuple[float, ...]:
        """This frame's sender's own figures, in the shape of `members`' rows."""
        return (self.sender, self.loss, self.samples, self.compute_s, self.last_tx_s, self.topk_s, self.site_s)


@dataclass(frozen=True)
class Update:
    """The server's answer to one chunk (steps 3-4); the last chunk's also carries the step's
    loss and the next step's densities and batch sizes (step 5)."""

    step: int
    chunk: int
    dense: Payload
    sparse: Payload
    loss: float = math.nan
    densities: tuple[float, ...] = ()
    batch_sizes: tuple[int, ...] = ()
    kind: ClassVar[int] = UPDATE

    def message(self) -> Message:
        m = len(self.densities)
        scalars = [self.chunk, self.loss, m, *self.densities, *self.batch_sizes]
        return Message(UPDATE, self.step, SERVER, scalars, [self.dense, self.sparse])

    @classmethod
    def parse(cls, m: Message) -> Update:
        chunk, loss, count = m.scalars[:3]
        count = int(count)
        densities = tuple(m.scalars[3 : 3 + count])
        sizes = tuple(int(n) for n in m.scalars[3 + count : 3 + 2 * count])
        return cls(m.step, int(chunk), m.payloads[0], m.payloads[1], loss, densities, sizes)


@dataclass(frozen=True)
class Buffers:
    """A worker's float buffers (BatchNorm statistics), weighted by its batch share."""

    step: int
    sender: int
    samples: int
    values: torch.Tensor
    kind: ClassVar[int] = BUFFERS

    def message(self) -> Message:
        return Message(BUFFERS, self.step, self.sender, [self.samples], [_dense(self.values)])

    @classmethod
    def parse(cls, m: Message) -> Buffers:
        return cls(m.step, m.sender, int(m.scalars[0]), m.payloads[0].values)


@dataclass(frozen=True)
class BuffersAvg:
    step: int
    values: torch.Tensor
    kind: ClassVar[int] = BUFFERS_AVG

    def message(self) -> Message:
        return Message(BUFFERS_AVG, self.step, SERVER, payloads=[_dense(self.values)])

    @classmethod
    def parse(cls, m: Message) -> BuffersAvg:
        return cls(m.step, m.payloads[0].values)


@dataclass(frozen=True)
class Eval:
    """A worker's sums of each metric over its slice of the evaluation data, and its count."""

    step: int
    sender: int
    sums: dict[str, float]
    count: int
    # Seconds the worker spent evaluating: the slowest worker's is the evaluation's cost to the run.
    seconds: float = 0.0
    kind: ClassVar[int] = EVAL

    def message(self) -> Message:
        return Message(EVAL, self.step, self.sender, [self.count, self.seconds], text=json.dumps(self.sums))

    @classmethod
    def parse(cls, m: Message) -> Eval:
        return cls(m.step, m.sender, json.loads(m.text), int(m.scalars[0]), float(m.scalars[1]))


@dataclass(frozen=True)
class EvalResult:
    """The run's metrics (means over the whole evaluation set) and whether to stop."""

    step: int
    values: dict[str, float]
    stop: bool
    kind: ClassVar[int] = EVAL_RESULT

    def message(self) -> Message:
        return Message(EVAL_RESULT, self.step, SERVER, [float(self.stop)], text=json.dumps(self.values))

    @classmethod
    def parse(cls, m: Message) -> EvalResult:
        return cls(m.step, json.loads(m.text), bool(m.scalars[0]))


@dataclass(frozen=True)
class Bye:
    """A worker is done after `step` steps (or, `leaving`, leaves a run that goes on); the
    server answers with its own."""

    step: int
    sender: int
    leaving: bool = False
    kind: ClassVar[int] = BYE

    def message(self) -> Message:
        return Message(BYE, self.step, self.sender, [float(self.leaving)])

    @classmethod
    def parse(cls, m: Message) -> Bye:
        return cls(m.step, m.sender, bool(m.scalars[0]) if m.scalars else False)


@dataclass(frozen=True)
class Abort:
    """The run cannot go on; `reason` says why (shown on the run's page)."""

    sender: int
    reason: str
    kind: ClassVar[int] = ABORT

    def message(self) -> Message:
        return Message(ABORT, 0, self.sender, text=self.reason)

    @classmethod
    def parse(cls, m: Message) -> Abort:
        return cls(m.sender, m.text)


@dataclass(frozen=True)
class Route:
    """To a relay: the workers it forwards each update to from now on, and the addresses of
    those it has not connected to yet. With `source` (the server), to a worker whose relay was
    dropped: it hears the server from now on, and stops waiting on the relay."""

    step: int
    forwards: tuple[int, ...]
    peers: dict[int, tuple[str, int]] = field(default_factory=dict)
    source: int | None = None
    kind: ClassVar[int] = ROUTE

    def message(self) -> Message:
        d = {"forwards": self.forwards, "peers": {str(r): list(a) for r, a in self.peers.items()}}
        if self.source is not None:
            d["source"] = self.source
        return Message(ROUTE, self.step, SERVER, text=json.dumps(d))

    @classmethod
    def parse(cls, m: Message) -> Route:
        d = json.loads(m.text)
        return cls(m.step, tuple(d["forwards"]), {int(r): (a[0], int(a[1])) for r, a in d.get("peers", {}).items()},
                   d.get("source"))


@dataclass(frozen=True)
class SiteGrad:
    """Site replicas: one piece of a member's gradient of an inner step, to its site's relay,
    with the samples it was computed on (its weight in the site's mean); bf16 or fp32 as given
    (`trainer.site_replica.site_dtype`)."""

    step: int
    sender: int
    piece: int
    samples: int
    values: torch.Tensor
    kind: ClassVar[int] = SITE_GRAD

    def message(self) -> Message:
        return Message(SITE_GRAD, self.step, self.sender, [self.piece, self.samples], [_dense(self.values, keep_bf16=True)])

    @classmethod
    def parse(cls, m: Message) -> SiteGrad:
        piece, samples = m.scalars
        return cls(m.step, m.sender, int(piece), int(samples), m.payloads[0].values)


@dataclass(frozen=True)
class SiteMean:
    """Site replicas: one piece of the site's mean gradient of an inner step, from its relay to
    each member (the relay steps on the same values, so the site's replicas stay equal); bf16 or
    fp32 as given."""

    step: int
    sender: int
    piece: int
    values: torch.Tensor
    kind: ClassVar[int] = SITE_MEAN

    def message(self) -> Message:
        return Message(SITE_MEAN, self.step, self.sender, [self.piece], [_dense(self.values, keep_bf16=True)])

    @classmethod
    def parse(cls, m: Message) -> SiteMean:
        return cls(m.step, m.sender, int(m.scalars[0]), m.payloads[0].values)


Frame = (Hello | Welcome | State | Grad | Update | Buffers | BuffersAvg | Eval | EvalResult | Bye | Abort | Fetch
         | Route | SiteGrad | SiteMean)
_PARSERS: dict[int, type] = {c.kind: c for c in (Hello, Welcome, State, Grad, Update, Buffers, BuffersAvg,
                                                 Eval, EvalResult, Bye, Abort, Fetch, Route, SiteGrad, SiteMean)}


class ProtocolError(RuntimeError):
    """A peer sent what the protocol does not allow here, or aborted the run."""


def pack(frame: Frame) -> torch.Tensor:
    """The frame as bytes for the transport."""
    return encode(frame.message())


def unpack(raw: torch.Tensor) -> Frame:
    """The typed frame of `raw`."""
    m = decode(raw)
    parser = _PARSERS.get(m.kind)
    if parser is None:
        raise ProtocolError(f"unknown frame kind {m.kind} from rank {m.sender}")
    return parser.parse(m)


def expect(raw: torch.Tensor, cls: type, step: int | None = None, *, peer: int | None = None) -> Frame:
    """Unpack `raw` as a `cls` (of `step`); an ABORT raises its reason, anything else says what
    came instead."""
    return check(unpack(raw), cls, step, peer=peer)


def check(frame: Frame, cls: type, step: int | None = None, *, peer: int | None = None) -> Frame:
    """`frame` if it is a `cls` (of `step`), as `expect` says otherwise; for a frame unpacked
    already (decoding a server update twice cost a 0.157-core worker 11 ms a chunk)."""
    if isinstance(frame, Abort):
        raise ProtocolError(frame.reason)
    who = f"rank {peer}" if peer is not None else "the peer"
    if not isinstance(frame, cls):
        raise ProtocolError(f"expected {KIND_NAMES[cls.kind]} from {who}, got {KIND_NAMES[frame.kind]}"
                            + ("" if step is None else f" (step {getattr(frame, 'step', '?')}, wanted {step})")
                            + ": every worker must make the same hybridtrain calls in the same order")
    if step is not None and getattr(frame, "step", step) != step:
        raise ProtocolError(f"expected {KIND_NAMES[cls.kind]} of step {step} from {who}, got step "
                            f"{frame.step}: the workers are out of step")
    return frame


__all__ = ["Abort", "Buffers", "BuffersAvg", "Bye", "Eval", "EvalResult", "Fetch", "Frame", "Grad", "Hello",
           "LayoutSpec", "ProtocolError", "ROUTE", "Route", "SERVER", "SITE_MEAN", "SiteGrad", "SiteMean", "State",
           "Update", "Welcome", "check", "expect", "pack", "unpack"]
