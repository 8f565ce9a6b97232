"""What an API token may change: named actions, on top of its scope.

A token's scope (read < ci < admin) says what it may do at most. A token may also carry a list
of actions; then every request that changes something (any method but GET, HEAD and OPTIONS)
must be one of them, on the REST API and on the dashboard alike. Reading is governed by the
scope alone. A list narrows a scope, never widens it: a `ci` token listing `nodes:write` still
gets 403 on a node, because nodes need `admin`.

A request's action comes from its handler (API and pages share names: `cancel_run` on both);
a write whose handler is not in `HANDLER_ACTIONS` is refused to every limited token, so a new
route is closed to them until it is named here (tests/app/test_tokens_limits.py checks that
every write route is).
"""

from __future__ import annotations

from typing import Literal, get_args

TokenAction = Literal[
    "runs:create",
    "runs:cancel",
    "runs:add-nodes",
    "runs:plan",
    "nodes:write",
    "sites:write",
    "clusters:write",
    "gpu-models:write",
    "prices:write",
    "links:write",
    "bundles:write",
    "datasets:write",
    "profiles:write",
    "tokens:write",
]
ACTIONS: tuple[str, ...] = get_args(TokenAction)

_WRITES = {
    "nodes:write": ("create_node", "update_node", "delete_node", "rotate_join_token", "drain_node", "undrain_node"),
    "sites:write": ("create_site", "update_site", "delete_site"),
    "clusters:write": ("create_cluster", "update_cluster", "delete_cluster"),
    "gpu-models:write": ("create_gpu_model", "update_gpu_model", "delete_gpu_model"),
    "prices:write": (
        "create_instance_price", "revise_instance_price", "delete_instance_price",
        "create_egress_price", "revise_egress_price", "delete_egress_price",
    ),
    "links:write": ("probe_links", "create_site_link", "delete_site_link"),
    "bundles:write": ("upload_bundle", "delete_bundle"),
    "datasets:write": ("create_dataset", "delete_dataset", "upload_dataset_file"),
    "profiles:write": ("create_profiles",),
    "tokens:write": ("create_token", "delete_token"),
    "runs:create": ("create_run", "launch_run"),
    "runs:cancel": ("cancel_run",),
    "runs:add-nodes": ("add_run_nodes",),
    # Plans are computed, not stored, but they are POSTs: named so a limited token can preview.
    "runs:plan": ("plan_run", "preview_plan", "suggest_plan", "optimize_plan"),
}
HANDLER_ACTIONS: dict[str, str] = {
    handler: action for action, handlers in _WRITES.items() for handler in handlers
}
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def action_of(method: str, handler: str | None) -> str | None:
    """The action a request performs; None for reads. An unnamed write is `unnamed:<handler>`."""
    if method.upper() in READ_METHODS:
        return None
    return HANDLER_ACTIONS.get(handler or "", f"unnamed:{handler}")


def refusal(token_name: str, actions: frozenset[str], action: str | None) -> str | None:
    """Why a token limited to `actions` may not perform `action`; None when it may."""
    if action is None or action in actions:
        return None
    allowed = ", ".join(sorted(actions)) or "nothing"
    if action.startswith("unnamed:"):
        return f"token '{token_name}' is limited to {allowed}; this request is not one of the named actions"
    return f"token '{token_name}' is limited to {allowed}; this needs '{action}'"
