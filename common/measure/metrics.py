"""Per-finding and mean ROC AUC, the score every notebook reports."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score

from common.run.params import FINDINGS


@dataclass(frozen=True)
class AUC:
    per_class: dict[str, float | None]  # None: undefined (one label value only)
    mean: float  # over the defined classes
    why_undefined: dict[str, str] = field(default_factory=dict)  # e.g. "no positive image", for each None above

    @property
    def undefined(self) -> list[str]:
        return [name for name, value in self.per_class.items() if value is None]


def roc_auc(y_true, y_score, class_names=FINDINGS) -> AUC:
    """ROC AUC of each class and their mean.

    A class whose labels are all 0 (or all 1) has no AUC: it is ``None``, left out of the mean, and
    :func:`auc_table` says so. Not a warning: a small split lacks some findings at every evaluation, and the reader
    needs it once, next to the numbers it changes, not in red after each epoch.
    """
    y_true, y_score = np.asarray(y_true), np.asarray(y_score)
    if y_true.shape != y_score.shape or y_true.ndim != 2 or y_true.shape[1] != len(class_names):
        raise ValueError(f"labels {y_true.shape} and scores {y_score.shape} must both be (images, {len(class_names)})")
    per_class, why = {}, {}
    for column, name in enumerate(class_names):
        truth = y_true[:, column]
        if np.unique(truth).size < 2:
            per_class[name] = None
            why[name] = "no negative image" if truth.any() else "no positive image"
        else:
            per_class[name] = float(roc_auc_score(truth, y_score[:, column]))
    defined = [value for value in per_class.values() if value is not None]
    return AUC(per_class, float(np.mean(defined)) if defined else math.nan, why)


def auc_table(auc: AUC, name: str = "test AUC") -> pd.DataFrame:
    """The AUC of each finding, one per row, then their mean, rounded for reading.

    One row per finding keeps the table narrow enough to read without scrolling. With undefined findings a ``note``
    column says why each is undefined (NaN) and over how many findings the mean is taken.
    """
    table = pd.Series(auc.per_class, dtype=float).to_frame(name)
    table.loc["mean"] = auc.mean
    if auc.undefined:
        table["note"] = ""
        for finding in auc.undefined:
            table.loc[finding, "note"] = "undefined: " + auc.why_undefined.get(finding, "one label value only")
        table.loc["mean", "note"] = f"of the {len(auc.per_class) - len(auc.undefined)} defined findings"
    return table.round(3)


def images_per_second(images_per_epoch: int, epoch_seconds) -> float:
    """Training throughput, leaving out the first epoch when there are more (start-up, warm-up)."""
    seconds = list(epoch_seconds)
    timed = seconds[1:] or seconds
    return images_per_epoch / float(np.mean(timed))


def memory_imbalance(peak_mib: dict[str, float]) -> float | None:
    """Device 0's peak memory over the mean of the other devices' (1.0 is balanced); None for fewer than 2 devices.

    ``peak_mib`` maps device names to MiB in device order, device 0 first.
    """
    peaks = list(peak_mib.values())
    if len(peaks) < 2:
        return None
    others = float(np.mean(peaks[1:]))
    return peaks[0] / others if others else None
