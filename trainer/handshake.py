"""How a parameter-server run starts (docs/elastic.md, "The choice: a transport that admits peers"): the workers' HELLOs, the
check that they built one model, the plan each is welcomed with, and the weights they all
start from: worker 1's for a fresh run, the checkpoint's for a resumed one. A mixin of
`trainer.server.ParameterServer`, beside `trainer.boundary`, which admits whoever comes later.
"""

from __future__ import annotations

import queue
import time

from hybridtrain.contract import EVENT_RESUMED, steps_for_epochs
from trainer.frames import SERVER, Abort, Hello, LayoutSpec, ProtocolError, State, Welcome, expect, pack
from trainer.membership import Member

# A run, fresh or resumed, waits up to --start-wait-s (120 s) for every expected worker
# (--expect-ranks, default every rank): start-up differs by tens of seconds between nodes
# (imports and the task's data on a full core or on a third of one: 25 s on the paper
# testbed's ResNet-18), and a worker admitted later is a joiner, which misses the site relay
# plan, so its site pays one WAN copy of every update per worker. A restart names the ranks it
# launched, so a lost node's rank, which never comes, is not waited for.
# Once no worker has said HELLO for this long, the server says whom it is waiting for.
START_QUIET_S = 20.0


class Handshake:
    """The start of `trainer.server.ParameterServer` (which provides cfg, roster, transport,
    inbox, metrics, layout, step, say(), configure(), load_state_dict())."""

    _resume_model: State | None = None
    _resume_layout: LayoutSpec | None = None

    def resume(self, state: dict) -> None:
        """Continue from a checkpoint (trainer.checkpoint): the workers get its model."""
        self.load_state_dict({**state["server"], "step": state["step"]})
        self.checkpoints.step = state["step"]
        lay = state["layout"]
        self._resume_layout = LayoutSpec(tuple(lay["names"]), tuple(lay["numels"]), lay["dense_numel"],
                                         lay["buffer_numel"])
        self._resume_model = State(SERVER, state["params"], state["buffers"], state["step"], state["optimizer"])

    def _initial_hellos(self) -> dict[int, tuple[Hello, str | None]]:
        if not self.elastic:
            for w in range(1, self.cfg.workers + 1):
                self.inbox.add(w)
            return {w: (expect(self.inbox.get(w)[0], Hello, peer=w), None) for w in range(1, self.cfg.workers + 1)}
        hellos: dict[int, tuple[Hello, str | None]] = {}
        start = last = time.monotonic()
        deadline = start + self.cfg.timeout_s
        expected = set(self.cfg.expect_ranks or range(1, self.cfg.workers + 1))
        said = False
        while not expected <= hellos.keys() and time.monotonic() < deadline:
            now = time.monotonic()
            if len(hellos) >= max(1, self.cfg.min_workers):
                if now - start > self.cfg.start_wait_s:
                    break
                if not said and now - last > min(START_QUIET_S, self.cfg.start_wait_s / 2):
                    missing = sorted(expected - hellos.keys())
                    self.say(f"{len(hellos)} of {len(expected)} workers connected; waiting up to "
                             f"{min(self.cfg.start_wait_s, self.cfg.timeout_s):.0f} s from the start for "
                             f"rank(s) {', '.join(map(str, missing))}, then starting without them")
                    said = True
            try:
                conn, raw, host = self.transport.arrivals.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                continue
            try:
                hello = expect(raw, Hello)
            except ProtocolError as exc:
                self.transport.refuse(conn, pack(Abort(SERVER, str(exc))))
                continue
            if hello.sender < 1 or hello.sender in hellos:
                self.transport.refuse(conn, pack(Abort(SERVER, f"rank {hello.sender} is taken or not a worker's")))
                continue
            self.transport.adopt(hello.sender, conn, raw)
            self.inbox.add(hello.sender)
            hellos[hello.sender] = (hello, host)
            last = time.monotonic()
        if len(hellos) < max(1, self.cfg.min_workers):
            raise ProtocolError(f"only {len(hellos)} of {self.cfg.workers} workers connected within "
                                f"{self.cfg.timeout_s:.0f} s (--timeout-s); --min-workers is {self.cfg.min_workers}")
        return hellos

    def _handshake(self) -> None:
        hellos = self._initial_hellos()
        ranks = sorted(hellos)
        first = hellos[ranks[0]][0]
        for w, (hello, _) in hellos.items():
            diff = first.layout.difference(hello.layout)
            if diff:
                raise ProtocolError(f"the model replicas differ: worker {ranks[0]} and worker {w} "
                                    f"built different models ({diff}); the task's model factory must "
                                    "build the same architecture on every rank")
        if self._resume_layout is not None and self._resume_layout.difference(first.layout):
            raise ProtocolError(f"the checkpoint's model differs from the workers' "
                                f"({self._resume_layout.difference(first.layout)}): resume the same task")
        for w, (hello, host) in hellos.items():
            speed = hello.speed or (self.cfg.speeds[w - 1] if w <= len(self.cfg.speeds) else None)
            address = (host, hello.listen_port) if host and hello.listen_port else None
            self.roster.add(Member(w, speed, hello.site, address))
        if ranks != list(range(1, self.cfg.workers + 1)):
            self.roster.resplit()
        self.configure(first.layout)
        if self.cfg.epochs:
            if not first.train_samples:
                raise ProtocolError("--epochs needs a training set whose length is known (a map-style "
                                    "Dataset); give --max-steps for a streaming one")
            self.max_steps = steps_for_epochs(self.cfg.epochs, first.train_samples, self.cfg.global_batch)
        donor = SERVER if self._resume_model is not None else ranks[0]
        peers = {m.rank: m.address for m in self.roster.members.values() if m.address}
        for w in ranks:
            self.transport.send(w, pack(self._welcome(w, donor=donor, peers=peers)))
        if self._resume_model is not None:
            self.transport.send_many(ranks, pack(self._resume_model))
            self.metrics.event(self.step, EVENT_RESUMED, detail=f"from the checkpoint of step {self.step}, "
                               f"with {len(ranks)} workers; the workers' error-feedback residuals start empty")
            self.say(f"resumed from step {self.step} with {len(ranks)} workers")
            self._resume_model = None
        else:
            state = expect(self.inbox.get(donor)[0], State, peer=donor)
            self.transport.send_many([w for w in ranks if w != donor], pack(state))
        self.metrics.log(self.step, "params", self.layout.numel)
        self.metrics.log(self.step, "max_steps", self.max_steps)
        self._t0 = time.time()

    def _welcome(self, rank: int, *, donor: int, peers: dict | None = None, catch_up: bool = False) -> Welcome:
        return Welcome(tuple(self.roster.batch_sizes), tuple(self.roster.densities), self.max_steps, self.step,
                       donor, catch_up, self.roster.source(rank), peers or {}, self.roster.forwards(rank))
