"""What a restarted agent does about the roles its predecessor left: a role does not outlive
its agent (the guard kills its group when the agent dies), so every role still "running" in
the ledger died with it, or is about to. Whatever is left of it is killed, and its end is
reported ("its agent restarted") after what its trainer had not delivered (its spool and
its metrics file), through the outbox.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Any

from agents.groups import group_members, killpg, same_process, wait_group_empty
from agents.outbox import EVENT, Message, Outbox
from agents.records import RoleRecords
from agents.reports import undelivered_messages
from agents.roles import RESTARTED_REASON, log_tail, pid_exists
from hybridtrain.contract import CAUSE_AGENT_RESTARTED

log = logging.getLogger(__name__)


def report_lost_roles(records: RoleRecords, outbox: Outbox) -> list[dict[str, Any]]:
    """Kill what is left of each role recorded as running, queue its exit, mark it ended;
    returns the records, each with "killed" (the pids killed here, often none).

    A record's group is killed if its leader is the same process (same start time) or is
    gone while members remain: Linux keeps a pid allocated while a group uses it, so members
    of a group whose leader died can only be that role's leftovers. A pid now taken by
    another process is left alone.
    """
    lost = []
    for record in records.running():
        run_id, rank = int(record["run_id"]), int(record["rank"])
        pgid = int(record.get("pid") or 0)
        killed = _kill_leftovers(pgid, record.get("create_time")) if pgid > 0 else []
        if killed:
            log.warning("killed leftovers of run %s rank %s (group %s): %s", run_id, rank, pgid, killed)
        role = str(record.get("role") or "worker")
        exited = {
            "rank": rank,
            "role": role,
            "attempt": int(record.get("attempt") or 0),
            "event": "exited",
            "pid": pgid or None,
            "exit_code": None,
            # The guard SIGKILLs its group when the agent dies; that is how the role ended.
            "signal": int(signal.SIGKILL),
            "cancelled": False,
            "cause": CAUSE_AGENT_RESTARTED,
            "reason": f"rank {rank} ({role}) stopped: {RESTARTED_REASON}",
            "tail": log_tail(record.get("log")),
            "t": time.time(),
        }
        spool = Path(record["spool"]) if record.get("spool") else None
        metrics = Path(record["metrics"]) if record.get("metrics") else None
        reports = undelivered_messages(run_id=run_id, rank=rank, spool=spool, metrics=metrics,
                                       metrics_from=int(record.get("metrics_from") or 0), clean=False)
        # Queued before the record says "exited": a crash in between reports twice, not never.
        outbox.put_many([*reports, Message(EVENT, run_id, exited)])
        records.exited(run_id, rank, exited)
        if spool is not None:
            spool.unlink(missing_ok=True)
        lost.append({**record, "killed": killed})
    records.prune()
    return lost


def _kill_leftovers(pgid: int, created: float | None) -> list[int]:
    leader_ours = same_process(pgid, created)
    members = group_members(pgid)
    if not (leader_ours or (members and not pid_exists(pgid))):
        return []
    killpg(pgid, signal.SIGKILL)
    wait_group_empty(pgid, timeout_s=10.0)
    return sorted({pgid, *members} if leader_ours else set(members))
