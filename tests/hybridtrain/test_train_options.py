"""A run's typed training options: the compat table's rules at the field they break, local SGD's
knobs in their own section (and their old place under compression, read for one release), the
same options planned for another strategy, and their JSON."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hybridtrain.train_options import TrainOptions, field_path, sections_for


def _loc(exc: pytest.ExceptionInfo[ValidationError]) -> tuple:
    return exc.value.errors()[0]["loc"]


@pytest.mark.parametrize(("options", "loc"), [
    ({"strategy": "ps", "local_sgd": {"sync_every": 5}}, ("local_sgd", "sync_every")),
    ({"strategy": "allreduce", "compression": {"pipeline_chunks": 2}}, ("compression", "pipeline_chunks")),
    ({"strategy": "diloco", "local_sgd": {"sync_every": 4, "outer_delay": 4}}, ("local_sgd", "outer_delay")),
    ({"strategy": "allreduce", "rebalance_every": 5}, ("rebalance_every",)),
    ({"strategy": "ps-bz-gc", "local_sgd": {"site_replicas": True}}, ("local_sgd", "site_replicas")),
    # Asynchronous outer steps replace the fixed delay, and a site replica's workers apply each together.
    ({"strategy": "diloco", "local_sgd": {"asynchronous": True, "outer_delay": 2}}, ("local_sgd", "outer_delay")),
    ({"strategy": "diloco", "local_sgd": {"asynchronous": True, "site_replicas": True}}, ("local_sgd", "asynchronous")),
    ({"strategy": "diloco", "local_sgd": {"max_staleness": 3}}, ("local_sgd", "max_staleness")),
    ({"strategy": "diloco", "local_sgd": {"asynchronous": True, "sync_every": 4, "max_staleness": 4}},
     ("local_sgd", "max_staleness")),
    ({"strategy": "diloco", "local_sgd": {"asynchronous": True, "sync_every": 1}}, ("local_sgd", "asynchronous")),
    ({"strategy": "ps-bz-gc", "local_sgd": {"asynchronous": True}}, ("local_sgd", "asynchronous")),
    ({"strategy": "diloco", "local_sgd": {"sync_every": 3, "fragments": 4}}, ("local_sgd", "fragments")),
    ({"strategy": "diloco", "local_sgd": {"fragments": 2, "site_replicas": True}}, ("local_sgd", "fragments")),
    ({"strategy": "diloco", "local_sgd": {"sync_every": 40, "fragments": 17}}, ("local_sgd", "fragments")),
    ({"strategy": "ps-gc", "compression": {"apply_in_forward": True, "pipeline_chunks": 2, "aggregate_at_sites": True}},
     ("compression", "apply_in_forward")),
])
def test_a_rule_of_the_compat_table_is_refused_at_the_field_that_breaks_it(options, loc):
    with pytest.raises(ValidationError) as exc:
        TrainOptions.model_validate(options)
    assert _loc(exc) == loc


def test_asynchronous_outer_steps_combine_with_streaming_fragments():
    options = TrainOptions.model_validate({"strategy": "diloco", "local_sgd": {"asynchronous": True, "fragments": 2}})
    assert options.local_sgd is not None and (options.local_sgd.asynchronous, options.local_sgd.fragments) == (True, 2)


def test_the_outer_knobs_under_compression_move_to_local_sgd():
    options = TrainOptions.model_validate(
        {"strategy": "diloco-gc", "compression": {"sync_every": 8, "outer_density": 0.2, "density": 0.05}})
    assert options.local_sgd is not None and (options.local_sgd.sync_every, options.local_sgd.outer_density) == (8, 0.2)
    assert options.compression is not None and options.compression.model_dump(exclude_none=True) == {"density": 0.05}


def test_an_outer_knob_given_in_both_places_is_refused():
    with pytest.raises(ValidationError, match="local_sgd.sync_every, not also compression.sync_every"):
        TrainOptions.model_validate({"strategy": "diloco", "compression": {"sync_every": 8},
                                     "local_sgd": {"sync_every": 4}})


def test_the_removed_overlap_option_is_an_unknown_field():
    with pytest.raises(ValidationError) as exc:
        TrainOptions.model_validate({"strategy": "ps", "compression": {"overlap": True}})
    assert _loc(exc) == ("compression", "overlap")


def test_the_same_options_for_another_strategy_drop_what_it_does_not_take():
    options = TrainOptions.model_validate({"strategy": "diloco-gc", "rebalance_every": 4,
                                           "compression": {"value_dtype": "fp8", "pipeline_chunks": 2},
                                           "local_sgd": {"sync_every": 8}})
    assert sections_for("allreduce", compression=options.compression, local_sgd=options.local_sgd,
                        rebalance_every=options.rebalance_every) == {
        "compression": options.compression.model_copy(update={"pipeline_chunks": None}), "local_sgd": None,
        "rebalance_every": None}
    assert options.for_strategy("ps-bz-gc").local_sgd is None
    assert options.for_strategy("diloco") == options.model_copy(update={"strategy": "diloco"})


def test_options_go_through_json_unchanged():
    options = TrainOptions.model_validate({"strategy": "ps-bz-gc", "task_args": {"lr": 0.1}, "epochs": 2.5,
                                           "compression": {"aggregate_at_sites": True, "pipeline_chunks": 4}})
    assert TrainOptions.model_validate_json(options.model_dump_json(exclude_none=True)) == options


def test_a_requests_name_of_an_option_says_its_section():
    assert [field_path(o) for o in ("pipeline_chunks", "outer_lr", "rebalance_every")] == [
        "compression.pipeline_chunks", "local_sgd.outer_lr", "rebalance_every"]
