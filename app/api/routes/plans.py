"""Plans: the optimizer's choice of nodes, strategy and server for a goal (POST /plans/optimize)."""

from __future__ import annotations

from fastapi import APIRouter, status
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from app.api.deps import CiDep, DispatcherDep, SessionDep
from app.api.responses import NOT_FOUND_OR_CONFLICT
from app.api.routes.runs import order_profiles_for_plan, plan_public, predicted_reads
from app.errors import InvalidFieldError
from app.perfmodel.optimize import NoPlanError
from app.queries import predictions
from app.queries import runs as run_queries
from app.queries.bundles import get_bundle
from app.queries.datasets import get_dataset
from app.schemas.predictions import MAX_OPTIMIZE_CANDIDATES, OptimizeRequest, OptimizeResultPublic
from app.schemas.runs import RunCreate
from hybridtrain.train_options import sections_for

router = APIRouter()

NO_PLAN = {
    422: {"description": "a field is invalid; for a budget or deadline nobody meets, `cheapest` is "
                         "the nearest plan there is"},
}


PROFILING = {
    202: {"description": "with profile_missing, while candidates are being profiled: "
                         '{"detail": why there is no plan yet, "profiling": [ProfilingPublic]}; ask again'},
}


@router.post("/optimize", response_model=OptimizeResultPublic,
             responses={**NOT_FOUND_OR_CONFLICT, **NO_PLAN, **PROFILING})
def optimize_plan(
    session: SessionDep, principal: CiDep, dispatcher: DispatcherDep, body: OptimizeRequest
) -> OptimizeResultPublic | JSONResponse:
    """Choose the nodes, the strategy and the server that best meet the goal, and say why."""
    field = "cluster_id" if body.cluster_id is not None else "node_ids"
    if body.bundle_sha256 is not None:
        get_bundle(session, sha256=body.bundle_sha256, field="bundle_sha256")
    for name in body.datasets or []:
        get_dataset(session, name=name, field="datasets")
    nodes = run_queries.load_plan_nodes(session, node_ids=body.node_ids, cluster_id=body.cluster_id)
    if len(nodes) > MAX_OPTIMIZE_CANDIDATES:
        raise InvalidFieldError(field, f"{field}: at most {MAX_OPTIMIZE_CANDIDATES} candidate nodes, got "
                                       f"{len(nodes)}; narrow the set (the search grows as 2^n)")
    run_queries.check_usable(nodes)
    inputs = predictions.model_inputs(
        session, nodes=nodes, task=body.task, task_args=body.task_args, bundle_sha256=body.bundle_sha256,
        compression=body.compression, local_sgd=body.local_sgd, eval_every=body.eval_every,
        max_steps=body.max_steps, datasets=body.datasets or (),
    )
    if isinstance(inputs, str) and body.profile_missing:
        profiling = order_profiles_for_plan(
            session, dispatcher, principal, nodes=nodes, task=body.task, task_args=body.task_args,
            bundle_sha256=body.bundle_sha256, device="auto",
        )
        if profiling:
            return JSONResponse(status_code=status.HTTP_202_ACCEPTED,
                                content=jsonable_encoder({"detail": inputs, "profiling": profiling}))
    if isinstance(inputs, str):
        raise InvalidFieldError(field, f"{field}: {inputs}")
    addressed = [n.id for n in nodes if run_queries.plan_node(n).address]
    try:
        result = predictions.run_optimizer(
            inputs, node_ids=[n.id for n in nodes], servers=addressed, global_batch=body.global_batch_size,
            goal=body.goal, budget_usd_per_h=body.budget_usd_per_h, deadline_s=body.deadline_s,
            strategies=body.strategies,
        )
    except NoPlanError as exc:
        detail = [{"type": "value_error", "loc": ["body", exc.field], "msg": exc.message}]
        cheapest = predictions.plan_choice_public(exc.cheapest) if exc.cheapest is not None else None
        return JSONResponse(status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
                            content={"detail": detail, "cheapest": cheapest})
    best = result.best
    # The options as the chosen strategy takes them (another strategy's are dropped).
    chosen = sections_for(best.strategy, compression=body.compression, local_sgd=body.local_sgd)
    # The chosen plan as a run request: the form fills itself from it, and the planner checks it.
    data = RunCreate(
        name="suggested", node_ids=list(best.node_ids), strategy=best.strategy, task=body.task,
        task_args=body.task_args, bundle_sha256=body.bundle_sha256,
        global_batch_size=body.global_batch_size, max_steps=body.max_steps,
        allocation="measured" if best.strategy == "ps-bz-gc" else "equal",
        ps_node_id=best.server_node_id, compression=chosen["compression"], local_sgd=chosen["local_sgd"],
        eval_every=body.eval_every, datasets=body.datasets,
    )
    planned = run_queries.make_planned(session, data=data, compare=True)
    return OptimizeResultPublic(
        goal=result.goal.value,
        plan=plan_public(data, planned, data_reads=predicted_reads(session, data, planned)),
        explanation=result.explanation,
        left_out_node_ids=list(result.left_out),
        evaluated=result.evaluated,
        runners_up=[predictions.plan_choice_public(p) for p in result.runners_up],
        baseline=predictions.plan_choice_public(result.baseline) if result.baseline else None,
    )
