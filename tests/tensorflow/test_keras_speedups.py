"""common.tensorflow.speedups: XLA computes the traced graph's step, and the measurements and the profile are read
right.

On a small network: DenseNet-121 takes a minute to compile with XLA on a CPU; the notebook test runs the real one.
"""

import json

import pandas as pd
import pytest

from common.data import chestxray
from common.teach import toolbox
from common.tensorflow import speedups as ks
from common.tensorflow import utils as tfu
from common.tensorflow.imports import keras, tf


def small():
    """Fed as the notebooks' DenseNet is: uint8 gray images, normalized by the model."""
    return keras.Sequential(
        [
            keras.Input((16, 16, 1), dtype="uint8"),
            tfu.GrayToImageNet(),
            keras.layers.Conv2D(8, 3),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(14, dtype="float32"),
        ]
    )


def test_models_built_from_one_seed_start_from_the_same_weights():
    first, second = ks.compiled(small, seed=3), ks.compiled(small, seed=3)
    for a, b in zip(first.get_weights(), second.get_weights()):
        assert (a == b).all()


def test_the_xla_compiled_step_takes_the_traced_steps_loss():
    """Step by step from the same weights, within float32 rounding of XLA's fused kernels."""
    plain, xla = ks.compiled(small, jit_compile=False), ks.compiled(small, jit_compile=True)
    assert xla.jit_compile and not plain.jit_compile
    losses = {}
    for name, model in (("plain", plain), ("xla", xla)):
        losses[name] = [ks.first_step(model, 4, 16)[0] for _ in range(3)]  # each call one more step
    assert losses["xla"] == pytest.approx(losses["plain"], rel=1e-5)
    first = pd.DataFrame({"first step loss": {ks.PLAIN: losses["plain"][0], ks.XLA: losses["xla"][0]}})
    assert ks.check_compiled(first).loc[f"{ks.XLA} (loss)", "largest difference"] < 1e-5
    assert ks.check_compiled(first.drop(ks.XLA)).empty, "no XLA model, nothing to check"


def test_a_policy_builds_the_model_in_its_compute_type_and_leaves_the_global_policy_alone():
    model = ks.compiled(small, policy="mixed_bfloat16")
    assert model.layers[0].compute_dtype == "bfloat16" and model.layers[-1].compute_dtype == "float32"
    assert keras.mixed_precision.global_policy().name == "float32"


def test_a_measurement_times_the_steps_after_the_warm_up():
    model = ks.compiled(small)
    row = ks.measure("batch size", "batch 4", model, ks.in_ram(4, 16), 4, steps=3, devices=1)
    assert row.images_per_second > 0 and row.first_steps_seconds > 0 and row.peak_memory_mib is None
    assert row.start < row.end and row.extra == {"devices": 1}
    assert toolbox.table([row]).loc[("batch size", "batch 4"), "images/s"] == round(row.images_per_second, 2)


def test_the_batch_sweep_stops_at_the_first_batch_that_does_not_fit(monkeypatch):
    measured = ks.measure

    def measure(technique, setting, model, data, batch, steps, **extra):
        if batch >= 16:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[16,64,56,56]")
        return measured(technique, setting, model, data, batch, steps, **extra)

    monkeypatch.setattr(ks, "measure", measure)
    rows = ks.sweep_batches(ks.compiled(small), [4, 8, 16, 32], 16, steps=2)
    assert [row.batch for row in rows] == [4, 8, 16] and "out of memory" in rows[-1].not_measured
    assert toolbox.stopped_because(rows) == "largest batch that fit: 8 (the next ran out of memory)"


def test_the_input_pipeline_is_measured_at_each_parallelism(standin):
    split = chestxray.load(standin, seed=0)["train"]
    model = ks.compiled(small)
    rows = ks.input_pipeline(model, split, 4, 16, steps=2, threads=[1, 2])
    assert [row.setting for row in rows] == ["1 map threads", "2 map threads", "AUTOTUNE", "AUTOTUNE, no prefetch"]
    assert all(row.images_per_second > 0 for row in rows) and rows[1].extra == {"threads": 2}


def test_xla_is_measured_on_a_gpu_and_on_request():
    assert ks.xla_default(None, "gpu") == (True, None)
    measured, why = ks.xla_default(None, "cpu")
    assert not measured and "XLA=True" in why
    assert ks.xla_default(True, "cpu") == (True, None)


def test_the_profile_names_the_ops_and_writes_a_chrome_trace(tmp_path):
    top, trace = ks.profile(ks.compiled(small), 4, 16, tmp_path, steps=2)
    assert any("Conv2D" in name for name in top.index) and 0 < top["share"].sum() <= 1.0001
    assert not any("__inference" in name or "PartitionedCall" in name for name in top.index), "ops, not functions"
    assert top.columns[0] == "host ms per step" and (top["host ms per step"] > 0).all()
    assert list(tmp_path.rglob("*.xplane.pb")), "the profile itself, for TensorBoard's profile plugin"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event["ph"] == "X" and "Conv2D" in event["name"] for event in events)
