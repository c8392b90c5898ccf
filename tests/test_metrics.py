import math
import warnings

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from common.measure import metrics
from common.run.params import FINDINGS


@pytest.fixture
def random_labels_and_scores():
    rng = np.random.default_rng(0)
    y_true = (rng.random((300, len(FINDINGS))) < 0.3).astype(np.float32)
    y_score = y_true * 0.3 + rng.random(y_true.shape)  # informative but imperfect
    return y_true, y_score


def test_roc_auc_matches_sklearn_per_class_and_mean(random_labels_and_scores):
    y_true, y_score = random_labels_and_scores
    auc = metrics.roc_auc(y_true, y_score)
    expected = [roc_auc_score(y_true[:, k], y_score[:, k]) for k in range(len(FINDINGS))]
    assert list(auc.per_class) == list(FINDINGS)
    assert list(auc.per_class.values()) == pytest.approx(expected)
    assert auc.mean == pytest.approx(np.mean(expected))
    assert auc.mean == pytest.approx(roc_auc_score(y_true, y_score, average="macro"))
    assert 0.6 < auc.mean < 0.95
    assert auc.undefined == []


def test_single_valued_class_is_none_left_out_of_mean_and_named_without_a_warning(random_labels_and_scores):
    y_true, y_score = random_labels_and_scores
    y_true[:, FINDINGS.index("Hernia")] = 0  # no positive
    y_true[:, FINDINGS.index("Edema")] = 1  # no negative
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning at every evaluation would be red noise in a notebook
        auc = metrics.roc_auc(y_true, y_score)
    assert auc.per_class["Hernia"] is None
    assert auc.per_class["Edema"] is None
    assert auc.undefined == ["Edema", "Hernia"]
    assert auc.why_undefined == {"Edema": "no negative image", "Hernia": "no positive image"}
    defined = [
        roc_auc_score(y_true[:, k], y_score[:, k]) for k, name in enumerate(FINDINGS) if name not in ("Edema", "Hernia")
    ]
    assert auc.mean == pytest.approx(np.mean(defined))


def test_all_classes_undefined_gives_nan_mean():
    auc = metrics.roc_auc(np.zeros((4, 2)), np.ones((4, 2)), class_names=("a", "b"))
    assert math.isnan(auc.mean)


def test_auc_table_is_one_row_per_finding_then_the_mean_rounded(random_labels_and_scores):
    auc = metrics.roc_auc(*random_labels_and_scores)
    table = metrics.auc_table(auc, name="valid AUC")
    assert list(table.index) == [*FINDINGS, "mean"]
    assert list(table.columns) == ["valid AUC"], "no note column when every finding has an AUC"
    assert table.loc["Mass", "valid AUC"] == round(auc.per_class["Mass"], 3)
    assert table.loc["mean", "valid AUC"] == round(auc.mean, 3)
    assert max(len(line) for line in table.to_string().splitlines()) < 40, "narrow: no wrapping, no scrolling"


def test_auc_table_says_which_findings_are_undefined_and_what_the_mean_covers(random_labels_and_scores):
    y_true, y_score = random_labels_and_scores
    y_true[:, FINDINGS.index("Hernia")] = 0
    table = metrics.auc_table(metrics.roc_auc(y_true, y_score))
    assert math.isnan(table.loc["Hernia", "test AUC"])
    assert table.loc["Hernia", "note"] == "undefined: no positive image"
    assert table.loc["mean", "note"] == "of the 13 defined findings"
    assert table.loc["Mass", "note"] == ""


@pytest.mark.parametrize(
    "y_true_shape, y_score_shape",
    [((10, 14), (10, 13)), ((10, 14), (9, 14)), ((10, 13), (10, 13)), ((14,), (14,))],
)
def test_shape_mismatch_raises_value_error(y_true_shape, y_score_shape):
    with pytest.raises(ValueError, match=r"must both be \(images, 14\)"):
        metrics.roc_auc(np.zeros(y_true_shape), np.zeros(y_score_shape))


def test_images_per_second_skips_the_first_epoch():
    assert metrics.images_per_second(1000, [30.0, 10.0, 10.0]) == pytest.approx(100.0)
    assert metrics.images_per_second(1000, [30.0, 8.0, 12.0]) == pytest.approx(100.0)


def test_images_per_second_uses_a_single_epoch_when_there_is_only_one():
    assert metrics.images_per_second(1000, [20.0]) == pytest.approx(50.0)
    assert metrics.images_per_second(1000, np.array([20.0])) == pytest.approx(50.0)


def test_images_per_second_accepts_a_generator_of_several_epochs():
    assert metrics.images_per_second(1000, (s for s in [30.0, 10.0])) == pytest.approx(100.0)


def test_images_per_second_accepts_a_generator_of_one_epoch():
    assert metrics.images_per_second(1000, (s for s in [20.0])) == pytest.approx(50.0)


def test_memory_imbalance_is_device_0_over_the_mean_of_the_others():
    assert metrics.memory_imbalance({"cuda:0": 300.0, "cuda:1": 100.0, "cuda:2": 200.0}) == pytest.approx(2.0)
    assert metrics.memory_imbalance({"cuda:0": 100.0, "cuda:1": 100.0}) == pytest.approx(1.0)


def test_memory_imbalance_needs_two_devices_with_memory():
    assert metrics.memory_imbalance({}) is None
    assert metrics.memory_imbalance({"cuda:0": 100.0}) is None
    assert metrics.memory_imbalance({"cuda:0": 100.0, "cuda:1": 0.0}) is None
