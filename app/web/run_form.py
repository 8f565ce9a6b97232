"""The launch form: from the posted fields to a `RunCreate`, and errors back to their fields.

Which of node_ids / cluster_id, of max_steps / epochs and of task / script is sent follows the
form's radio buttons, so the schema's "give exactly one" rules surface as a message beside the
field the user left empty rather than above the form.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from starlette.datastructures import FormData

from app.errors import ConflictError, HybridtrainError
from app.schemas.predictions import OptimizeRequest, OptimizeResultPublic, PlanWithPrediction
from app.schemas.runs import RunCreate
from app.perfmodel.provenance import input_lines
from app.web import forms
from hybridtrain.contract import DEFAULT_STRATEGY, DEFAULT_TASK, STRATEGIES, is_ps
from hybridtrain.strategy_defaults import defaults

TEXT_FIELDS = (
    "name", "place", "cluster_id", "strategy", "kind", "task", "task_args", "bundle_sha256", "script",
    "script_args", "global_batch_size",
    "length", "max_steps", "epochs", "target", "at_target", "eval_every", "rebalance_every",
    "allocation", "ps_node_id", "device", "seed",
    "compression_compressor", "compression_value_dtype", "compression_select", "compression_density",
    "compression_density_min", "compression_density_max", "compression_server_k_fraction",
    "compression_error_feedback", "compression_momentum_correction", "compression_warmup_steps",
    "compression_pipeline_chunks", "compression_powersgd_rank", "local_sgd_sync_every",
    "local_sgd_outer_lr", "local_sgd_outer_momentum", "local_sgd_outer_density", "local_sgd_outer_delay",
    "local_sgd_asynchronous", "local_sgd_max_staleness", "local_sgd_site_replicas", "local_sgd_fragments",
    "idempotency_key", "suggest_goal", "suggest_budget",
    "checkpoint_every", "checkpoint_every_s", "max_restarts", "min_workers", "min_workers_wait_s",
)
# Checkpoints, restarts and membership: on by default, as for runs from the API.
LIFECYCLE_INTS = ("checkpoint_every", "max_restarts", "min_workers")
LIFECYCLE_FLOATS = ("checkpoint_every_s", "min_workers_wait_s")
COMPRESSION_INTS = ("warmup_steps", "pipeline_chunks", "powersgd_rank")
COMPRESSION_FLOATS = ("density", "density_min", "density_max", "server_k_fraction")
LOCAL_SGD_INTS = ("sync_every", "outer_delay", "max_staleness", "fragments")
LOCAL_SGD_FLOATS = ("outer_lr", "outer_momentum", "outer_density")
# The request's option sections, each a group of the form's fields named SECTION_OPTION.
SECTIONS = ("compression", "local_sgd")
DEFAULTS = {
    "place": "nodes", "strategy": DEFAULT_STRATEGY, "kind": "task", "task": DEFAULT_TASK, "task_args": "",
    "global_batch_size": "64", "length": "steps", "max_steps": "300", "device": "auto",
    "seed": "0", "allocation": "", "compression_error_feedback": "",
    "compression_momentum_correction": "", "at_target": "stop", "suggest_goal": "cost",
    "suggest_budget": "", "checkpoint_every": "100", "checkpoint_every_s": "600", "max_restarts": "3",
    "min_workers": "1", "min_workers_wait_s": "300",
}
# Above this share of the bill, the preview calls egress out: it is then the cost to cut.
EGRESS_CALLOUT_SHARE = 1 / 3


def strategy_placeholders() -> dict[str, dict[str, str]]:
    """Each strategy's defaults (hybridtrain.strategy_defaults) by form field: the placeholders of
    the form's blank fields, switched with its strategy."""
    return {s: {path.replace(".", "_"): f"{value:g}" for path, value in defaults(s).items()} for s in STRATEGIES}


def field_name(loc: str) -> str:
    """The form field of a schema location: 'compression.density' -> 'compression_density'."""
    if loc.startswith("node_ids"):
        return "node_ids"
    if loc.startswith("script_args"):
        return "script_args"
    if loc == "file":  # an uploaded archive's errors go beside the file input
        return "bundle_file"
    return loc.replace(".", "_") if loc.startswith(SECTIONS) else loc


def echoed(form: FormData) -> dict[str, Any]:
    """What the user typed, to show again beside any error (node_ids as a list of strings)."""
    values: dict[str, Any] = forms.values(form, TEXT_FIELDS)
    values["node_ids"] = [str(v) for v in form.getlist("node_ids")]
    return values


def run_create(values: dict[str, Any], *, bundle_sha256: str | None = None) -> tuple[RunCreate | None, dict[str, str]]:
    """The launch request the form describes, or the errors by field; `bundle_sha256` is that of
    an archive uploaded with the form (it wins over the one chosen from the list)."""
    data, errors = forms.typed(
        {k: v for k, v in values.items() if isinstance(v, str)},
        ints=("cluster_id", "global_batch_size", "max_steps", "epochs", "ps_node_id", "seed",
              "eval_every", "rebalance_every", *LIFECYCLE_INTS),
        floats=LIFECYCLE_FLOATS,
    )
    body: dict[str, Any] = {
        k: data[k] for k in ("name", "strategy", "global_batch_size", "target", "eval_every",
                             "rebalance_every", "allocation", "ps_node_id", "device", "seed",
                             *LIFECYCLE_INTS, *LIFECYCLE_FLOATS)
    }
    body["bundle_sha256"] = bundle_sha256 or data.get("bundle_sha256", "")
    if values.get("kind") == "script":
        body["script"] = data.get("script", "")
        if body["script"] == "":
            errors["script"] = "enter the script's path inside the bundle"
        try:
            body["script_args"] = shlex.split(data.get("script_args", ""))
        except ValueError as exc:
            errors["script_args"] = f"cannot split the arguments: {exc}"
    else:
        body["task"] = data.get("task", "")
        task_args, problem = _json_object(data.get("task_args", ""))
        if problem:
            errors["task_args"] = problem
        body["task_args"] = task_args
    at_target = values.get("at_target") or "stop"
    if at_target in ("stop", "continue"):
        body["stop_at_target"] = at_target == "stop"
    else:
        errors["at_target"] = "choose stop or continue"
    if data["rebalance_every"] != "" and not is_ps(str(values.get("strategy"))):
        # The schema refuses this too, but only above the form; the user should see it here.
        errors["rebalance_every"] = "only parameter-server strategies re-balance; leave it blank"
    if values.get("place") == "cluster":
        body["cluster_id"] = data["cluster_id"]
        if data["cluster_id"] == "":
            errors.setdefault("cluster_id", "choose a cluster")
    else:
        ids: list[int] = []
        for raw in values["node_ids"]:
            if not re.fullmatch(r"\d{1,10}", raw):
                errors["node_ids"] = f"not a node id: {raw[:20]!r}"
                break
            ids.append(int(raw))
        body["node_ids"] = ids
        if not ids:
            errors.setdefault("node_ids", "choose at least one node")
    if values.get("length") == "epochs":
        body["epochs"] = data["epochs"]
        if data["epochs"] == "":
            errors.setdefault("epochs", "enter the number of epochs")
    else:
        body["max_steps"] = data["max_steps"]
        if data["max_steps"] == "":
            errors.setdefault("max_steps", "enter the number of steps")
    for section, parse in (("compression", _compression), ("local_sgd", _local_sgd)):
        given, section_errors = parse(values)
        errors |= section_errors
        if given:
            body[section] = given
    model, schema_errors = forms.parse(RunCreate, forms.non_blank(body), field_name)
    if errors:
        # Every field's error at once; the schema's "give exactly one" message only restates
        # the choice the checks above have already named beside its field.
        schema_errors.pop(forms.FORM_ERROR, None)
        return None, {**schema_errors, **errors}
    return model, schema_errors


def _json_object(text: str) -> tuple[dict[str, Any], str | None]:
    if text == "":
        return {}, None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return {}, f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
    if not isinstance(value, dict):
        return {}, 'must be a JSON object, e.g. {"lr": 0.05}'
    return value, None


def _compression(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    raw = {k.removeprefix("compression_"): v for k, v in values.items() if k.startswith("compression_") and isinstance(v, str)}
    data, errors = forms.typed(raw, ints=COMPRESSION_INTS, floats=COMPRESSION_FLOATS)
    for name in ("error_feedback", "momentum_correction"):
        data[name] = {"on": True, "off": False}.get(raw.get(name, ""), "")
    return forms.non_blank(data), {f"compression_{k}": v for k, v in errors.items()}


def _local_sgd(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    raw = {k.removeprefix("local_sgd_"): v for k, v in values.items() if k.startswith("local_sgd_") and isinstance(v, str)}
    data, errors = forms.typed(raw, ints=LOCAL_SGD_INTS, floats=LOCAL_SGD_FLOATS)
    for name in ("asynchronous", "site_replicas"):
        data[name] = {"on": True, "off": False}.get(raw.get(name, ""), "")
    return forms.non_blank(data), {f"local_sgd_{k}": v for k, v in errors.items()}


def launch_errors(exc: HybridtrainError) -> dict[str, str]:
    """A planning or launch error beside its field; a node that cannot run goes by the nodes."""
    if isinstance(exc, ConflictError) and "node" in exc.message:
        return {"node_ids": exc.message}
    return forms.domain_errors(exc, field_name)


def prediction_rows(plans: list[PlanWithPrediction]) -> dict[str, Any]:
    """The preview's table of every strategy's prediction, and the egress callout (strategies
    whose egress is over EGRESS_CALLOUT_SHARE of their $/h), or why there is no prediction."""
    rows, heavy, unavailable = [], [], None
    for plan in plans:
        p = plan.prediction
        if p is None:
            unavailable = plan.prediction_unavailable
            continue
        server = next((w.node_name for w in plan.workers if w.role == "ps"), None)
        rows.append({
            "strategy": plan.strategy, "server": server, "samples_per_s": p.samples_per_s,
            "step_s": p.step_s, "breakdown": p.breakdown, "granularity": p.granularity,
            "egress_usd_per_h": p.costs.egress_usd_per_h, "compute_usd_per_h": p.costs.compute_usd_per_h,
            "usd_per_million_samples": p.costs.usd_per_million_samples, "egress_share": p.costs.egress_share,
            "egress_bytes_per_step": p.egress_bytes_per_step, "unpriced": p.costs.unpriced,
        })
        if p.costs.egress_share is not None and p.costs.egress_share > EGRESS_CALLOUT_SHARE:
            heavy.append(f"{plan.strategy} ({p.costs.egress_share:.0%})")
    callout = None
    if heavy:
        callout = (f"Egress is over a third of the bill for {', '.join(heavy)}: moving the server or "
                   "leaving out a remote site may cost less (try Suggest).")
    # Every strategy rests on the same profiles and links: the first plan's say how old and
    # how noisy they are, and whether a profile is the profiler's or a run's measured steps.
    inputs = input_lines(plans[0].model_dump(mode="json")) if plans else []
    return {"predictions": rows, "egress_callout": callout, "predictions_unavailable": unavailable,
            "inputs": inputs}


def optimize_request(values: dict[str, Any]) -> tuple[OptimizeRequest | None, dict[str, str]]:
    """The optimizer's request from the form: its nodes (or cluster), task, batch and steps, and
    the goal and budget next to the Suggest button; or the errors by field."""
    model, errors = run_create({**values, "name": values.get("name") or "suggested"})
    if model is None:
        return None, errors
    budget_text = str(values.get("suggest_budget") or "").strip()
    body: dict[str, Any] = {
        "task": model.task, "task_args": model.task_args, "bundle_sha256": model.bundle_sha256,
        "global_batch_size": model.global_batch_size, "max_steps": model.max_steps,
        "goal": values.get("suggest_goal") or "cost", "compression": model.compression,
        "local_sgd": model.local_sgd,
        "eval_every": model.eval_every,
    }
    if model.cluster_id is not None:
        body["cluster_id"] = model.cluster_id
    else:
        body["node_ids"] = model.node_ids
    if budget_text:
        try:
            body["budget_usd_per_h"] = float(budget_text)
        except ValueError:
            return None, {"suggest_budget": f"not a number of dollars per hour: {budget_text[:20]!r}"}
    request, problems = forms.parse(OptimizeRequest, forms.non_blank(body), _suggest_field)
    return request, problems


def _suggest_field(loc: str) -> str:
    return {"budget_usd_per_h": "suggest_budget", "goal": "suggest_goal"}.get(loc, field_name(loc))


def suggestion(answer: OptimizeResultPublic) -> dict[str, Any]:
    """What the form fills in from the optimizer's answer, and the sentence that explains it."""
    plan = answer.plan
    nodes = list(dict.fromkeys(w.node_id for w in plan.workers if w.role == "worker"))
    prediction = plan.prediction
    return {
        "strategy": plan.strategy, "node_ids": nodes, "ps_node_id": plan.ps_node_id,
        "allocation": plan.allocation, "explanation": answer.explanation,
        "samples_per_s": prediction.samples_per_s if prediction else None,
        "usd_per_million_samples": prediction.costs.usd_per_million_samples if prediction else None,
    }
