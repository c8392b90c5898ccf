"""common.measure.bench_loader: one table of every framework's input pipeline, from the prepared copy and from PNGs,
each timed in its own environment."""

import pytest

from common.measure import bench_loader


@pytest.mark.environments("pytorch", "tensorflow", "mxnet-chainer")
def test_the_table_gives_a_rate_for_every_framework_and_path(tmp_path, capsys):
    args = ["--images", "8", "--size", "64", "--crop", "32", "--batch", "4", "--repeats", "1", "--root", str(tmp_path)]
    figures = bench_loader.main(args)
    printed = capsys.readouterr().out
    assert figures["pil_decode"] > 0 and figures["decode_and_shrink"] > 0
    assert figures["prepare"]["rate"] > 0 and figures["prepare"]["cpu_rate"] > 0
    assert set(figures["pipelines"]) == set(bench_loader.PIPELINES)
    for name, rates in figures["pipelines"].items():
        assert set(rates) == {"prepared", "png"} and min(rates.values()) > 0, name
        assert f"\n{name} " in printed, f"{name} has no row in the table"
    assert "PIL decode bound:" in printed and "prepare, " in printed
