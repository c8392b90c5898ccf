"""What ``PyTorch_Sharded`` prints from its launched runs: the check, memory, communication and speed, what fits where,
and when to choose which. Pure pandas over the JSON the processes wrote."""

from __future__ import annotations

import pandas as pd

from common.pytorch.sharded.formula import largest_width, paper_bytes
from common.pytorch.sharded.model import parameter_count
from common.pytorch.sharded.training import LOSS_TOLERANCE, loss_difference

MB = 1e6
NAMES = {"ddp": "DDP (replicas)", "zero2": "ZeRO-2 (FSDP2)", "zero3": "ZeRO-3 (FSDP2)", "tp": "tensor parallel"}


def check_table(check: dict) -> pd.DataFrame:
    """The largest difference of each strategy's per-step loss from DDP's, for each model the check trained."""
    rows = {}
    for model, losses in check.items():
        for strategy, found in losses.items():
            rows[(model, NAMES[strategy])] = loss_difference(found, losses["ddp"])
    table = pd.Series(rows, name="largest loss difference from DDP").to_frame()
    table["within"] = LOSS_TOLERANCE
    table.index.names = ["model", "strategy"]
    return table


def memory_table(measured: dict) -> pd.DataFrame:
    """Model state one process holds after a step (rank 0; MB), beside the ZeRO paper's formula and FSDP2's exact
    count (with its padding), and the step's peak: the allocator's on a GPU, the profiler's estimate on a CPU."""
    rows = {}
    for strategy, every in measured.items():
        mine = every[0]
        held, expected = mine["held_bytes"], mine["expected_bytes"]
        formula = expected["tp"] if strategy == "tp" else expected["paper"]
        exact = expected["tp"] if strategy == "tp" else expected["fsdp2"]
        rows[NAMES[strategy]] = {
            "parameters": held["parameters"] / MB,
            "gradients": held["gradients"] / MB,
            "Adam state": held["optimizer_state"] / MB,
            "DDP buckets": held["ddp_buckets"] / MB,
            "model state": (held["parameters"] + held["gradients"] + held["optimizer_state"]) / MB,
            "ZeRO paper": formula["total"] / MB,
            "exact (padding)": exact["total"] / MB,
            "parameters from forward to backward": held["parameters_after_forward"] / MB,
            "step peak": mine["step_peak_bytes"]["peak"] / MB,
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = f"MB per process, {measured['ddp'][0]['processes']} process(es)"
    return table


def communication_table(measured: dict) -> pd.DataFrame:
    """The collectives of one step (counted as they were called) and the bytes each process sends by the ring model,
    beside the textbook's figure; seconds per step and samples per second."""
    rows = {}
    for strategy, every in measured.items():
        mine = every[0]
        calls = mine["collectives"]["by_kind"]
        rows[NAMES[strategy]] = {
            "collectives": ", ".join(f"{found['calls']} {kind}" for kind, found in calls.items()) or "none",
            "sent MB": mine["collectives"]["sent_bytes"] / MB,
            "textbook MB": mine["textbook_sent_bytes"] / MB,
            "seconds per step": mine["seconds_per_step"],
            "samples/s": mine["global_batch"] / mine["seconds_per_step"],
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "per step and process"
    return table


def fits_table(budget_gib: float, devices: int, in_features: int, depth: int) -> pd.DataFrame:
    """The widest MLP whose model state fits ``budget_gib`` per device, per strategy, by the ZeRO paper's formula (in
    fp32 with Adam): where replicas stop fitting and shards still fit. Activations come on top."""
    rows = {}
    for strategy in ("ddp", "zero2", "zero3"):
        width = largest_width(budget_gib * 2**30, strategy, devices, in_features=in_features, depth=depth)
        parameters = parameter_count(width, in_features, depth)
        rows[NAMES[strategy]] = {
            "widest MLP": width,
            "parameters (millions)": parameters / 1e6,
            "model state GiB per device": paper_bytes(strategy, parameters, devices)["total"] / 2**30,
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = f"{budget_gib:g} GiB per device, {devices} device(s)"
    return table


def advice(memory: pd.DataFrame, communication: pd.DataFrame, devices: int) -> str:
    """When to choose which, from this run's tables (:func:`memory_table`, :func:`communication_table`)."""
    ddp, zero3, tp = NAMES["ddp"], NAMES["zero3"], NAMES["tp"]
    speed = communication["seconds per step"]
    lines = [
        f"- Replicas (DDP) while the model, its gradients and Adam's state fit one device: here "
        f"{memory.loc[ddp, 'model state']:.1f} MB of model state per process and {memory.loc[ddp, 'DDP buckets']:.1f} "
        f"MB of buckets, one all-reduce of {communication.loc[ddp, 'sent MB']:.1f} MB per step, "
        f"{speed[ddp] * 1000:.1f} ms per step.",
        f"- ZeRO-3 when they do not: {memory.loc[zero3, 'model state']:.1f} MB per process ({devices} processes; 1/N "
        f"of DDP's model state, and no buckets) for {communication.loc[zero3, 'sent MB']:.1f} MB sent per step "
        f"({communication.loc[zero3, 'sent MB'] / max(communication.loc[ddp, 'sent MB'], 1e-9):.1f}x DDP's) and "
        f"{speed[zero3] / speed[ddp]:.1f}x DDP's time per step here. ZeRO-2 holds the same between steps in FSDP2 and "
        f"keeps each layer's whole parameters from its forward to its backward: one all-gather fewer per layer.",
        f"- Tensor parallelism when one layer is too large, or the batch per device too small to keep it busy: it "
        f"sends activations ({communication.loc[tp, 'sent MB']:.2f} MB here), which grow with the batch, not the "
        f"parameters, so it belongs inside a machine's fast links, and FSDP across machines (a 2-D mesh).",
    ]
    if devices == 1:
        lines.append("- With one process nothing is split or sent: run with 2 or more devices to see the difference.")
    return "\n".join(lines)
