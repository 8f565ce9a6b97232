"""Errors of the node agent, in one tree:

    AgentError
    ├── AgentConfigError          missing or contradictory settings (no server, no token)
    ├── ControlPlaneError         the control plane answered badly or not at all
    │   ├── ControlPlaneUnavailable   connection failure, timeout or 5xx: worth retrying
    │   ├── AgentAuthError            401/403: join token unknown or used, agent token revoked
    │   └── ControlPlaneRejected      any other 4xx: the request itself is wrong
    ├── LaunchError               a role could not be started (bad spec, already running, exec)
    ├── BundleError               a code bundle could not be fetched, verified or unpacked
    └── ProfileError              a task profile could not be measured
"""

from __future__ import annotations


class AgentError(Exception):
    """Base of every error the agent raises on purpose."""


class AgentConfigError(AgentError):
    """The agent's settings cannot work as given."""


class ControlPlaneError(AgentError):
    """A call to the control plane failed."""

    def __init__(self, message: str, *, status_code: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        # The answer's Retry-After in seconds, where it named one (a 503 from a full lane).
        self.retry_after_s = retry_after_s


class ControlPlaneUnavailable(ControlPlaneError):
    """The control plane could not be reached or failed on its side; retry later."""


class AgentAuthError(ControlPlaneError):
    """The control plane refused the agent's credentials."""


class ControlPlaneRejected(ControlPlaneError):
    """The control plane refused the request as invalid (4xx other than auth)."""


class LaunchError(AgentError):
    """A trainer role could not be started."""


class BundleError(AgentError):
    """A bundle of the user's code could not be fetched, verified or unpacked; the message
    starts with `bundle <digest>…:` and says why."""


class ProfileError(AgentError):
    """A task profile could not be measured; the message says why (often the child's stderr)."""
