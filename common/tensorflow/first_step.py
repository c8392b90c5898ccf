"""What the TensorFlow notebooks' first training step costs: Keras' Adam against :class:`tfu.Adam`, with and without
Grappler's graph passes (which :func:`tfu.configure_devices` turns off on CPU devices).

    python -m common.tensorflow.first_step [--devices 1 2] [--size 64] [--batch 16] [--readme README.md]

The first call of the notebook's ``distributed_train_step`` traces it into a graph (Python, ``trace``), then
TensorFlow optimizes the graph and runs it once (``first run``); later steps reuse the graph (``step``). Each row runs
in a process of its own, as TensorFlow fixes its devices once per process, on simulated CPU devices with the CPU
defaults' image size and batch per device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pandas as pd

from common.measure import report

README_START, README_END = "<!-- first-step:start -->", "<!-- first-step:end -->"
# name: (optimizer, Grappler's passes on, the row's label)
VARIANTS = {
    "keras": ("keras", True, "keras.optimizers.Adam, Grappler on"),
    "fused-grappler": ("fused", True, "tfu.Adam, Grappler on"),
    "fused": ("fused", False, "tfu.Adam, Grappler off (the notebooks' CPU setting)"),
}


def measure_one(devices: int, size: int, batch: int, variant: str, steps: int = 20) -> dict[str, float]:
    """Seconds to trace, to run the first time and per later step, in this process (which it configures)."""
    import numpy as np

    from common.keras import model as km
    from common.run import devices as common_devices
    from common.run import params
    from common.tensorflow import utils as tfu
    from common.tensorflow.imports import keras, tf

    hardware = common_devices.resolve(devices)
    optimizer, grappler, _ = VARIANTS[variant]
    strategy = tfu.make_strategy("mirrored", tfu.configure_devices(hardware), hardware.kind)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": not grappler})
    global_batch = batch * strategy.num_replicas_in_sync
    schedule = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=100)
    with strategy.scope():
        model = km.build_densenet121(size)
        optimizer = tfu.Adam(schedule) if optimizer == "fused" else keras.optimizers.Adam(schedule)
        optimizer.build(model.trainable_variables)

    def train_step(images, labels):  # the notebook's
        with tf.GradientTape() as tape:
            loss = tfu.replica_loss(labels, model(images, training=True), global_batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(batch):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(train_step, args=batch), axis=None)

    images = np.random.default_rng(0).integers(0, 256, (global_batch, size, size, 1), dtype=np.uint8)
    labels = np.zeros((global_batch, params.NUM_CLASSES), np.float32)
    data = tf.data.Dataset.from_tensors((images, labels)).repeat()
    batches = iter(strategy.experimental_distribute_dataset(data))
    first = next(batches)
    started = time.perf_counter()
    distributed_train_step.get_concrete_function(first)
    traced = time.perf_counter()
    float(distributed_train_step(first))
    ran = time.perf_counter()
    for _ in range(steps):
        loss = distributed_train_step(next(batches))
    float(loss)
    return {"trace": traced - started, "first run": ran - traced, "step": (time.perf_counter() - ran) / steps}


def measure(device_counts: list[int], size: int, batch: int) -> pd.DataFrame:
    rows = {}
    for devices in device_counts:
        for variant, (_, _, name) in VARIANTS.items():
            command = [sys.executable, "-m", "common.tensorflow.first_step", "--one", variant]
            command += ["--devices", str(devices), "--size", str(size), "--batch", str(batch)]
            out = subprocess.run(command, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
            seconds = json.loads(out.stdout.strip().splitlines()[-1])
            rows[f"{devices} device{'s' * (devices > 1)}, {name}"] = {
                "trace s": seconds["trace"],
                "first run s": seconds["first run"],
                "first step s": seconds["trace"] + seconds["first run"],
                "step ms": 1000 * seconds["step"],  # Grappler's passes change it by tens of ms: 0.1 s would hide it
            }
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("run")


def main(argv=None) -> pd.DataFrame | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="images per device")
    parser.add_argument("--readme", help="also write the table into this file's first-step block (README.md)")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # a row, in a process of its own
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.devices[0], args.size, args.batch, args.one)))
        return None
    table = measure(args.devices, args.size, args.batch)
    text = report.markdown(table)
    print(text)
    if args.readme:
        details = f"DenseNet-121, {args.size} px, {args.batch} images per simulated CPU device, MirroredStrategy"
        note = report.produced_by("bench-first-step", details)
        report.replace_block(args.readme, README_START, README_END, f"{note}\n\n{text}")
    return table


if __name__ == "__main__":
    main()
