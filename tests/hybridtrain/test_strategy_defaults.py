"""The strategies' defaults: options each strategy takes, filled in only where a run gave none,
derived from what it gave where one follows another, and refused where a bound given alone
leaves out the default density."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hybridtrain import compat
from hybridtrain.contract import STRATEGIES
from hybridtrain.strategy_defaults import DERIVED, TABLE, default, defaults, describe, effective
from hybridtrain.train_options import SECTION_OF, TrainOptions


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_strategys_defaults_are_options_it_takes_and_valid_together(strategy):
    filled = TrainOptions(strategy=strategy).with_defaults()
    assert not compat.problems(strategy, filled.options())
    TrainOptions.model_validate(filled.model_dump())


def test_every_path_of_the_table_is_a_training_option():
    options = {*TrainOptions.model_fields, *(f"{section}.{name}" for name, section in SECTION_OF.items())}
    assert TABLE.keys() <= options
    assert {source for source, _ in DERIVED.values()} <= TABLE.keys()


def test_what_a_run_gives_wins_over_its_strategys_default():
    given = {"compression.pipeline_chunks": 1, "compression.warmup_steps": 5}
    filled = defaults("ps-bz-gc", given)
    assert given.keys().isdisjoint(filled)
    assert filled["compression.server_k_fraction"] == default("ps-bz-gc", "compression.server_k_fraction")


def test_a_density_given_alone_brings_its_band():
    band = defaults("ps-gc", {"compression.density": 0.01})
    assert (band["compression.density_min"], band["compression.density_max"]) == pytest.approx((0.004, 0.02))
    assert defaults("ps-gc", {"compression.density": 0.8})["compression.density_max"] == 1.0


def test_asynchronous_outer_steps_switch_off_the_default_delay():
    assert "local_sgd.outer_delay" not in defaults("diloco", {"local_sgd.asynchronous": True})
    assert defaults("diloco", {"local_sgd.asynchronous": False})["local_sgd.outer_delay"] == 0


def test_a_strategy_without_a_default_for_an_option_leaves_it_to_the_trainer():
    assert defaults("allreduce") == {}
    assert "rebalance_every" not in defaults("ps") and "compression.density" not in defaults("ps")


def test_the_effective_options_keep_the_requests_shape():
    run = effective("diloco-gc", {"compression": {"value_dtype": "fp32"}, "local_sgd": {"sync_every": 4},
                                  "rebalance_every": None})
    assert run["compression"] == {"value_dtype": "fp32",
                                  "pipeline_chunks": default("diloco-gc", "compression.pipeline_chunks")}
    assert run["local_sgd"]["sync_every"] == 4 and run["local_sgd"]["outer_delay"] == 0
    assert run["rebalance_every"] == default("diloco-gc", "rebalance_every")


@pytest.mark.parametrize("bound", ["density_min", "density_max"])
def test_a_bound_given_alone_that_leaves_out_the_default_density_is_refused(bound):
    value = {"density_min": 0.5, "density_max": 0.001}[bound]
    with pytest.raises(ValidationError) as exc:
        TrainOptions.model_validate({"strategy": "ps-bz-gc", "compression": {bound: value}})
    assert exc.value.errors()[0]["loc"] == ("compression", bound)
    assert "give the density too" in str(exc.value)
    TrainOptions.model_validate({"strategy": "ps-bz-gc", "compression": {bound: value, "density": value}})


def test_apply_in_forward_alone_takes_the_default_pipeline_and_is_refused_with_one_chunk():
    TrainOptions.model_validate({"strategy": "ps-bz-gc", "compression": {"apply_in_forward": True}})
    with pytest.raises(ValidationError, match="needs compression.pipeline_chunks"):
        TrainOptions.model_validate({"strategy": "ps-bz-gc", "compression": {"apply_in_forward": True,
                                                                             "pipeline_chunks": 1}})


def test_the_defaults_read_as_help_text():
    assert describe("rebalance_every") == "5 for ps-bz-gc; 1 for diloco, diloco-gc"
    assert describe("compression.server_k_fraction") == "0.125 for ps-gc, ps-bz-gc"
