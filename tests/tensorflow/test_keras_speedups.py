"""Keras_Speedups' own cells and common.tensorflow.speedups: the variants the page builds (XLA computes the traced
graph's step), the tf.data chain it writes reads what the TensorFlow notebooks read, and the measurements and the
profile are read right.

On a small network: DenseNet-121 takes a minute to compile with XLA on a CPU; the notebook test runs the real one.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from common.data import chestxray
from common.keras import model as km
from common.teach import toolbox
from common.tensorflow import speedups as ks
from common.tensorflow import utils as tfu
from common.tensorflow.imports import keras, tf


def small():
    """Fed as the notebooks' DenseNet is: uint8 gray images, normalized by the model."""
    return keras.Sequential(
        [
            keras.Input((16, 16, 1), dtype="uint8"),
            km.GrayToImageNet(),
            keras.layers.Conv2D(8, 3),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(14, dtype="float32"),
        ]
    )


NOTEBOOK = Path(__file__).parents[2] / "notebooks" / "Keras_Speedups.ipynb"


def page(start: str, **names) -> dict:
    """The names that the notebook's code cell starting with ``start`` defines, run with ``names`` as its globals."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    (source,) = [text for cell in cells if (text := "".join(cell["source"])).startswith(start)]
    exec(source, names)  # the notebook's own lines, as its kernel runs them
    return names


def densenet(seed: int = 0):
    """The page's ``densenet(policy, jit_compile)``, building :func:`small` where the page builds DenseNet-121."""
    network = SimpleNamespace(build_densenet121=lambda size: small())
    return page("def densenet(", keras=keras, km=network, tfu=tfu, ks=ks, SEED=seed, size=16)["densenet"]


def test_the_variants_the_page_builds_start_from_the_same_weights():
    first, second = densenet(seed=3)(), densenet(seed=3)("mixed_bfloat16")
    for a, b in zip(first.get_weights(), second.get_weights()):
        assert (a == b).all()


def test_the_xla_compiled_step_takes_the_traced_steps_loss():
    """Step by step from the same weights, within float32 rounding of XLA's fused kernels: the page's variants."""
    plain, xla = densenet()(), densenet()(jit_compile=True)
    assert xla.jit_compile and not plain.jit_compile
    losses = {}
    for name, model in (("plain", plain), ("xla", xla)):
        losses[name] = [ks.first_step(model, 4, 16)[0] for _ in range(3)]  # each call one more step
    assert losses["xla"] == pytest.approx(losses["plain"], rel=1e-5)
    first = pd.DataFrame({"first step loss": {ks.PLAIN: losses["plain"][0], ks.XLA: losses["xla"][0]}})
    assert ks.check_compiled(first).loc[f"{ks.XLA} (loss)", "largest difference"] < 1e-5
    assert ks.check_compiled(first.drop(ks.XLA)).empty, "no XLA model, nothing to check"


def test_a_policy_builds_the_model_in_its_compute_type_and_the_next_model_in_float32():
    build = densenet()
    model, after = build("mixed_bfloat16"), build()
    assert model.layers[0].compute_dtype == "bfloat16" and model.layers[-1].compute_dtype == "float32"
    assert keras.mixed_precision.global_policy().name == "float32" and after.layers[0].compute_dtype == "float32"
    assert isinstance(build("mixed_float16").optimizer, keras.optimizers.LossScaleOptimizer), "fp16 scales its loss"


def test_a_measurement_times_the_steps_after_the_warm_up():
    model = densenet()()
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
    rows = ks.sweep_batches(densenet()(), [4, 8, 16, 32], 16, steps=2)
    assert [row.batch for row in rows] == [4, 8, 16] and "out of memory" in rows[-1].not_measured
    assert toolbox.stopped_because(rows) == "largest batch that fit: 8 (the next ran out of memory)"


def test_the_pages_tf_data_chain_reads_what_the_notebooks_train_on(standin):
    """With any number of map threads, with or without prefetch: the images, augmentations and order of
    :func:`tfu.dataset`, which the TensorFlow notebooks train on, pass after pass (one image a batch: the page's chain
    repeats before it batches, so its batches run on across passes). Each chain from the cell run anew: every
    iteration of one shuffled dataset shuffles anew."""
    splits = chestxray.load(standin, seed=0)
    passes = 2 * len(splits["train"])
    expected = list(tfu.dataset(splits["train"], 16, 1, training=True, seed=5).repeat().take(passes))
    for threads, prefetch in ((None, True), (1, True), (2, False)):
        fed = page("items, read_and_augment = ", tfu=tfu, tf=tf, splits=splits, size=16, SEED=5, batch=1)["fed"]
        chain = fed(threads, prefetch)
        assert ("Prefetch" in type(chain).__name__) == prefetch
        for (images, labels), (want_images, want_labels) in zip(chain.take(passes), expected, strict=True):
            np.testing.assert_array_equal(images, want_images)
            np.testing.assert_array_equal(labels, want_labels)
    row = ks.measure("input pipeline", "1 map threads", densenet()(), fed(1), 1, steps=2, threads=1)
    assert row.images_per_second > 0 and row.extra == {"threads": 1}


def test_xla_is_measured_on_a_gpu_and_on_request():
    assert ks.xla_default(None, "gpu") == (True, None)
    measured, why = ks.xla_default(None, "cpu")
    assert not measured and "XLA=True" in why
    assert ks.xla_default(True, "cpu") == (True, None)


def test_the_profile_names_the_ops_and_writes_a_chrome_trace(tmp_path):
    model, data = densenet()(), ks.in_ram(4, 16)
    model.fit(data, steps_per_epoch=2, epochs=1, verbose=0, shuffle=False)
    logdir = ks.profile_dir(tmp_path)
    with ks.quiet_logs(), tf.profiler.experimental.Profile(str(logdir)):
        model.fit(data, steps_per_epoch=2, epochs=1, verbose=0, shuffle=False)
    top, trace = ks.read_profile(logdir, steps=2)
    assert any("Conv2D" in name for name in top.index) and 0 < top["share"].sum() <= 1.0001
    assert not any("__inference" in name or "PartitionedCall" in name for name in top.index), "ops, not functions"
    assert top.columns[0] == "host ms per step" and (top["host ms per step"] > 0).all()
    assert list(tmp_path.rglob("*.xplane.pb")), "the profile itself, for TensorBoard's profile plugin"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event["ph"] == "X" and "Conv2D" in event["name"] for event in events)
