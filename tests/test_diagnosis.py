"""common.measure.diagnosis: one verdict per run from its own records, on records built for each verdict."""

import pytest
from records import complete_record

from common.measure import diagnosis as dg
from common.measure import results


def phases(train=80.0, *outside: tuple[str, float]) -> list[dict]:
    """A run's phases back to back: the ``outside`` (name, seconds), then one ``train`` phase."""
    rows, start = [], 1000.0
    for name, seconds in [*outside, ("train", train)]:
        rows.append({"phase": name, "start": start, "seconds": seconds})
        start += seconds
    return rows


def gpus(*utilization, memory=(1000.0, 1000.0)) -> dict:
    return {
        f"gpu:{index}": {"utilization_mean_percent": used, "memory_peak_mib": mib}
        for index, (used, mib) in enumerate(zip(utilization, memory))
    }


def training(**changes) -> dict:
    """A healthy 2-GPU run: steps fill 80% of the run, 5% waiting for batches, both devices 90% busy."""
    fields = dict(
        device_kind="gpu",
        devices=2,
        device_names=["H200", "H200"],
        prepared_size=256,
        epoch_seconds=[30.0, 20.0, 20.0],
        data_wait_seconds=[5.0, 1.0, 1.0],
        images_per_second=1800.0,
        phases=phases(80.0, ("start-up", 10.0), ("test", 10.0)),
        device_utilization=gpus(90.0, 90.0),
    )
    return complete_record(**{**fields, **changes})


def in_ram(rate=2000.0, **changes) -> dict:
    return complete_record(**{"device_kind": "gpu", "data": results.IN_RAM, "images_per_second": rate, **changes})


def test_steps_that_keep_the_devices_busy():
    found = dg.diagnose(training(), in_ram(), single_device_images_per_second=1000.0)
    assert found.verdict == dg.BUSY
    assert found.numbers[dg.UTILIZATION] == 90.0 and found.numbers[dg.OUTSIDE] == pytest.approx(0.2)
    assert found.numbers[dg.WAIT] == pytest.approx(0.05)  # the first epoch left out, as for images/s
    assert found.numbers[dg.EFFICIENCY] == pytest.approx(0.9) and found.numbers[dg.RATE_RATIO] == pytest.approx(0.9)
    assert found.behind[0] == dg.UTILIZATION and found.skipped == ()
    assert "PRECISION='mixed'" in found.first_try


def test_start_up_or_evaluation_dominated_names_the_largest_phase():
    found = dg.diagnose(training(phases=phases(20.0, ("start-up", 10.0), ("data check", 50.0), ("validate", 20.0))))
    assert found.verdict == dg.START_UP
    assert found.numbers[dg.OUTSIDE] == pytest.approx(0.8) and found.numbers[dg.SPAN] == 100.0
    assert found.numbers[dg.LARGEST] == "data check" and found.numbers[dg.LARGEST_SECONDS] == 50.0
    assert found.first_try.startswith("The largest is data check (50 s)") and "make prepare" in found.first_try


def test_warm_up_steps_count_as_start_up_and_the_time_between_phases_does_not():
    rows = phases(30.0, ("first steps", 40.0))
    rows.append({"phase": "test", "start": rows[-1]["start"] + 1000.0, "seconds": 30.0})  # a long pause before it
    found = dg.diagnose(training(phases=rows))
    assert found.numbers[dg.OUTSIDE] == pytest.approx(70.0 / 1070.0)  # a person's pause is not the run's fault
    rows = phases(30.0, ("first steps", 40.0))
    found = dg.diagnose(training(phases=rows))
    assert found.verdict == dg.START_UP and found.numbers[dg.LARGEST] == "first steps"
    assert "EPOCHS" in found.first_try


def test_input_bound_when_the_loop_waits_for_batches():
    found = dg.diagnose(training(data_wait_seconds=[9.0, 8.0, 8.0]), in_ram())
    assert found.verdict == dg.INPUT and found.behind[0] == dg.WAIT
    assert found.numbers[dg.WAIT] == pytest.approx(0.4)
    assert "more CPU cores" in found.first_try  # already reading the prepared cache: more decode workers
    decoded = dg.diagnose(training(data_wait_seconds=[9.0, 8.0, 8.0], prepared_size=None))
    assert "PREPARED=True" in decoded.first_try


def test_input_bound_when_training_falls_well_below_the_in_ram_speed_while_waiting():
    found = dg.diagnose(training(data_wait_seconds=[3.0, 3.0, 3.0]), in_ram(rate=3000.0))
    assert found.verdict == dg.INPUT and found.behind[0] == dg.RATE_RATIO
    assert found.numbers[dg.RATE_RATIO] == pytest.approx(0.6) and found.numbers[dg.WAIT] == pytest.approx(0.15)
    # the same gap without a measurable wait points elsewhere: not the input
    assert dg.diagnose(training(), in_ram(rate=3000.0)).verdict != dg.INPUT
    # Keras' model.fit does not let the loop see its wait: the gap alone decides
    assert dg.diagnose(training(data_wait_seconds=[None] * 3), in_ram(rate=3000.0)).verdict == dg.INPUT


def test_devices_unevenly_used_by_utilization_or_memory():
    found = dg.diagnose(training(device_utilization=gpus(95.0, 55.0)), in_ram())
    assert found.verdict == dg.UNEVEN and found.behind[0] == dg.SPREAD
    assert found.numbers[dg.SPREAD] == 40.0 and found.numbers[dg.UTILIZATION] == 75.0
    assert "equal share" in found.first_try
    gathered = training(variant="dp-gather", peak_memory_mib_per_device={"cuda:0": 9000.0, "cuda:1": 4500.0})
    found = dg.diagnose(gathered)
    assert found.verdict == dg.UNEVEN and found.behind[0] == dg.MEMORY
    assert found.numbers[dg.MEMORY] == 2.0  # the framework's own peaks, not NVML's (both 1000 MiB here)
    assert "loss inside each replica" in found.first_try


def test_only_the_devices_the_run_used_are_compared():
    watched = gpus(92.0, 88.0, 0.0, 0.0, memory=(1000.0,) * 4)  # 2 of 4 GPUs used, the others idle
    found = dg.diagnose(training(device_utilization=watched))
    assert found.verdict == dg.BUSY and found.numbers[dg.SPREAD] == 4.0


def test_communication_bound_when_the_devices_add_little():
    found = dg.diagnose(training(images_per_second=1000.0), in_ram(rate=1100.0), single_device_images_per_second=1000.0)
    assert found.verdict == dg.COMMUNICATION and found.behind == (dg.EFFICIENCY, dg.WAIT)
    assert found.numbers[dg.EFFICIENCY] == pytest.approx(0.5) and found.numbers[dg.SINGLE_RATE] == 1000.0
    assert "BATCH_SIZE_PER_DEVICE" in found.first_try and "no_sync" in found.first_try


def test_precedence_when_several_rules_hold():
    slow = dict(images_per_second=500.0, data_wait_seconds=[10.0, 10.0, 10.0], device_utilization=gpus(95.0, 40.0))
    # start-up beats everything: the steps no longer decide how long the run takes
    mostly_test = training(**slow, phases=phases(20.0, ("test", 80.0)))
    assert dg.diagnose(mostly_test, in_ram(), 1000.0).verdict == dg.START_UP
    # the input beats uneven use and scaling: a starved device is also uneven and scales badly
    assert dg.diagnose(training(**slow), in_ram(), 1000.0).verdict == dg.INPUT
    # uneven use beats communication: device 0's extra work also lowers scaling
    uneven = training(images_per_second=500.0, device_utilization=gpus(95.0, 40.0))
    assert dg.diagnose(uneven, in_ram(), 1000.0).verdict == dg.UNEVEN


def test_missing_records_skip_their_rules_and_say_so():
    bare = training(phases=None, data_wait_seconds=None, device_utilization={})
    found = dg.diagnose(bare)
    assert found.verdict == dg.BUSY and found.behind == (dg.TRAIN_RATE,)
    assert all(found.numbers[name] is None for name in (dg.OUTSIDE, dg.WAIT, dg.RATE_RATIO, dg.SPREAD, dg.EFFICIENCY))
    assert [reason.split(":")[0] for reason in found.skipped] == [dg.START_UP, dg.INPUT, dg.UNEVEN, dg.COMMUNICATION]
    text = found.describe()
    assert "Not judged: input-bound" in text and "Not available: run span;" in text and text == str(found)


def test_simulated_cpu_devices_are_not_judged_uneven_or_communication_bound():
    cpu = training(
        device_kind="cpu",
        device_utilization={"cpu": {"utilization_mean_percent": 50.0, "memory_peak_mib": 2048.0}},
        images_per_second=60.0,
    )
    found = dg.diagnose(cpu, in_ram(rate=70.0, device_kind="cpu"), single_device_images_per_second=100.0)
    assert found.verdict == dg.BUSY and found.numbers[dg.EFFICIENCY] == pytest.approx(0.3)
    assert [reason.split(":")[0] for reason in found.skipped] == [dg.UNEVEN, dg.COMMUNICATION]
    assert "share the cores" in found.skipped[1]


def test_one_device_runs_are_judged_on_start_up_input_and_busy_steps_only():
    found = dg.diagnose(training(devices=1, device_utilization=gpus(40.0, 0.0)), in_ram())
    assert found.verdict == dg.BUSY and found.numbers[dg.UTILIZATION] == 40.0  # the busier watched GPU is the used one
    assert found.numbers[dg.SPREAD] is None and found.numbers[dg.EFFICIENCY] is None
    assert "idle between kernels" in found.first_try


def test_describe_reads_as_a_short_paragraph():
    text = dg.diagnose(training(data_wait_seconds=[9.0, 8.0, 8.0]), in_ram()).describe()
    lines = text.splitlines()
    assert lines[0] == (
        "Diagnosis: input-bound (waiting for batches, share of training time: 40%; training over in-RAM images/s: 90%)."
    )
    assert lines[-1].startswith("First try: More loader workers") and len(lines) <= 6


def test_the_report_table_diagnoses_the_newest_run_of_each_notebook_and_devices():
    def at(hour):
        return f"2026-01-01T{hour:02d}:00:00+00:00"

    records = [
        training(devices=1, images_per_second=1000.0, device_utilization=gpus(90.0), timestamp=at(1)),
        in_ram(devices=1, rate=1100.0, timestamp=at(1)),
        training(images_per_second=900.0, timestamp=at(2)),  # an older 2-device run
        training(images_per_second=1000.0, timestamp=at(3)),
        in_ram(rate=1100.0, timestamp=at(3)),
        training(notebook="Gluon_MultiGPU", framework="mxnet", data_wait_seconds=[9.0] * 3, timestamp=at(4)),
    ]
    table = dg.table(records)
    assert list(table.columns) == dg.TABLE_COLUMNS
    assert table[["notebook", "devices", "verdict"]].values.tolist() == [
        ["Gluon_MultiGPU", 2, dg.INPUT],
        ["PyTorch_MultiGPU", 1, dg.BUSY],
        ["PyTorch_MultiGPU", 2, dg.COMMUNICATION],  # 1000 / (2 x 1000): the one-device run was found
    ]
    assert table["key number"].iloc[2] == "scaling efficiency: 50%"
    assert "KVSTORE='nccl'" not in table["first try"].iloc[0]  # input-bound: the input's advice
    assert dg.table([in_ram()]).empty, "no training run, nothing to diagnose"


def test_variants_get_rows_of_their_own_with_their_benchmark():
    peaks = {"dp-gather": {"cuda:0": 6000.0, "cuda:1": 3000.0}, "ddp": {"cuda:0": 3000.0, "cuda:1": 3000.0}}
    records = [
        training(notebook="PyTorch_MultiGPU-Exp-Loss", variant=way, peak_memory_mib_per_device=peaks[way])
        for way in peaks
    ]
    records.append(in_ram(notebook="PyTorch_MultiGPU-Exp-Loss", variant="ddp", rate=2500.0))
    table = dg.table(records).set_index("notebook")
    assert table.loc["PyTorch_MultiGPU-Exp-Loss (dp-gather)", "verdict"] == dg.UNEVEN
    assert table.loc["PyTorch_MultiGPU-Exp-Loss (dp-gather)", "key number"] == (
        "device 0 peak memory over the others' mean: 2.00x"
    )
    assert table.loc["PyTorch_MultiGPU-Exp-Loss (ddp)", "verdict"] == dg.BUSY
    found = dict((record.get("variant"), result) for record, result in dg.diagnoses(records))
    assert found["ddp"].numbers[dg.RAM_RATE] == 2500.0 and found["dp-gather"].numbers[dg.RAM_RATE] is None


def test_the_verdict_agrees_with_the_steps_share_it_shows():
    """47% of the run outside the steps and 44% in them is not "the steps keep the devices busy"."""
    rows = phases(44.0, ("start-up", 25.0), ("test", 13.0))
    rows.append({"phase": "teardown", "start": rows[-1]["start"] + 53.0, "seconds": 9.0})  # 9 s between phases
    found = dg.diagnose(training(phases=rows))
    assert found.numbers[dg.OUTSIDE] == pytest.approx(0.47) and found.numbers[dg.STEPS_SHARE] == pytest.approx(0.44)
    assert found.verdict == dg.START_UP
    busy = dg.diagnose(training(), in_ram())
    assert busy.verdict == dg.BUSY and dg.STEPS_SHARE in busy.behind and dg.OUTSIDE not in busy.behind


@pytest.mark.parametrize(
    ("framework", "kind", "said", "not_said"),
    [
        ("pytorch", "gpu", "cuDNN's autotuning", "tracing"),
        ("pytorch", "cpu", "allocating", "cuDNN"),
        ("tensorflow", "cpu", "tracing the step", "COMPILE"),
        ("mxnet", "cpu", "hybridized graph", "cuDNN"),
    ],
)
def test_first_steps_advice_names_what_the_framework_does_there(framework, kind, said, not_said):
    record = training(framework=framework, device_kind=kind, phases=phases(30.0, ("first steps", 40.0)))
    found = dg.diagnose(record)
    assert found.verdict == dg.START_UP and said in found.first_try and not_said not in found.first_try


@pytest.mark.parametrize(
    ("framework", "notebook", "kind", "said", "not_said"),
    [
        ("chainer", "Chainer_MultiGPU", "cpu", "more cores", "PRECISION='mixed'"),  # fp32 only on CPUs
        ("pytorch", "PyTorch_MultiGPU", "cpu", "PRECISION='mixed'", "CUDA graphs"),
        ("chainer", "Chainer_MultiGPU", "gpu", "PRECISION='mixed'", "torch.compile"),
        ("mxnet", "Gluon_MultiGPU", "gpu", "static_shape", "torch.compile"),
        ("keras", "Keras_TF_MultiGPU", "gpu", "jit_compile", "torch.compile"),
        ("keras-jax", "Keras_JAX_MultiGPU", "gpu", "compiled already", "jit_compile"),
        ("pytorch", "PyTorch_Sharded", "gpu", "torch.compile", "PRECISION='mixed'"),  # fp32 by design
    ],
)
def test_busy_advice_is_what_that_notebook_can_do_on_that_device(framework, notebook, kind, said, not_said):
    utilization = gpus(90.0, 90.0) if kind == "gpu" else {}
    framework, _, backend = framework.partition("-")  # keras-jax: Keras on its JAX backend
    extra = {"backend": backend} if backend else {}
    record = training(framework=framework, notebook=notebook, device_kind=kind, device_utilization=utilization, **extra)
    found = dg.diagnose(record, in_ram(device_kind=kind, framework=framework, notebook=notebook, **extra))
    assert found.verdict == dg.BUSY, found
    assert said in found.first_try and not_said not in found.first_try, found.first_try
