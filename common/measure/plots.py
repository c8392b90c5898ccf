"""The figures every notebook and the report draw the same way: training curves, phases, device utilization.

Every plot has a title, axis labels with units, and its legend outside the lines it explains.
"""

from __future__ import annotations

import math

import pandas as pd

from common.measure import phases as run_phases

# One colour per phase, the same in every figure.
PHASE_COLOURS = dict(
    zip([*run_phases.ORDER, run_phases.BETWEEN], [f"C{i}" for i in range(10)] + ["k", "y", "m", "c", "0.8"])
)


def training_curves(history: dict, title: str = ""):
    """Train loss and validation mean AUC per epoch, side by side; returns the figure."""
    import matplotlib.pyplot as plt

    epochs = range(1, len(history["train_loss"]) + 1)
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3))
    left.plot(epochs, history["train_loss"], marker="o")
    left.set(xlabel="epoch", ylabel="train loss (BCE)", title="Training loss", xticks=list(epochs))
    if history.get("valid_auc"):
        right.plot(epochs, history["valid_auc"], marker="o")
    right.set(xlabel="epoch", ylabel="mean ROC AUC", title="Validation AUC", xticks=list(epochs))
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def utilization(frame: pd.DataFrame, title: str = "", phases: list[dict] | None = None, started: float | None = None):
    """Utilization (top) and memory (bottom) of each device over time, the run's phases shaded behind them.

    ``frame``: :class:`common.measure.monitor.Monitor` samples; ``phases``: :meth:`common.measure.phases.Phases.rows`;
    ``started``: the monitor's start (Unix seconds), which puts both on one time axis.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 4.5))
    for device, group in frame.groupby("device"):
        top.plot(group["seconds"], group["utilization_percent"], label=device)
        bottom.plot(group["seconds"], group["memory_mib"], label=device)
    shown = []
    if phases and started is not None:
        # the run's phases begin before the monitor (start-up, data check) and may go on after it: only the
        # monitored time has lines to explain
        monitored = frame["seconds"].max() if not frame.empty else math.inf
        for row in phases:
            begin = max(row["start"] - started, 0.0)
            end = min(row["start"] - started + row["seconds"], monitored)
            if end <= begin:
                continue
            for axis in (top, bottom):
                axis.axvspan(begin, end, color=PHASE_COLOURS[row["phase"]], alpha=0.15, lw=0)
            if row["phase"] not in shown:
                shown.append(row["phase"])
    top.set_xlim(left=0)  # not the autoscale margin before the first sample
    top.set(ylabel="utilization %", ylim=(0, 105), title=title or "Device utilization and memory")
    bottom.set(ylabel="memory MiB", xlabel="seconds since the monitor started")
    handles, _ = top.get_legend_handles_labels()
    handles += [Patch(color=PHASE_COLOURS[name], alpha=0.3, label=name) for name in shown]
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", frameon=False)
    figure.tight_layout()
    return figure
