"""PyTorch_Sharded on 1 (under nbval) and 2 simulated CPU devices: DenseNet-121 trained as ZeRO-3, every strategy's
steps checked against DDP's, and the MLP's bytes held and sent against the formulas."""

import pytest
from notebook_harness import NotebookContract

from common.measure import results

NOTEBOOK = "PyTorch_Sharded"
TOLERANCE = 1e-6  # common.pytorch.sharded.LOSS_TOLERANCE, the bound the notebook asserts


def state(found: dict) -> int:
    """The model state a measurement held: parameters, gradients and Adam's moments (what the ZeRO paper counts)."""
    return sum(found["held_bytes"][kind] for kind in ("parameters", "gradients", "optimizer_state"))


def mlp(runs, devices: int, strategy: str) -> dict:
    """Rank 0's measurement of ``strategy`` on the MLP, from the benchmark's record."""
    return runs[devices][results.IN_RAM]["mlp"][strategy][0]


class TestShardedNotebook(NotebookContract):
    NOTEBOOK = NOTEBOOK
    FRAMEWORK = "pytorch"
    MULTI_MACHINE = "config-2-nodes.json"
    REFUSALS = {"tensor-parallel-densenet": ({"STRATEGY": "tp"}, "must be one of")}

    @pytest.mark.parametrize("devices", [1, 2])
    def test_every_strategy_takes_ddps_steps(self, runs, devices):
        check = runs[devices]["generated"]["check"]
        assert set(check["densenet"]) == {"ddp", "zero2", "zero3"}
        assert set(check["mlp"]) == {"ddp", "zero2", "zero3", "tp"}
        for model, losses in check.items():
            assert losses["ddp"][0] != losses["ddp"][-1], "the steps changed the model"
            for strategy, found in losses.items():
                assert max(abs(a - b) for a, b in zip(found, losses["ddp"])) <= TOLERANCE, (model, strategy)

    def test_shards_hold_a_half_at_two_processes_and_replicas_all(self, runs):
        ddp, zero2, zero3 = (mlp(runs, 2, strategy) for strategy in ("ddp", "zero2", "zero3"))
        parameters = ddp["shape"]["parameters"]
        assert state(ddp) == 16 * parameters and ddp["held_bytes"]["ddp_buckets"] == 4 * parameters
        for sharded in (zero2, zero3):  # FSDP2's exact count, padding included: within a row per parameter
            assert state(sharded) == sharded["expected_bytes"]["fsdp2"]["total"]
            assert abs(state(sharded) - 8 * parameters) <= 4 * sharded["expected_bytes"]["padding_per_kind"]
        assert zero2["held_bytes"]["parameters_after_forward"] == 4 * parameters  # whole from forward to backward
        assert zero3["held_bytes"]["parameters_after_forward"] < 4 * parameters
        for one in (mlp(runs, 1, strategy) for strategy in ("zero2", "zero3", "tp")):
            assert state(one) == 16 * parameters, "one process holds everything"
        trained = runs[2]["generated"]["held_mb"]  # DenseNet-121 as ZeRO-3, after training: about half of 16 x 7M
        assert 0.45 < trained / (16 * 6_968_206 / 1e6) < 0.55

    def test_bytes_sent_are_the_textbooks(self, runs):
        for strategy in ("ddp", "zero2", "zero3", "tp"):
            found = mlp(runs, 2, strategy)
            assert found["collectives"]["sent_bytes"] == pytest.approx(found["textbook_sent_bytes"], rel=1e-6)
        assert mlp(runs, 2, "zero3")["collectives"]["sent_bytes"] == pytest.approx(
            1.5 * mlp(runs, 2, "ddp")["collectives"]["sent_bytes"], rel=1e-6
        )
        assert mlp(runs, 1, "zero3")["collectives"]["sent_bytes"] == 0

    def test_the_training_strategy_names_the_records(self, runs):
        for record in runs[2].values():
            assert record["variant"] == record["strategy"] == "zero3" and record["mlp_width"] == 1024
