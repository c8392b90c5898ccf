"""What a run shows and records: the benchmark and bubble tables, the record fields, and the advice text."""

from __future__ import annotations

import numpy as np
import pandas as pd

from common.pytorch.model_parallel.split import STAGES


def device_names(kind: str, count: int) -> list[str]:
    """Names that tell devices apart in a record: ``cuda:i``, or ``cpu:i`` for the simulated ones."""
    return [f"{'cuda' if kind == 'gpu' else 'cpu'}:{i}" for i in range(count)]


def not_measured(kind: str, variant: str) -> dict[str, str]:
    """What this run could not measure for ``variant``, and why: what only GPUs show."""
    if kind == "gpu":
        return {}
    missing = {
        "peak_memory_mib_per_device": "the simulated CPU devices share one RAM and PyTorch keeps no peak per CPU "
        "device; device_utilization has the memory of the whole machine",
        "utilization_per_device": "the monitor sees all CPU cores as one device 'cpu'",
    }
    if variant.startswith("naive"):
        missing["activation_copy_seconds"] = (
            "both simulated devices are the same RAM, so moving the activation to the next device costs nothing here"
        )
    if variant.startswith("pipeline"):
        missing["gpu_to_gpu_transfer"] = (
            "the stages exchange activations through gloo over local TCP here; NCCL over NVLink or PCIe needs GPUs"
        )
    return missing


def extra_fields(entry: dict) -> dict:
    """The fields of a benchmark entry that its record keeps beyond the shared ones."""
    keep = ("seconds_per_step", "micro_batches", "bubble", "stage_alone_seconds", "stage_step_seconds")
    return {key: entry[key] for key in keep if key in entry}


def benchmark_table(benchmark: dict[str, dict]) -> pd.DataFrame:
    """Images/s, speed-up over one device, and the most parameters and memory any one device holds."""
    single = benchmark["single-device"]["images_per_second"]
    rows = {}
    for variant, entry in benchmark.items():
        memory = entry["peak_memory_mib_per_device"]
        bubble = entry.get("bubble", {}).get("measured")
        rows[variant] = {
            "devices": len(entry["parameters_per_device"]),
            "images/s": entry["images_per_second"],
            "x one device": entry["images_per_second"] / single,
            "most parameters on a device": max(entry["parameters_per_device"].values()),
            "most peak memory on a device (MiB)": max(memory.values()) if memory else None,
            "utilization % per monitored device": ", ".join(
                f"{name} {found['utilization_mean_percent']:.0f}"
                for name, found in entry.get("utilization", {}).items()
            ),
            "bubble per stage": ", ".join(f"{b:.2f}" for b in bubble) if bubble else "",
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def bubble_table(benchmark: dict[str, dict]) -> pd.DataFrame:
    """Measured bubble of each stage and the textbook value, one row per number of micro-batches."""
    rows = []
    for entry in benchmark.values():
        if "bubble" in entry:
            bubble = entry["bubble"]
            row = {"micro-batches": bubble["micro_batches"], "textbook": bubble["textbook"]}
            row.update({f"stage {i} measured": value for i, value in enumerate(bubble["measured"])})
            rows.append(row)
    return pd.DataFrame(rows).sort_values("micro-batches").reset_index(drop=True)


def pipeline_step_seconds(benchmark: dict[str, dict]) -> dict[int, float]:
    """Seconds of a measured GPipe step, by its number of micro-batches."""
    return {e["bubble"]["micro_batches"]: e["seconds_per_step"] for e in benchmark.values() if "bubble" in e}


def advice(benchmark: dict, stage_parameters, stage_times: dict, sweep: pd.DataFrame, kind: str) -> list[str]:
    """'When to choose which', from this run's numbers: speed, parameter split, bubble, balance, sweep, GPU-only.
    ``stage_times``: :func:`common.pytorch.model_parallel.timing.stage_seconds`."""
    rate = {variant: entry["images_per_second"] for variant, entry in benchmark.items()}
    single, ddp, naive = rate["single-device"], rate["ddp"], rate["naive-model-parallel"]
    pipelines = {
        entry["micro_batches"]: entry["images_per_second"] for entry in benchmark.values() if "bubble" in entry
    }
    best_m = max(pipelines, key=pipelines.get)
    best = pipelines[best_m]
    total = sum(stage_parameters)
    names = list(benchmark["naive-model-parallel"]["parameters_per_device"])
    lines = [
        f"Speed on these two devices: DDP {ddp:.1f} images/s ({ddp / single:.2f}x one device), the best pipeline "
        f"(m={best_m}) {best:.1f} ({best / single:.2f}x), naive model parallelism {naive:.1f} ({naive / single:.2f}x)."
    ]
    if ddp >= best:
        lines.append(
            f"When the model and one device's batch fit on one device, choose DDP: {ddp / best:.2f}x the best "
            f"pipeline here, with no bubble and no cut to balance."
        )
    else:
        lines.append(
            f"Here the pipeline beat DDP ({best / ddp:.2f}x). DDP averages the gradients of all {total:,} "
            f"parameters every step, the pipeline sends only activations and idles in its bubble; which costs more "
            f"depends on the interconnect, the batch and, on simulated devices, on the cores the communication "
            f"takes from the computation: measure on the real machine before choosing."
        )
    split = " and ".join(f"{count:,} on {name}" for count, name in zip(stage_parameters, names))
    lines.append(
        f"Model parallelism splits the {total:,} parameters {split} ({max(stage_parameters) / total:.0%} on the "
        f"fuller device, against 100% on every DDP device). Naive model parallelism ran at {naive / single:.2f}x "
        f"one device: it buys that room, not speed, since one device works at a time; pipelining the same split "
        f"ran {best / naive:.2f}x faster than it."
    )
    bubbles = bubble_table(benchmark)
    measured = "; ".join(
        f"m={row['micro-batches']:.0f}: "
        + " / ".join(f"{row[f'stage {i} measured']:.0%}" for i in range(STAGES))
        + f" (textbook {row['textbook']:.0%})"
        for _, row in bubbles.iterrows()
    )
    first, last = bubbles.iloc[0], bubbles.iloc[-1]
    stage_bubbles = [first[f"stage {i} measured"] for i in range(STAGES)]
    busier, lighter = int(np.argmin(stage_bubbles)), int(np.argmax(stage_bubbles))
    mean_first, mean_last = np.mean(stage_bubbles), np.mean([last[f"stage {i} measured"] for i in range(STAGES)])
    trend = "shrank" if mean_last < mean_first else "did not shrink"
    lines.append(
        f"Measured bubble per stage (stage 0 / stage 1): {measured}. The textbook assumes equal stages: at "
        f"m={first['micro-batches']:.0f} the busier stage {busier} idled {stage_bubbles[busier]:.0%} and the lighter "
        f"stage {lighter}, waiting for it, {stage_bubbles[lighter]:.0%}. More micro-batches {trend} the stages' mean "
        f"bubble ({mean_first:.0%} at m={first['micro-batches']:.0f}, {mean_last:.0%} at "
        f"m={last['micro-batches']:.0f}); smaller micro-batches also use a device less efficiently and each adds a "
        f"send and a receive, so the fastest pipeline here had m={best_m}. Choose a pipeline when the model does not "
        f"fit on one device, with several micro-batches per stage, as long as each still keeps a device busy."
    )
    work = [f + b for f, b in zip(stage_times["forward"], stage_times["backward"])]
    lines.append(
        f"Balance the cut by time, not by parameters: stage 0 holds {stage_parameters[0] / total:.0%} of the "
        f"parameters but took {work[0] / sum(work):.0%} of the forward and backward time."
    )
    top = sweep.loc[sweep["test AUC"].idxmax()]
    lines.append(
        f"One model per device trained {len(sweep)} models at once in {sweep['seconds'].max():.0f} s, test AUC "
        f"{sweep['test AUC'].min():.3f} to {sweep['test AUC'].max():.3f}, best at learning rate "
        f"{top['learning rate']:g}. Choose it for sweeps, seeds and ensembles: no communication at all, each run "
        f"at one device's speed."
    )
    if kind == "gpu":
        peaks = {
            variant: max(entry["peak_memory_mib_per_device"].values())
            for variant, entry in benchmark.items()
            if entry["peak_memory_mib_per_device"]
        }
        lines.append("Peak memory on the fullest device (MiB): " + ", ".join(f"{v} {p:.0f}" for v, p in peaks.items()))
    else:
        missing = {}
        for variant in benchmark:
            missing.update(not_measured(kind, variant))
        lines.append(
            "Only GPUs measure: "
            + "; ".join(f"{what} ({why})" for what, why in missing.items())
            + ". These CPU numbers show the shape of the trade-offs, not GPU speeds."
        )
    return lines
