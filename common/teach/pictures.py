"""Pictures a learner would rather look at than read, drawn from what the run measured.

:func:`gpipe_schedule` lays out one pipeline step as ``torch.distributed.pipelining.ScheduleGPipe`` runs it, from each
stage's measured forward and backward times; :func:`gpipe_timelines` draws it for several micro-batch counts, the
idle time (the bubble) left blank. :func:`ring_allreduce` draws the chunks of a measured gradient going round a ring;
:func:`data_parallel_traffic` what DataParallel and DDP move between devices in one step.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

COLOURS = {"forward": "C0", "backward": "C1"}


def gpipe_schedule(forward, backward, micro_batches: int) -> pd.DataFrame:
    """One GPipe step: a row per stage, part ("forward" or "backward") and micro-batch, with its start and end.

    ``forward`` and ``backward`` are each stage's seconds for the whole batch, shared evenly among ``micro_batches``
    (a GPU runs a small micro-batch less efficiently than that). As in ``ScheduleGPipe``, every stage runs the
    forward of micro-batches 0 to m-1, then their backward in the same order; a forward waits for the previous
    stage's forward of its micro-batch, a backward for the next stage's backward. Sending costs nothing here: what
    the measured step takes beyond this schedule is communication and the optimizer's step.
    """
    stages = len(forward)
    free = [0.0] * stages  # when each stage's device is next free
    rows = []
    for part, seconds, order in (("forward", forward, range(stages)), ("backward", backward, reversed(range(stages)))):
        ready = [0.0] * micro_batches  # when micro-batch i's input for the next stage in ``order`` is there
        for stage in order:
            for micro in range(micro_batches):
                start = max(free[stage], ready[micro])
                free[stage] = ready[micro] = start + seconds[stage] / micro_batches
                rows.append((stage, part, micro, start, free[stage]))
    return pd.DataFrame(rows, columns=["stage", "part", "micro_batch", "start", "end"])


def bubbles(schedule: pd.DataFrame) -> pd.Series:
    """Each stage's idle share of the step drawn by ``schedule``: 1 - its busy time / the step's time."""
    busy = (schedule["end"] - schedule["start"]).groupby(schedule["stage"]).sum()
    return 1 - busy / schedule["end"].max()


def gpipe_timelines(forward, backward, micro_batches, measured_seconds: dict | None = None):
    """The GPipe step for each of ``micro_batches``, one panel each on one time axis: a row per stage (device), its
    forward (F) and backward (B) of each micro-batch, blank where it idles. ``measured_seconds`` (micro-batches to
    seconds per step) puts the benchmark's step beside each drawn one. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = len(forward)
    figure, axes = plt.subplots(
        len(micro_batches), 1, sharex=True, figsize=(9, 0.5 + 0.55 * stages * len(micro_batches)), squeeze=False
    )
    for axis, m in zip(axes[:, 0], micro_batches):
        schedule = gpipe_schedule(forward, backward, m)
        for row in schedule.itertuples():
            width = (row.end - row.start) * 1000
            axis.broken_barh(
                [(row.start * 1000, width)], (row.stage - 0.4, 0.8), facecolor=COLOURS[row.part], edgecolor="white"
            )
            if m <= 4:  # more would not fit their labels
                axis.text(row.start * 1000 + width / 2, row.stage, f"{row.part[0].upper()}{row.micro_batch}",
                          ha="center", va="center", fontsize="x-small", color="white")  # fmt: skip
        idle = " / ".join(f"{share:.0%}" for share in bubbles(schedule))
        drawn = schedule["end"].max() * 1000
        label = f"m={m}: {drawn:.0f} ms drawn, the stages idle {idle}"
        if measured_seconds and m in measured_seconds:
            label += f"; measured step {measured_seconds[m] * 1000:.0f} ms"
        axis.set_title(label, fontsize="small", loc="left")
        axis.set(yticks=range(stages), yticklabels=[f"stage {s}" for s in range(stages)], ylim=(stages - 0.5, -0.5))
    axes[-1, 0].set_xlabel("time in one training step (ms)")
    figure.legend(
        handles=[Patch(color=colour, label=f"{kind} of a micro-batch") for kind, colour in COLOURS.items()],
        loc="upper right",
        fontsize="small",
    )
    figure.suptitle("GPipe schedule from the stages' measured times (blank: the bubble)", x=0.01, ha="left")
    figure.tight_layout()
    return figure


def ring_steps(devices: int) -> list[tuple[str, np.ndarray, list[tuple[int, int]]]]:
    """The ring all-reduce of a gradient cut into ``devices`` chunks: ``(title, held, received)`` for the start and
    after each step, where ``held[d, c]`` counts the devices whose share of chunk ``c`` device ``d`` has summed and
    ``received`` lists the ``(device, chunk)`` that just arrived.

    In each of the ``devices - 1`` steps of the reduce-scatter every device sends one chunk to the next device, which
    adds it to its own; then each device holds one chunk summed over all. In each step of the all-gather every device
    passes a summed chunk on, until all hold all."""
    held = np.ones((devices, devices), int)
    pictures = [("start", held.copy(), [])]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(devices - 1):
            # device d sends the chunk it has just completed: (d - step) while summing, then (d + 1 - step)
            sent = [(d, (d - step + (phase == "all-gather")) % devices) for d in range(devices)]
            before, received = held.copy(), []
            for device, chunk in sent:
                to = (device + 1) % devices
                summed = before[device, chunk] + (before[to, chunk] if phase == "reduce-scatter" else 0)
                held[to, chunk] = summed
                received.append((to, chunk))
            pictures.append((f"{phase}\nstep {step + 1}", held.copy(), received))
    return pictures


def ring_allreduce(gradient_bytes: int, devices: int = 4):
    """:func:`ring_steps` drawn: a panel per step, a row per device, a column per chunk of ``gradient_bytes``, each
    cell shaded by how many devices' gradients it sums, the chunks just received outlined. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    steps = ring_steps(devices)
    figure, axes = plt.subplots(1, len(steps), figsize=(1.5 * len(steps), 2.2 + 0.2 * devices))
    for axis, (title, held, received) in zip(axes, steps):
        axis.imshow(held, cmap="Blues", vmin=0, vmax=devices * 1.3)
        for (device, chunk), count in np.ndenumerate(held):
            colour = "white" if count > devices / 2 else "black"
            axis.text(chunk, device, count, ha="center", va="center", fontsize="small", color=colour)
        for device, chunk in received:
            axis.add_patch(Rectangle((chunk - 0.5, device - 0.5), 1, 1, fill=False, edgecolor="C3", linewidth=2))
        axis.set_title(title, fontsize="small")
        axis.set(xticks=range(devices), yticks=range(devices), xlabel="chunk")
        axis.set_yticklabels([f"device {d}" for d in range(devices)] if axis is axes[0] else [])
    chunk_mb, total_mb = gradient_bytes / devices / 1e6, 2 * (devices - 1) / devices * gradient_bytes / 1e6
    figure.suptitle(
        f"Ring all-reduce of {gradient_bytes / 1e6:.2f} MB of gradients over {devices} devices: in each of "
        f"{2 * (devices - 1)} steps every device sends one chunk of {chunk_mb:.2f} MB to the next (outlined where it "
        f"arrives);\nthe numbers count the devices' gradients summed in each chunk. Each device sends "
        f"{total_mb:.2f} MB per all-reduce, 2(N-1)/N of the gradient, however many devices there are.",
        fontsize="small",
        x=0.01,
        ha="left",
    )
    figure.tight_layout()
    return figure


def traffic(weights: int, gradients: int, image: int, output: int, batch_per_device: int, devices: int) -> dict:
    """Bytes that reach another device in one training step, by what they are, for ``nn.DataParallel`` and for DDP
    (sizes from :func:`common.pytorch.utils.transfer_bytes`).

    DataParallel is one process: each step it copies the weights from device 0 to every other device, scatters the
    batch (already the model's float input) from device 0, gathers the outputs there, and sums the gradients into
    device 0's model. DDP keeps a model per process, each process loads its own share of the batch, and only the
    gradients are exchanged, by an all-reduce (as a ring: every device receives 2(N-1)/N of them).
    """
    others = devices - 1
    batch = batch_per_device * devices
    return {
        "DataParallel": {
            "weights copied from device 0": others * weights,
            "batch scattered from device 0": others * batch_per_device * image,
            "outputs gathered on device 0": others * batch_per_device * output,
            "gradients summed into device 0": others * gradients,
        },
        "DDP": {"gradients all-reduced": 2 * others * gradients},
        "batch": batch,
    }


def data_parallel_traffic(
    weights: int, gradients: int, image: int, output: int, batch_per_device: int, devices=(2, 4, 8)
):
    """:func:`traffic` for each count of ``devices``: a stacked bar per way, in MB per step. Returns the figure."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(devices), figsize=(3.2 * len(devices), 3.2), sharey=True, squeeze=False)
    kinds = {}
    for axis, count in zip(axes[0], devices):
        moved = traffic(weights, gradients, image, output, batch_per_device, count)
        for position, way in enumerate(("DataParallel", "DDP")):
            bottom = 0.0
            for kind, size in moved[way].items():
                colour = kinds.setdefault(kind, f"C{len(kinds)}")
                axis.bar(position, size / 1e6, bottom=bottom, color=colour, label=kind)
                bottom += size / 1e6
            axis.text(position, bottom, f"{bottom:,.0f}", ha="center", va="bottom", fontsize="small")
        axis.set(xticks=[0, 1], xticklabels=["DataParallel", "DDP"], title=f"{count} devices, batch {moved['batch']}")
        axis.margins(y=0.12)  # room for the totals above the bars
    axes[0, 0].set_ylabel("MB reaching another device per step")
    handles = {handle.get_label(): handle for axis in axes[0] for handle in axis.containers}
    figure.legend(handles.values(), handles.keys(), loc="lower center", ncol=3, fontsize="small")
    figure.tight_layout(rect=(0, 0.14, 1, 1))
    return figure
