"""common.teach.pictures: the GPipe schedule drawn from the stages' measured times, the ring all-reduce."""

import matplotlib
import pytest

from common.teach import pictures

matplotlib.use("Agg")


@pytest.mark.parametrize("micro_batches", [1, 2, 4, 8])
def test_equal_stages_idle_the_textbook_share_of_a_step(micro_batches):
    """With equal stages and free sends, GPipe's bubble is (p-1)/(m+p-1) on every stage."""
    for stages in (2, 4):
        schedule = pictures.gpipe_schedule([1.0] * stages, [2.0] * stages, micro_batches)
        assert len(schedule) == 2 * stages * micro_batches
        textbook = (stages - 1) / (micro_batches + stages - 1)
        assert pictures.bubbles(schedule).to_numpy() == pytest.approx([textbook] * stages)


def test_each_pass_waits_for_its_input_and_its_device():
    schedule = pictures.gpipe_schedule([0.3, 0.1], [0.6, 0.2], 3).set_index(["stage", "part", "micro_batch"])
    for micro in range(3):
        assert schedule.loc[(1, "forward", micro), "start"] >= schedule.loc[(0, "forward", micro), "end"]
        assert schedule.loc[(0, "backward", micro), "start"] >= schedule.loc[(1, "backward", micro), "end"]
    for stage in (0, 1):  # a device does one thing at a time, every backward after its last forward
        own = schedule.loc[stage].sort_values("start")
        assert (own["start"].to_numpy()[1:] >= own["end"].to_numpy()[:-1] - 1e-12).all()
        assert own.loc["backward", "start"].min() >= own.loc["forward", "end"].max()
    # the slower stage 0 sets the pace: the faster stage 1 idles most of the step
    idle = pictures.bubbles(schedule.reset_index())
    assert idle[1] > 0.6 > idle[0]


def test_the_timelines_draw_a_panel_per_micro_batch_count_with_the_measured_step():
    figure = pictures.gpipe_timelines([0.02, 0.01], [0.04, 0.02], (1, 4), measured_seconds={4: 0.08})
    titles = [axis.get_title(loc="left") for axis in figure.axes]
    assert titles[0].startswith("m=1: 90 ms drawn, the stages idle 33% / 67%") and "measured" not in titles[0]
    assert titles[1].endswith("measured step 80 ms")


@pytest.mark.parametrize("devices", [2, 3, 4, 8])
def test_a_ring_all_reduce_sums_every_chunk_everywhere_sending_one_chunk_per_device_and_step(devices):
    steps = pictures.ring_steps(devices)
    assert len(steps) == 1 + 2 * (devices - 1)
    for (_, before, _), (_, held, received) in zip(steps, steps[1:]):
        assert sorted(to for to, _ in received) == list(range(devices)), "every device receives one chunk a step"
        assert (held >= before).all() and (held > before).sum() == devices, "each received chunk sums more devices"
    _, scattered, _ = steps[devices - 1]
    assert ((scattered == devices).sum(axis=1) == 1).all(), "after the reduce-scatter each holds one chunk summed"
    assert (steps[-1][1] == devices).all(), "after the all-gather every device holds every chunk summed over all"


def test_the_ring_picture_says_what_each_device_sends():
    figure = pictures.ring_allreduce(28_000_000, devices=4)
    assert len(figure.axes) == 7
    assert "one chunk of 7.00 MB" in figure._suptitle.get_text() and "sends 42.00 MB" in figure._suptitle.get_text()


def test_dataparallel_moves_the_weights_and_the_batch_beside_the_gradients_ddp_only_the_gradients():
    moved = pictures.traffic(weights=100, gradients=80, image=10, output=1, batch_per_device=4, devices=4)
    assert moved["DataParallel"] == {
        "weights copied from device 0": 300,
        "batch scattered from device 0": 120,
        "outputs gathered on device 0": 12,
        "gradients summed into device 0": 240,
    }
    assert moved["DDP"] == {"gradients all-reduced": 480} and moved["batch"] == 16  # each device 2 (N-1)/N x 80
    figure = pictures.data_parallel_traffic(100, 80, 10, 1, batch_per_device=4, devices=(2, 4))
    assert [axis.get_title() for axis in figure.axes] == ["2 devices, batch 8", "4 devices, batch 16"]
