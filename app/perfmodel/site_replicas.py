"""Local SGD with each site's workers one replica (`trainer.site_replica`) under the performance
model: the in-site exchange of an inner step, the sites' relays as the outer step's workers, and
the mean step. Pure functions over `app.perfmodel.inputs`; docs/predict.md has the equations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from app.perfmodel.inputs import CompressionSpec, LinkSpec, NodeSpec, TaskSpec
from app.perfmodel.steps import Step, Transfer, concurrent, grad_bytes, local_sgd_step, ratio, task_chunks
from hybridtrain.wiresize import site_grad_bytes, site_mean_bytes, site_pieces


@dataclass(frozen=True)
class SiteExchange:
    """Sites as replicas' inner step (`trainer.site_replica`): each site's workers, in order, the
    first its relay; each site's slowest compute and its in-site exchange; the inner step,
    paced by the slowest site; the transfers of one inner step."""

    sites: list[list[int]]
    compute_s: list[float]
    exchange_s: list[float]
    transfers: list[Transfer]
    grad_bytes: float
    mean_bytes: float

    @property
    def step_s(self) -> float:
        """The inner step: every site's replica steps in time with the slowest."""
        return max(c + e for c, e in zip(self.compute_s, self.exchange_s))

    @property
    def pacing(self) -> int:
        """The site (its index in `sites`) whose inner step is the slowest."""
        return max(range(len(self.sites)), key=lambda s: self.compute_s[s] + self.exchange_s[s])


def site_exchange(workers: Sequence[tuple[NodeSpec, int]], links: Mapping[tuple[int, int], LinkSpec],
                  task: TaskSpec, value_bytes: int = 2) -> SiteExchange:
    """Each site's in-site exchange of an inner step: every member's gradient (`value_bytes` a
    value: bf16, fp32 in a run of fp32 values) to the relay at once, the relay's sum weighted by
    samples, the mean back to every member at once.

    The stages (the members' encode, the uploads, the relay's decode-and-add of each of the k
    gradients and its encode of the mean, the downloads, the members' decode) pipeline over the
    gradient's P pieces: sum(stages) / P + (P - 1) / P * max(stages), one piece through every
    stage and the rest at the pace of the slowest; P = 1 runs them in series.
    """
    nodes = [w for w, _ in workers]
    compute = [n / w.samples_per_s for w, n in workers]
    by_site: dict[int, list[int]] = {}
    for i, w in enumerate(nodes):
        by_site.setdefault(w.site_id, []).append(i)
    numel, count = task.params, len(site_pieces(task.params))
    grad_b, mean_b = site_grad_bytes(numel, value_bytes), site_mean_bytes(numel, value_bytes)
    sites, site_compute, site_exchange_s, transfers = [], [], [], []
    for idx in by_site.values():
        relay, members = nodes[idx[0]], [nodes[i] for i in idx[1:]]
        sites.append(idx)
        site_compute.append(max(compute[i] for i in idx))
        if not members:
            site_exchange_s.append(0.0)
            continue
        ups = [Transfer(m, relay, grad_b) for m in members]
        downs = [Transfer(relay, m, mean_b) for m in members]
        stages = [max(numel * m.dense_encode_s_per_element for m in members),
                  max(concurrent(ups, links)),
                  len(idx) * numel * relay.dense_aggregate_s_per_element + numel * relay.dense_encode_s_per_element,
                  max(concurrent(downs, links)),
                  max(numel * m.dense_aggregate_s_per_element for m in members)]
        site_exchange_s.append(sum(stages) / count + (count - 1) / count * max(stages))
        transfers += ups + downs
    return SiteExchange(sites, site_compute, site_exchange_s, transfers, grad_b, mean_b)


def site_replicas_step(workers: Sequence[tuple[NodeSpec, int]], links: Mapping[tuple[int, int], LinkSpec],
                       task: TaskSpec, comp: CompressionSpec, round_: Step, site: SiteExchange,
                       value_share: float = 1.0) -> Step:
    """Sites as replicas' mean step: the inner step (`site.step_s`: the pacing site's compute
    and in-site exchange), and 1/H of an outer step of one change per site. `round_` is the PS
    step of the sites' relays, each standing for its site's batch at its site's compute (`site_replicas`);
    on top of it the members hand the relay their change (fp32, as grad frames) and the relay
    fans the server's reply out to them. An overlapped exchange hides up to `outer_delay` inner steps."""
    nodes = [w for w, _ in workers]
    every, delay = comp.sync_every, comp.outer_delay
    scaled = local_sgd_step(round_, every, value_share, 0)
    change_b = grad_bytes(task.dense_params, task_chunks(task, comp), None, 4, False)
    ups, fans, update_b = [], [], []
    for s, idx in enumerate(site.sites):
        relay = nodes[idx[0]]
        update_b.append(round_.workers[s]["download_bytes"] * value_share)
        ups.append([Transfer(nodes[i], relay, change_b) for i in idx[1:]])
        fans.append([Transfer(relay, nodes[i], update_b[s]) for i in idx[1:]])
    lan_s = (max((max(concurrent(u, links)) for u in ups if u), default=0.0)
             + max((max(concurrent(f, links)) for f in fans if f), default=0.0))
    whole = (round_.step_s - max(site.compute_s)) * value_share + lan_s
    exchange = max(0.0, whole - delay * site.step_s) / every
    pace = site.pacing
    breakdown = {"compute_s": site.compute_s[pace], "site_exchange_s": site.exchange_s[pace],
                 "outer_exchange_s": exchange}
    rows: list[dict] = [{}] * len(workers)
    for s, idx in enumerate(site.sites):
        outer = scaled.workers[s]
        k = len(idx)
        for j, i in enumerate(idx):
            w, n = workers[i]
            mine = {"node_id": w.node_id, "name": w.name, "batch": n, "compute_s": n / w.samples_per_s,
                    "density": outer["density"], "site_exchange_s": site.exchange_s[s]}
            if j == 0:  # the relay: the site's outer exchange, the members' gradients in, the means out
                mine |= {k2: outer[k2] for k2 in ("compress_s", "upload_s", "download_s", "decode_s")}
                mine |= {"comm_s": outer["comm_s"] + site.exchange_s[s],
                         "upload_bytes": outer["upload_bytes"] + (k - 1) * (site.mean_bytes + update_b[s] / every),
                         "download_bytes": outer["download_bytes"] + (k - 1) * (site.grad_bytes + change_b / every),
                         "relay_for": [nodes[p].node_id for p in idx[1:]]}
            else:
                mine |= {"compress_s": 0.0, "upload_s": site.exchange_s[s], "download_s": 0.0, "decode_s": 0.0,
                         "comm_s": site.exchange_s[s],
                         "upload_bytes": site.grad_bytes + change_b / every,
                         "download_bytes": site.mean_bytes + update_b[s] / every, "relay_for": []}
            mine["granularity"] = ratio(mine["compute_s"], mine["comm_s"])
            rows[i] = mine
    lan = [replace(t, nbytes=t.nbytes / every) for group in (*ups, *fans) for t in group]
    return Step(site.step_s + exchange, breakdown, rows, scaled.transfers + site.transfers + lan)


def site_replicas(workers: Sequence[tuple[NodeSpec, int]], site: SiteExchange) -> list[tuple[NodeSpec, int]]:
    """Each site's replica as one worker of the outer step: its relay, with the site's batch,
    computing it in the time the site's slowest worker computes its share."""
    out = []
    for s, idx in enumerate(site.sites):
        batch = sum(workers[i][1] for i in idx)
        out.append((replace(workers[idx[0]][0], samples_per_s=batch / site.compute_s[s]), batch))
    return out
