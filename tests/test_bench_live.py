"""common.measure.bench_live: what the live device view costs the training it watches, as a table."""

import pandas as pd
import pytest

from common.measure import bench_live


def test_the_live_views_cost_is_its_speed_against_each_other_way():
    rates = pd.DataFrame({"no monitor": [100.0, 90.0, 110.0], "monitor": [99.0, 95.0, 98.0],
                          "monitor with live view": [96.0, 97.0, 95.0]})  # fmt: skip
    table = bench_live.summary(rates)
    assert table["images/s (median)"].tolist() == [100.0, 98.0, 96.0]
    assert table.loc["no monitor", "live view's cost"] == pytest.approx(0.04)
    assert table.loc["monitor", "live view's cost"] == pytest.approx(1 - 96 / 98)
    assert pd.isna(table.loc["monitor with live view", "live view's cost"])
