"""A run's derived credentials: each rank's report token and the run's link secret.

Both are HMACs of the control plane's secret key over the run, its attempt (0, then one per
restart) and, for a token, the rank: never stored, so the control plane can hand them again on
a re-sent launch order or to a worker that joins later, and checks a token by deriving it
again. A restart moves to the next attempt, which retires everything of the old one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from app.security import secrets_equal

METRICS_TOKEN_PREFIX = "htr_"


def run_metrics_token(secret_key: str, *, run_id: int, attempt: int, rank: int) -> str:
    """The report token of one rank in a run's `attempt` (0, then one per restart).

    Derived from the control plane's secret rather than stored, so the control plane can hand
    it again to a rank whose launch order it re-sends or to a worker that joins later, and
    checks it by deriving it again. It names its rank: it reports that rank's records only
    (`token_rank`). A restart moves to the next attempt, which retires every old token.
    """
    digest = _run_secret(secret_key, "metrics", f"{run_id}:{attempt}:{rank}")
    return f"{METRICS_TOKEN_PREFIX}{rank}.{digest}"


def token_rank(secret_key: str, token: str, *, run_id: int, attempt: int) -> int | None:
    """The rank `token` reports for in the run's `attempt`; None when it is no token of it."""
    if not token.startswith(METRICS_TOKEN_PREFIX):
        return None
    head, dot, _ = token[len(METRICS_TOKEN_PREFIX):].partition(".")
    if not dot or not head.isdigit() or len(head) > 9:
        return None
    rank = int(head)
    expected = run_metrics_token(secret_key, run_id=run_id, attempt=attempt, rank=rank)
    return rank if secrets_equal(token, expected) else None


def run_link_secret(secret_key: str, *, run_id: int, attempt: int) -> str:
    """The secret a run's ranks key their TLS with (trainer.linktls) in `attempt`: derived,
    like the report tokens, so a re-sent order or a joiner gets the same, never stored."""
    return _run_secret(secret_key, "links", f"{run_id}:{attempt}")


def _run_secret(secret_key: str, purpose: str, subject: str) -> str:
    message = f"hybridtrain-run-{purpose}:{subject}".encode()
    digest = hmac.new(secret_key.encode(), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")
