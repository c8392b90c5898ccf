"""common.pytorch.sharded: DDP, ZeRO-2, ZeRO-3 (FSDP2) and tensor parallelism train the same model, and hold, send
and compute what the formulas say (2 gloo processes, and 1)."""

import math

import gloo_ranks
import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from common.errors import InputError
from common.pytorch import sharded
from common.pytorch import utils as tu

EVEN = sharded.MLPShape(in_features=24, width=32, depth=4)  # every strategy, tp included
ODD = sharded.MLPShape(in_features=24, width=33, depth=4)  # FSDP2 pads 33 rows to 2 x 17 at N=2
GLOBAL_BATCH = 8
CHECK_STEPS = 3
STRATEGIES = sharded.STRATEGIES


def rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    gloo_ranks.join(rank, world_size, port)
    found = {"measured": {}, "sgd": {}}
    for strategy in STRATEGIES:
        found["measured"][strategy] = sharded.measure(strategy, EVEN, global_batch=GLOBAL_BATCH, timed_steps=1)
        found["sgd"][strategy] = sharded.losses(strategy, CHECK_STEPS, EVEN, global_batch=GLOBAL_BATCH)
    if world_size > 1:
        for strategy in ("ddp", "zero2", "zero3"):
            found["measured"][f"{strategy}-odd"] = sharded.measure(
                strategy, ODD, global_batch=GLOBAL_BATCH, timed_steps=1
            )
        # the control: a gradient twice too large (as if summed over the 2 processes instead of averaged)
        found["sgd"]["ddp-double-gradient"] = sharded.losses(
            "ddp", CHECK_STEPS, EVEN, global_batch=GLOBAL_BATCH, learning_rate=2 * sharded.CHECK_LEARNING_RATE
        )
    torch.save(found, f"{out}.rank{rank}")
    tu.finish_distributed()


def run(tmp_path_factory, world_size: int) -> list[dict]:
    out = str(tmp_path_factory.mktemp(f"sharded{world_size}") / "found")
    mp.spawn(rank_main, args=(world_size, gloo_ranks.free_port(), out), nprocs=world_size, join=True)
    return [torch.load(f"{out}.rank{rank}") for rank in range(world_size)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return run(tmp_path_factory, 1)[0]


# ---- without processes ----


def test_parameter_count_is_the_built_models():
    for shape in (EVEN, ODD, sharded.MLPShape(1024, 4096, 6)):
        if shape.width > 100:  # the count alone, without allocating the big one
            assert shape.parameters == 1024 * 4096 + 4096 + 4 * (4096 * 4096 + 4096) + 4096 * 14 + 14
            continue
        model = shape.build(seed=0)
        assert sum(p.numel() for p in model.parameters()) == shape.parameters
        assert [tuple(p.shape) for p in model.parameters()] == shape.parameter_shapes
        assert model(torch.zeros(2, shape.in_features)).shape == (2, 14)


def test_shape_and_tensor_parallel_width_are_checked():
    with pytest.raises(InputError, match="even number of Linear layers"):
        sharded.MLPShape(24, 32, depth=3)
    with pytest.raises(InputError, match="divisible by 2"):
        sharded.check_tensor_parallel(ODD, 2)
    sharded.check_tensor_parallel(ODD, 1)  # one process splits nothing: any width
    with pytest.raises(InputError, match="must divide the number of processes"):
        sharded.make_mesh("tp", 3, "cpu", tensor_parallel=2)
    with pytest.raises(InputError, match="Unknown strategy"):
        sharded.make_mesh("zero4", 2, "cpu")


def test_tp_plan_pairs_column_and_row_wise_layers():
    plan = sharded.tp_plan(EVEN)
    assert list(plan) == ["fc1", "fc2", "fc3", "fc4"]
    assert [type(style) for style in plan.values()] == [ColwiseParallel, RowwiseParallel] * 2
    table = sharded.plan_table(EVEN, 2)
    assert table[0]["weight per rank"] == (16, 24) and table[0]["bias"] == "split"
    assert table[-1]["weight per rank"] == (14, 16) and table[-1]["bias"] == "replicated"


def test_paper_formula():
    psi, n = 1_000_000, 4
    assert sharded.paper_bytes("ddp", psi, n)["total"] == 16 * psi
    assert sharded.paper_bytes("zero2", psi, n)["total"] == 4 * psi + 12 * psi / n
    assert sharded.paper_bytes("zero3", psi, n)["total"] == 16 * psi / n
    assert sharded.paper_bytes("zero2", psi, n, "mixed")["total"] == 2 * psi + 14 * psi / n
    assert sharded.paper_bytes("zero3", psi, n, "mixed")["total"] == 16 * psi / n
    assert sharded.textbook_comm_bytes("zero3", psi, n) == 1.5 * sharded.textbook_comm_bytes("ddp", psi, n)


def test_padding_is_under_one_row_per_parameter():
    assert sharded.padding_bytes(EVEN.parameter_shapes, 2) == 0
    # 33 rows -> 17 + 16: half a row more than Ψ/N per process in each 33-row parameter (fc1, fc2, fc3, biases)
    assert sharded.padding_bytes(ODD.parameter_shapes, 2) == 4 * 0.5 * (24 + 1 + 33 + 1 + 33 + 1)
    for n in (2, 3, 4, 8):
        padding = sharded.padding_bytes(ODD.parameter_shapes, n)
        rows = sum(4 * math.prod(s[1:]) for s in ODD.parameter_shapes)
        assert 0 <= padding < rows  # less than one row of each parameter


def test_largest_width_is_where_a_replica_stops_fitting():
    budget = 64 * 2**20
    ddp = sharded.largest_width(budget, "ddp", 2, in_features=1024, depth=4)
    zero3 = sharded.largest_width(budget, "zero3", 2, in_features=1024, depth=4)
    assert sharded.paper_bytes("ddp", sharded.parameter_count(ddp, 1024), 2)["total"] <= budget
    assert sharded.paper_bytes("ddp", sharded.parameter_count(ddp + 1, 1024), 2)["total"] > budget
    assert zero3 > 1.3 * ddp  # twice the parameters in the same memory: about sqrt(2) times the width


# ---- two gloo processes ----


def test_every_strategy_trains_the_same_model_as_ddp(two):
    for found in two:
        reference = found["sgd"]["ddp"]
        for strategy in STRATEGIES:
            assert sharded.loss_difference(found["sgd"][strategy], reference) <= sharded.LOSS_TOLERANCE, strategy
            adam = [found["measured"][s]["losses"] for s in (strategy, "ddp")]
            assert sharded.loss_difference(*adam) <= sharded.LOSS_TOLERANCE, strategy
        for strategy in ("zero2", "zero3"):
            adam = [found["measured"][f"{s}-odd"]["losses"] for s in (strategy, "ddp")]
            assert sharded.loss_difference(*adam) <= sharded.LOSS_TOLERANCE, strategy
        # the check can fail: a gradient twice too large moves the loss far beyond the tolerance
        assert sharded.loss_difference(found["sgd"]["ddp-double-gradient"], reference) > 100 * sharded.LOSS_TOLERANCE


def test_held_bytes_are_the_formulas(two):
    psi = EVEN.parameters
    for rank, found in enumerate(two):
        ddp = found["measured"]["ddp"]["held_bytes"]
        assert ddp["total"] == sharded.paper_bytes("ddp", psi, 2)["total"] == 16 * psi
        assert ddp["ddp_buckets"] == 4 * psi  # DDP's second copy of the gradients
        tp = found["measured"]["tp"]["held_bytes"]
        assert tp["total"] == sharded.tp_bytes(EVEN.linear_sizes, 2)["total"]
        for strategy in ("zero2", "zero3"):
            for shape, key in ((EVEN, strategy), (ODD, f"{strategy}-odd")):
                held = found["measured"][key]["held_bytes"]
                exact = sharded.fsdp2_bytes(strategy, shape.parameter_shapes, 2, rank=rank)
                paper = sharded.paper_bytes("zero3", shape.parameters, 2)  # at rest FSDP2 holds ZeRO-3's bytes
                padding = sharded.padding_bytes(shape.parameter_shapes, 2)
                for kind in ("parameters", "gradients", "optimizer_state"):
                    assert held[kind] == exact[kind], (key, kind)
                assert 0 <= held["parameters"] - paper["parameters"] == padding
                assert abs(held["optimizer_state"] - paper["optimizer_state"]) <= 2 * padding  # uneven, unpadded
    for key in ("zero2-odd", "zero3-odd"):  # the two ranks' optimizer state together is exactly 8Ψ
        assert sum(found["measured"][key]["held_bytes"]["optimizer_state"] for found in two) == 8 * ODD.parameters


def test_zero2_and_zero3_hold_the_same_shards_between_steps_half_of_ddp(two):
    for found in two:
        measured = found["measured"]
        ddp = measured["ddp"]["held_bytes"]
        zero2, zero3 = (
            {k: v for k, v in measured[s]["held_bytes"].items() if k != "parameters_after_forward"}
            for s in ("zero2", "zero3")
        )
        assert zero2 == zero3
        assert measured["zero3"]["held_bytes"]["parameters"] == ddp["parameters"] / 2
        odd, replica = (measured[key]["held_bytes"]["parameters"] for key in ("zero3-odd", "ddp-odd"))
        assert odd / replica == 0.5 + sharded.padding_bytes(ODD.parameter_shapes, 2) / replica  # half, plus padding
        # between forward and backward ZeRO-2 keeps every layer's gathered parameters, ZeRO-3 only the shards
        assert measured["zero2"]["held_bytes"]["parameters_after_forward"] == ddp["parameters"]
        assert measured["zero3"]["held_bytes"]["parameters_after_forward"] == ddp["parameters"] / 2
        for strategy in STRATEGIES:  # the step's peak holds at least the model state at its start and the gradients
            peak, held = measured[strategy]["step_peak_bytes"], measured[strategy]["held_bytes"]
            assert peak["before"] == held["parameters"] + held["optimizer_state"] + held["ddp_buckets"]
            assert peak["increment"] >= held["gradients"], strategy


def test_collectives_are_the_textbooks(two):
    psi, depth = EVEN.parameters, EVEN.depth
    for found in two:
        measured = found["measured"]
        ddp = measured["ddp"]["collectives"]
        assert set(ddp["by_kind"]) == {"all_reduce"} and ddp["buffer_bytes"] == 4 * psi
        zero2, zero3 = measured["zero2"]["collectives"]["by_kind"], measured["zero3"]["collectives"]["by_kind"]
        assert (zero2["all_gather"]["calls"], zero2["reduce_scatter"]["calls"]) == (depth, depth)
        assert (zero3["all_gather"]["calls"], zero3["reduce_scatter"]["calls"]) == (2 * depth, depth)
        tp = measured["tp"]["collectives"]["by_kind"]
        assert set(tp) == {"all_reduce"} and tp["all_reduce"]["calls"] == 3  # fc2, fc4 forward; fc3 backward
        for strategy in STRATEGIES:
            entry = measured[strategy]
            assert entry["collectives"]["sent_bytes"] == pytest.approx(entry["textbook_sent_bytes"]), strategy
        for strategy in ("zero2", "zero3"):  # padded shards travel padded: exactly the padding more
            entry = measured[f"{strategy}-odd"]
            rounds = 2 if strategy == "zero2" else 3
            padding = sharded.padding_bytes(ODD.parameter_shapes, 2)
            extra = entry["collectives"]["sent_bytes"] - entry["textbook_sent_bytes"]
            assert extra == pytest.approx(rounds * padding), strategy


def test_gloo_runs_reduce_scatter_as_an_all_reduce(two):
    """The fact the notebook must say: over gloo, FSDP2's reduce-scatter sends the bytes of an all-reduce."""
    backend = two[0]["measured"]["zero2"]["backend_calls"]
    assert "gloo:reduce_scatter" not in backend
    assert backend["gloo:all_reduce"] == {"calls": EVEN.depth, "elements": EVEN.parameters}  # the whole gradients


# ---- one process ----


def test_one_process_runs_every_strategy_and_matches_two(one, two):
    psi = EVEN.parameters
    for strategy in STRATEGIES:
        measured = one["measured"][strategy]
        assert measured["held_bytes"]["total"] == 16 * psi, strategy
        assert measured["collectives"]["sent_bytes"] == 0, strategy
        # one process on the whole batch takes the steps that two processes on halves take
        assert sharded.loss_difference(one["sgd"][strategy], two[0]["sgd"]["ddp"]) <= sharded.LOSS_TOLERANCE
    assert one["measured"]["tp"]["mesh"] == {"dp": 1, "tp": 1}
    assert one["measured"]["zero3"]["collectives"]["calls"] == 0  # FSDP2 on one process sends nothing
