"""The answers to the notebooks' exercises, computed from the records their runs wrote.

Every notebook ends with exercises: change one parameter (``DEVICES``, the batch, ``PRECISION``, ``PREPARED``, the
strategy or the kvstore, ...), predict what will change, run the notebook again and compare. Each hidden answer cell
calls :func:`compare`: from the records in ``RESULTS_DIR`` it takes the newest run of each value of that parameter,
among the runs whose other settings are those of the newest run, and tabulates what the exercise asks about: images/s,
scaling efficiency against one device, test AUC, the wait for batches, the steps' share of the run and the verdict of
:mod:`common.measure.diagnosis`. A value that has not run yet is named with the change that runs it, rather than
failing, so every answer cell runs right after a single run of its notebook.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re

import pandas as pd

from common.measure import diagnosis, phases, results

# A notebook parameter and the record field that says which value a run had ("prepared": prepared_size is set).
PARAMETERS = {
    "DEVICES": "devices",
    "PRECISION": "precision",
    "BATCH_SIZE_PER_DEVICE": "batch_size_per_device",
    "IMAGE_SIZE": "image_size",
    "EPOCHS": "epochs",
    "PREPARED": "prepared",
    "STRATEGY": "strategy",
    "KVSTORE": "kvstore",
    "COMPILE": "compile",
    "PIPELINE_MICRO_BATCHES": "micro_batches",
    "WAYS": "variant",
    "GRADIENTS": "gradients",
    "SAME_INITIAL_WEIGHTS": "same_initial_weights",
    "SET_EPOCH": "set_epoch",
    "BATCH_NORM": "batch_norm",
    "MLP_WIDTH": "mlp_width",
    "PARALLELISM": "parallelism",
}
# What a run was asked to do: two runs compare when all of these agree but the one the exercise changes.
SETTINGS = (
    "device_kind",
    "devices",
    "precision",
    "batch_size_per_device",
    "image_size",
    "epochs",
    "prepared",
    "train_images",
    "strategy",
    "kvstore",
    "compile",
    "micro_batches",
    "gradients",
    "same_initial_weights",
    "set_epoch",
    "batch_norm",
    "mlp_width",
    "parallelism",
)
# The table's column of a record field, left out when that field is the table's index.
COLUMNS = {"devices": "devices", "global_batch": "global batch", "learning_rate": "learning rate"}
# Variants of one run differ in these by design (one device alone, two stages, m micro-batches).
BY_DESIGN = ("devices", "micro_batches")


def value(record: dict, field: str):
    """The record's ``field``; ``"prepared"``: whether it trained from the prepared copy; ``"a.b"``: a nested field."""
    if field == "prepared":
        return record.get("prepared_size") is not None
    found = record
    for part in field.split("."):
        found = found.get(part) if isinstance(found, dict) else None
    return found


def compare(results_dir, notebook: str, *, variant=None, fields=(), how: str | None = None, **varied) -> pd.DataFrame:
    """The newest run of ``notebook`` for each value of one parameter, as a table; prints which wanted run is missing.
    Where fewer than two of the wanted values have run and one that this machine can run is missing (a Run All before
    the learner tried), no table: only what to run.

    ``varied`` is one ``NAME=[values]``: a notebook parameter of :data:`PARAMETERS` (or a record field) and the values
    the exercise compares; without it, the variants found are compared. ``variant``: only records whose variant starts
    with it (or with one of a tuple). ``fields``: record fields to add as columns (``"bubble.textbook"`` reads a
    nested one). ``how``: what to change to run a missing value, where it is not simply ``NAME=value``.
    Training records are compared where there are any, else the in-RAM benchmarks.
    """
    if len(varied) > 1:
        raise ValueError(f"compare changes one parameter at a time, not {', '.join(varied)}")
    name, wanted = next(iter(varied.items())) if varied else ("variant", ())
    field = PARAMETERS.get(name, name)
    wanted = list(wanted) if isinstance(wanted, list | tuple) else [wanted]
    prefixes = (variant,) if isinstance(variant, str) else tuple(variant or ())
    everything = [r for r in results.load_all(results_dir) if r["notebook"] == notebook]
    chosen = [r for r in everything if not prefixes or (r.get("variant") or "").startswith(prefixes)]
    if not chosen:
        what = f"{notebook} ({' or '.join(prefixes)})" if prefixes else notebook
        print(f"No record of {what} in {results_dir} yet: run this notebook (Run All), then this cell again.")
        return pd.DataFrame()
    trained = [r for r in chosen if r["data"] != results.IN_RAM]
    pool = trained or chosen
    reference = pool[-1]  # the newest run: the others compare with it
    ignored = {field, *BY_DESIGN} if field == "variant" else {field}
    newest, elsewhere = {}, {}
    for record in pool:
        key = value(record, field)
        (elsewhere if _differences(record, reference, ignored) else newest)[key] = record
    shown = _settings(reference, ignored)
    print(f"{notebook}: the newest run of each {name}" + (f", all with {shown}:" if shown else ":"))
    unmeasured = {
        what: why for what, why in (reference.get("not_measured") or {}).items() if what.startswith(prefixes or "")
    }
    missing = [v for v in wanted if v not in newest]
    for sentence in dict.fromkeys(
        _missing(name, v, missing, reference, elsewhere.get(v), ignored, how, results_dir, unmeasured) for v in missing
    ):
        print(sentence)
    if prefixes:
        for what, why in unmeasured.items():
            print(f"Not measured on this machine, {what}: {why}")
    runnable = [v for v in missing if _unmeasured(v, unmeasured) is None]
    if runnable and sum(v in newest for v in wanted) < 2:
        # Run All runs this cell too: before the learner's own run there is nothing to compare, only the run above
        print("Nothing to compare yet: the table shows once two of the runs above exist.")
        return pd.DataFrame(index=pd.Index([], name=name))
    order = [v for v in wanted if v in newest] + sorted((v for v in newest if v not in wanted), key=_natural)
    rows = {v: _row(newest[v], everything, fields) for v in order}
    table = pd.DataFrame.from_dict(rows, orient="index")
    if not table.empty:
        keep = [c for c in table.columns if c in fields or table[c].notna().any()]
        table = table[[c for c in keep if c != COLUMNS.get(field)]]  # the index says it already
    table.index.name = name
    return table


def _natural(found) -> list[tuple[int, float | str]]:
    """Sorts "batch 4" before "batch 16" and "lr=0.0005" before "lr=0.001": the numbers in a name as numbers."""
    parts = re.split(r"(\d+(?:\.\d+)?)", str(found))
    return [(0, float(part)) if part[:1].isdigit() else (1, part) for part in parts]


def _differences(record: dict, reference: dict, ignored) -> dict:
    """``{field: (record's, reference's)}`` of the settings in which they differ."""
    return {
        field: (value(record, field), value(reference, field))
        for field in SETTINGS
        if field not in ignored and value(record, field) != value(reference, field)
    }


def _settings(record: dict, ignored) -> str:
    """The record's settings as the notebook parameters that give them: ``"PRECISION='fp32', IMAGE_SIZE=64"``."""
    parts = []
    benchmark = record["data"] == results.IN_RAM  # a benchmark's devices and epochs are its own, not the parameters
    for name, field in PARAMETERS.items():
        found = value(record, field)
        if field in ignored or field == "variant" or found is None or (benchmark and field in ("devices", "epochs")):
            continue
        parts.append(f"{name}={found!r}")
    return ", ".join(parts)


def _papermill(name: str, value) -> str:
    if isinstance(value, list | tuple | dict):
        return f"-y '{name}: {json.dumps(value)}'"
    return f"-p {name} {value}"


def _unmeasured(wanted, unmeasured: dict) -> tuple[str, str] | None:
    """``(what, why)`` of the record's ``not_measured`` entry that names the value ``wanted``, if one does."""
    for what, why in unmeasured.items():
        if re.search(rf"(?<![\w-]){re.escape(str(wanted))}(?![\w-])", what):
            return what, why
    return None


def _missing(name: str, wanted, missing, reference: dict, other, ignored, how, results_dir, unmeasured) -> str:
    """One sentence: what has not run yet and how to run it, or why this machine cannot (``unmeasured``); where one
    change (``how``) runs all the ``missing`` values, one sentence for all of them."""
    if found := _unmeasured(wanted, unmeasured):
        what, why = found
        return f"{name}={wanted!r} is not measured on this machine ({what}): {why}."
    if how and other is None:
        values = ", ".join(f"{name}={v!r}" for v in missing)
        return f"Not run yet: {values}. To compare, run this notebook with {how}, then this cell again."
    if how:
        change = f"run this notebook with {how}"
    elif name in PARAMETERS:
        change = (
            f"set {name} = {wanted!r} in the Parameters cell and Run All (papermill: {_papermill(name, wanted)}), "
            f"the other parameters as in the newest run"
        )
    else:
        change = "run this notebook so that a record has it"
    sentence = f"Not run yet: {name}={wanted!r}. To compare, {change}, then run this cell again."
    if other is not None:
        differences = _differences(other, reference, ignored).items()
        differ = ", ".join(f"{field} {mine!r} (newest run: {theirs!r})" for field, (mine, theirs) in differences)
        sentence += f" (The run with {name}={wanted!r} in {results_dir} had other settings: {differ}.)"
    return sentence


def _row(record: dict, everything: list[dict], fields) -> dict:
    """What the table shows of one run: a training run with its diagnosis, or an in-RAM benchmark."""
    row = {"recorded (UTC)": record["timestamp"][:16].replace("T", " "), "devices": record["devices"]}
    row["global batch"] = record.get("global_batch")
    if record["data"] == results.IN_RAM:
        row["images/s"] = record["images_per_second"]
        row["first steps s"] = record.get("first_steps_seconds")
        row["peak MiB"] = _peak(record)
    else:
        row["learning rate"] = record.get("learning_rate")
        single = _single_device(record, everything)
        found = diagnosis.diagnose(record, _benchmark(record, everything), single)
        numbers = found.numbers
        row["train img/s"] = record["images_per_second"]
        row["in-RAM img/s"] = numbers[diagnosis.RAM_RATE]
        row["scaling efficiency"] = 1.0 if record["devices"] == 1 else numbers[diagnosis.EFFICIENCY]
        row["test AUC"] = record.get("test_auc")
        row["waiting share"] = numbers[diagnosis.WAIT]
        row["steps share"] = phases.steps_share(record["phases"]) if record.get("phases") else None
        row["peak MiB"] = _peak(record)
        row["diagnosis"] = found.verdict
    for name in fields:
        row[name] = value(record, name)
    return {key: _rounded(found) for key, found in row.items()}


def _rounded(found):
    """Three significant digits for reading (one decimal from 100 up): a table of measurements, not of noise."""
    if isinstance(found, list):  # one figure per stage or device
        return [_rounded(item) for item in found]
    if not isinstance(found, float) or math.isnan(found):
        return found
    return round(found, 1) if abs(found) >= 100 else float(f"{found:.3g}")


def _same_run_kind(record: dict, other: dict) -> bool:
    return results.label(other) == results.label(record) and other["device_kind"] == record["device_kind"]


def _when(record: dict) -> float:
    return dt.datetime.fromisoformat(record["timestamp"]).timestamp()


def _benchmark(record: dict, everything: list[dict]) -> dict | None:
    """The in-RAM benchmark of the same run: same label, devices and precision, written nearest in time."""
    same = [
        r
        for r in everything
        if r["data"] == results.IN_RAM
        and _same_run_kind(record, r)
        and (r["devices"], r["precision"]) == (record["devices"], record["precision"])
    ]
    return min(same, key=lambda r: abs(_when(r) - _when(record)), default=None)


def _single_device(record: dict, everything: list[dict]) -> float | None:
    """Training images/s of the newest one-device run with the record's other settings: scaling's denominator."""
    if record["devices"] == 1:
        return None
    same = [
        r
        for r in everything
        if r["data"] != results.IN_RAM
        and r["devices"] == 1
        and _same_run_kind(record, r)
        and not _differences(r, record, {"devices"})
    ]
    return same[-1]["images_per_second"] if same else None


def _peak(record: dict) -> float | None:
    """Peak memory of the most loaded device (a framework's own count where it keeps one; on a CPU, the machine's)."""
    if record.get("peak_memory_mib"):
        return record["peak_memory_mib"]
    per_device = [mib for mib in (record.get("peak_memory_mib_per_device") or {}).values() if mib]
    if per_device:
        return max(per_device)
    watched = [d.get("memory_peak_mib") for d in (record.get("device_utilization") or {}).values()]
    watched = [mib for mib in watched if mib]
    return max(watched) if watched else None
