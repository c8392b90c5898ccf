"""common.measure.phases: where a run's time goes, on one clock for the notebook and the processes it launches."""

import time

import pytest

from common.measure import phases as run_phases
from common.measure.phases import BatchWait, Phases


def test_phases_are_timed_summed_per_name_and_the_rest_of_the_span_shown():
    phases = Phases()
    phases.add("start-up", 100.0, 102.0)
    phases.add("train", 103.0, 107.0, epoch=1)
    phases.add("train", 107.0, 110.0, epoch=2)
    table = phases.table()
    assert list(table.index) == ["start-up", "train", run_phases.BETWEEN]
    assert table.loc["train", "seconds"] == 7.0 and table.loc["train", "times"] == 2
    assert table.loc[run_phases.BETWEEN, "seconds"] == 1.0  # 102..103
    assert table["share of the run so far"].sum() == pytest.approx(1.0)
    assert run_phases.steps_share(phases.rows()) == pytest.approx(0.7)  # 7 s of training in the 10 s span
    assert run_phases.table(phases.rows()).loc["train", "share of run"] == pytest.approx(0.7)


def test_a_launched_scripts_phases_fall_between_its_launch_and_teardown():
    phases = Phases()
    phases.add_launched(
        [{"phase": "start-up", "start": 10.0, "seconds": 3.0}, {"phase": "test", "start": 13.0, "seconds": 1.0}],
        9.0,
        16.0,
    )
    assert [(row["phase"], row["seconds"]) for row in phases.rows()] == [
        ("launch", 1.0),
        ("start-up", 3.0),
        ("test", 1.0),
        ("teardown", 2.0),
    ]


def test_a_context_records_even_when_the_phase_fails_and_unknown_names_are_refused():
    phases = Phases()
    with pytest.raises(ZeroDivisionError), phases("test"):
        raise ZeroDivisionError
    assert phases.rows()[0]["phase"] == "test"
    with pytest.raises(ValueError, match="unknown phase 'traning'"):
        phases.add("traning", 0.0, 1.0)


def test_start_up_outside_a_notebook_counts_from_the_process_start():
    phases = Phases.start_up()
    (row,) = phases.rows()
    assert row["phase"] == "start-up" and 0 < row["seconds"] < time.time()


def test_batch_wait_counts_only_the_time_spent_waiting_for_batches():
    def slow():
        for item in range(3):
            time.sleep(0.05)
            yield item

    waited, start = BatchWait(slow()), time.perf_counter()
    for _ in waited:
        time.sleep(0.05)  # the step: not waiting
    assert 0.15 <= waited.seconds <= time.perf_counter() - start - 0.15
