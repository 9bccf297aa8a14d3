"""SDSS from CasJobs-style exports to a star/galaxy/QSO classifier, as a user runs it: one
flow run, then each stage alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e


def ok(result: Result) -> Result:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_sdss_exports_to_a_trained_dnn(shardflow: Callable[..., Result], tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    ok(shardflow("synth", "sdss", "--rows", "20000", "--files", "2", "--out", str(exports)))
    # The three stages as one Prefect flow run, then each stage's own command: the versions
    # exist, so preprocess and train return them without computing again.
    ran = ok(
        shardflow(
            "run",
            "sdss",
            "--source",
            str(exports),
            "--np",
            "2",
            "--epochs",
            "2",
            "--batch-size",
            "64",
            "--json",
        )
    ).json
    raw = ok(shardflow("catalog", "show", f"sdss@{ran['raw_version']}", "--json")).json
    assert raw["rows"] == 20_000

    processed = ok(shardflow("preprocess", "sdss", "--json")).json
    assert processed["version"] == ran["processed_version"]
    splits = processed["splits"]
    quarantined = processed["quarantine"]["rows"]
    assert quarantined > 0  # the synthetic exports carry SDSS's -9999 sentinels
    assert processed["rows_in"] == 20_000
    # Every good row is written once: rows in = rows out + rows quarantined.
    assert splits["train"]["padded_rows"] == splits["train"]["dropped_rows"] == 0
    assert processed["rows"] + quarantined == 20_000
    assert splits["train"]["num_row_groups"] >= 64
    assert len(processed["normalization"]["mean"]) == 19

    trained = ok(
        shardflow("train", "sdss", "--np", "2", "--epochs", "2", "--batch-size", "64", "--json")
    ).json
    assert trained["version"] == ran["version"]
    assert trained["test_accuracy"] == ran["test_accuracy"]
    assert trained["num_ranks"] == 2
    assert trained["test_accuracy"] >= 0.9
    assert trained["test_rows"] == splits["test"]["rows"]
    # Allreduce bytes are measured where Horovod sends them, and match what the model implies.
    assert trained["allreduce_bytes_per_epoch"] == trained["allreduce_bytes_per_epoch_computed"]

    # fp16 and 2 backward passes per step: a quarter of the bytes per step.
    halved = ok(
        shardflow(
            "train",
            "sdss",
            "--np",
            "2",
            "--epochs",
            "1",
            "--batch-size",
            "64",
            "--compression",
            "fp16",
            "--backward-passes-per-step",
            "2",
            "--json",
        )
    ).json
    steps = halved["steps_per_epoch"]
    per_step_fp32 = trained["allreduce_bytes_per_epoch"] // steps
    # One allreduce per 2 steps (an odd last step waits for the next epoch), 2 bytes a value.
    assert halved["allreduce_bytes_per_epoch"] == per_step_fp32 // 2 * (steps // 2)

    shown = ok(shardflow("catalog", "show", f"sdss-dnn@{trained['version']}", "--json")).json
    by_epoch = shown["extra"]["row_groups_by_epoch"]
    assert sorted(by_epoch) == ["1", "2"]
    assert by_epoch["1"] != by_epoch["2"]  # a new order every epoch
    assert sorted(by_epoch["1"]["0"]) == sorted(by_epoch["2"]["0"])  # the same set per rank

    refused = shardflow("train", "sdss", "--model", "resnet50")
    assert refused.returncode != 0
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .endswith("model 'resnet50' does not take tabular data; for tabular use: dnn")
    )
