"""Per-finding and mean ROC AUC, the score every notebook reports."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score

from common.params import FINDINGS


@dataclass(frozen=True)
class AUC:
    per_class: dict[str, float | None]  # None: undefined (one label value only)
    mean: float  # over the defined classes

    @property
    def undefined(self) -> list[str]:
        return [name for name, value in self.per_class.items() if value is None]


def roc_auc(y_true, y_score, class_names=FINDINGS) -> AUC:
    """ROC AUC of each class and their mean.

    A class whose test labels are all 0 (or all 1) has no AUC: it is reported
    as ``None``, left out of the mean, and named in a warning instead of
    crashing the run at its very end.
    """
    y_true, y_score = np.asarray(y_true), np.asarray(y_score)
    if y_true.shape != y_score.shape or y_true.ndim != 2 or y_true.shape[1] != len(class_names):
        raise ValueError(f"labels {y_true.shape} and scores {y_score.shape} must both be (images, {len(class_names)})")
    per_class = {}
    for column, name in enumerate(class_names):
        truth = y_true[:, column]
        if np.unique(truth).size < 2:
            per_class[name] = None
        else:
            per_class[name] = float(roc_auc_score(truth, y_score[:, column]))
    defined = [value for value in per_class.values() if value is not None]
    undefined = [name for name, value in per_class.items() if value is None]
    if undefined:
        warnings.warn(
            f"ROC AUC undefined for {', '.join(undefined)}: the test labels hold one value only; "
            f"left out of the mean of the other {len(defined)} classes.",
            stacklevel=2,
        )
    return AUC(per_class, float(np.mean(defined)) if defined else math.nan)


def auc_table(auc: AUC, name: str = "test AUC") -> pd.DataFrame:
    """The AUC of each finding as one row, rounded for reading (undefined findings empty)."""
    return pd.Series(auc.per_class, name=name, dtype=float).to_frame().T.round(3)


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
