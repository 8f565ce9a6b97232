"""The progress `runs create --wait` and the benchmarks show: a pure line of (run, latest
metrics, now), plain lines at most every 10 s off a terminal, a tqdm bar on one."""

from __future__ import annotations

import io

import pytest

from hybridtrain.progress import RunProgress, Snapshot, duration, progress_line

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z
STARTED = "2027-01-15T08:00:00Z"


def _run(**fields) -> dict:
    return {"id": 7, "status": "running", "max_steps": 500, "target": None, "started_at": STARTED, **fields}


def _series(name: str, *points: tuple[int, float, float | None], peer: int | None = None) -> dict:
    return {"name": name, "rank": 0, "peer": peer, "count": len(points), "downsampled": False,
            "points": [list(p) for p in points]}


def _snapshot(*series: dict) -> Snapshot:
    return Snapshot().merged(list(series))


def test_the_line_shows_steps_speed_target_metric_and_times():
    snap = _snapshot(
        _series("samples_per_s", (20, T0 + 2, 30.0), (120, T0 + 62, 38.2)),
        _series("accuracy", (100, T0 + 50, 0.9121)),
        _series("loss", (120, T0 + 62, 0.4)),
    )
    line = progress_line(_run(target="accuracy>=0.9"), snap, now=T0 + 62)
    # 100 steps in 60 s since step 20: 380 steps left take 228 s.
    assert line == "step 120/500 (24%) 38.2 samples/s accuracy 0.912 elapsed 1m02s left 3m48s"


def test_the_speed_is_the_runs_when_rank_0_is_one_worker_of_an_all_reduce_run():
    # Rank 0 trained 92 of the 368 samples of step 30 at 26.5 samples/s: the run did 106.
    snap = _snapshot(_series("samples_per_s", (30, T0, 26.5)), _series("batch_size", (30, T0, 92.0)))
    assert " 106.0 samples/s " in progress_line(_run(global_batch_size=368), snap, now=T0)


def test_a_ps_servers_speed_is_the_runs_already():
    snap = _snapshot(_series("samples_per_s", (30, T0, 240.0)), _series("batch_size", (30, T0, 368.0)))
    assert " 240.0 samples/s " in progress_line(_run(global_batch_size=368), snap, now=T0)


def test_a_local_sgd_servers_speed_over_a_round_of_inner_steps_is_the_runs_already():
    # H = 20 inner steps of a global batch of 64 each: the outer step's record is of 1280 samples.
    snap = _snapshot(_series("samples_per_s", (40, T0, 474.5)), _series("batch_size", (40, T0, 1280.0)))
    assert " 474.5 samples/s " in progress_line(_run(global_batch_size=64), snap, now=T0)


def test_without_a_target_the_tasks_own_metric_is_shown_before_val_loss():
    snap = _snapshot(_series("val_loss", (50, T0, 0.3)), _series("r2", (50, T0, 0.71)), _series("loss", (50, T0, 0.2)))
    assert " r2 0.710 " in progress_line(_run(), snap, now=T0)


def test_without_a_target_or_evaluation_the_training_loss_is_shown():
    snap = _snapshot(_series("loss", (5, T0, 2.302)), _series("max_steps", (0, T0 - 1, 500.0)))
    assert " loss 2.302 " in progress_line(_run(), snap, now=T0)


def test_a_legacy_metric_is_not_taken_for_an_evaluation_metric():
    snap = _snapshot(_series("time_to_accuracy_s", (5, T0, 12.0)), _series("loss", (5, T0, 1.5)))
    assert " loss 1.500 " in progress_line(_run(), snap, now=T0)


def test_steps_have_no_total_until_an_epochs_run_reports_max_steps():
    snap = _snapshot(_series("loss", (40, T0 + 10, 1.0)))
    assert progress_line(_run(max_steps=None), snap, now=T0 + 10) == "step 40 loss 1.000 elapsed 0m10s"


def test_the_trainers_max_steps_gives_the_total_of_an_epochs_run():
    snap = _snapshot(_series("max_steps", (0, T0, 90.0)), _series("loss", (45, T0 + 10, 1.0)))
    assert progress_line(_run(max_steps=None), snap, now=T0 + 10).startswith("step 45/90 (50%) ")


def test_before_the_first_step_the_line_says_so():
    assert progress_line(_run(max_steps=None, started_at=None), Snapshot(), now=T0) == "waiting for the first step"


def test_newer_polls_replace_older_values_and_peer_series_are_left_out():
    snap = _snapshot(_series("loss", (10, T0, 2.0)), _series("bytes_sent", (12, T0 + 1, 5.0), peer=1))
    snap = snap.merged([_series("loss", (20, T0 + 5, 1.0))])
    assert (snap.step, snap.latest["loss"].value, "bytes_sent" in snap.latest) == (20, 1.0, False)


def test_durations_read_as_minutes_and_hours():
    assert (duration(5), duration(62), duration(3723)) == ("0m05s", "1m02s", "1h02m03s")


class _Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _progress(answers: list[dict | Exception], *, tty: bool, **options) -> tuple[RunProgress, io.StringIO, _Clock, list[dict]]:
    calls: list[dict] = []

    def fetch(run_id: int, **params) -> dict:
        calls.append(params)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    stream, clock = io.StringIO(), _Clock()
    return RunProgress(fetch, stream, tty=tty, clock=clock, **options), stream, clock, calls


def _answer(step: int, t: float) -> dict:
    return {"series": [_series("loss", (step, t, 1.0))], "last_t": t}


def test_plain_lines_come_at_most_every_ten_seconds():
    progress, stream, clock, _ = _progress([_answer(s, T0 + s) for s in (1, 2, 3)], tty=False)
    progress.poll(_run())
    clock.now += 5
    progress.poll(_run())
    clock.now += 6
    progress.poll(_run())
    lines = stream.getvalue().splitlines()
    assert [line.split(" loss")[0] for line in lines] == ["hybridtrain: step 1/500 (0%)", "hybridtrain: step 3/500 (0%)"]


def test_each_poll_asks_rank_0_only_for_newer_points():
    progress, _, _, calls = _progress([_answer(1, T0 + 1), _answer(2, T0 + 2)], tty=False)
    progress.poll(_run())
    progress.poll(_run())
    assert [(c["rank"], c["since"]) for c in calls] == [(0, None), (0, T0 + 1)]


def test_metrics_are_not_polled_before_the_run_runs():
    progress, stream, _, calls = _progress([], tty=False)
    progress.poll(_run(status="launching"))
    assert (calls, stream.getvalue()) == ([], "")


def test_on_a_terminal_a_bar_shows_the_step_of_max_steps():
    progress, stream, clock, _ = _progress([_answer(120, T0 + 62)], tty=True)
    clock.now = T0 + 62
    progress.poll(_run())
    progress.note("hybridtrain: run 7 succeeded")
    progress.close()
    out = stream.getvalue()
    assert "| 120/500 loss 1.000 elapsed 1m02s" in out and "hybridtrain: run 7 succeeded\n" in out


def test_a_missed_poll_is_skipped_and_the_next_one_catches_up():
    progress, stream, clock, _ = _progress([TimeoutError("slow"), _answer(2, T0 + 2)], tty=False,
                                           missed=(TimeoutError,))
    progress.poll(_run())
    assert stream.getvalue() == ""
    progress.poll(_run())
    assert stream.getvalue().startswith("hybridtrain: step 2/500")


def test_an_error_that_is_not_a_missed_poll_is_raised():
    progress, _, _, _ = _progress([KeyError("bug")], tty=False, missed=(TimeoutError,))
    with pytest.raises(KeyError):
        progress.poll(_run())


def test_plain_lines_start_with_the_label():
    progress, stream, _, _ = _progress([_answer(3, T0 + 3)], tty=False, label="  [2/4] ps, seed 0")
    progress.poll(_run())
    assert stream.getvalue().startswith("  [2/4] ps, seed 0: step 3/500 (0%)")
