"""Keras_Speedups, executed once under nbval on the CPU; then its records are checked."""

import pytest
from notebook_harness import marks, records_by_variant

from common.measure import results

pytestmark = marks("Keras_Speedups")

NOTEBOOK = "Keras_Speedups"
# One batch in the sweep (the baseline's: its step is traced already), one map thread beside AUTOTUNE: on a CPU each
# new shape or policy costs a trace of DenseNet-121's training step, half a minute.
TINY = dict(IMAGE_SIZE=32, BATCH_SIZE_PER_DEVICE=8, BENCH_STEPS=2, MAX_IMAGES=200, BATCH_SIZES=[8], MAP_THREADS=[1])
# measured on a CPU: 1 map thread, AUTOTUNE and no prefetch, the baseline, 1 batch, float32 and mixed_bfloat16, and
# the traced graph (XLA is measured on a GPU or on request)
RECORDS = 3 + 1 + 1 + 2 + 1


@pytest.fixture(scope="module")
def records(notebook_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("keras-speedups")
    return records_by_variant(NOTEBOOK, notebook_data, out, RECORDS, **TINY), out


def test_every_technique_is_measured_and_recorded(records):
    found, _ = records
    assert {variant.split(":")[0] for variant in found} == {"input pipeline", "baseline", "batch size", "precision",
                                                           "compiler"}  # fmt: skip
    pipeline = [variant.split(": ")[1] for variant in found if variant.startswith("input pipeline")]
    assert sorted(pipeline) == ["1 map threads", "AUTOTUNE", "AUTOTUNE, no prefetch"], "the page's tf.data chains"
    for record in found.values():
        assert record["data"] == results.IN_RAM and record["images_per_second"] > 0 and record["notebook"] == NOTEBOOK
        assert record["framework"] == "keras" and record["devices"] == 1
    assert found["compiler: none (traced graph)"]["first_steps_seconds"] > 1, "the first step traced the model"


def test_what_needs_a_gpu_or_a_long_compile_is_named_not_measured(records):
    why = next(iter(records[0].values()))["not_measured"]
    assert why["precision: mixed_float16"] == "float16 compute needs a GPU"
    assert "XLA=True" in why["compiler: XLA (jit_compile=True)"]


def test_the_profile_and_its_trace_are_written_next_to_the_results(records):
    (profile,) = (records[1] / "results" / "traces").glob("keras-speedups-*")
    assert (profile / "trace.json").stat().st_size > 0 and list(profile.rglob("*.xplane.pb"))
