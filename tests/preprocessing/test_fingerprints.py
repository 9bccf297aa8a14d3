"""Dataset and model ids follow the code that makes their bytes, never the repository's commit.

- Which modules each stage's fingerprint covers, and what changes it (in a copy of the tree,
  as a commit would change it: docs, training/, the feature code).
- Every module of preprocessing/ whose code runs while a stage writes its files is in the
  stage's fingerprint or in ``ORCHESTRATION`` (traced while the stage runs).
- A stage's output bytes do not change while its fingerprint stays the same: the digests of a
  small fixed run are kept beside the fingerprint that made them (``golden_fingerprints.json``)
  and compared whenever the fingerprint is still the one recorded. After a change that moves a
  fingerprint, rewrite the file: ``SHARDFLOW_UPDATE_GOLDEN=1 pytest tests/preprocessing/
  test_fingerprints.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from data_catalog import Catalog, Manifest
from data_catalog.identity import module_closure
from preprocessing.config import JobOptions
from preprocessing.driver import run_job, serial_runner
from preprocessing.fingerprint import ORCHESTRATION, stage_code
from preprocessing.plan import PlanConfig
from training.fingerprint import model_code

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden_fingerprints.json")
SDSS_INGEST = "preprocessing.sources.exports"
SDSS_PREPROCESS = "preprocessing.sdss"
IMAGES_INGEST = "preprocessing.sources.mnist"
IMAGES_PREPROCESS = "preprocessing.images"


def _closure(module: str) -> list[str]:
    return module_closure((module,), within=("preprocessing",), exclude=ORCHESTRATION)


def test_each_stage_covers_its_own_modules_and_not_the_others() -> None:
    ingest, processed = _closure(SDSS_INGEST), _closure(SDSS_PREPROCESS)
    assert {"preprocessing.sources.exports", "preprocessing.shard_files"} <= set(ingest)
    assert "preprocessing.sdss" not in ingest and "preprocessing.schemas" not in ingest
    assert {"preprocessing.sdss", "preprocessing.schemas", "preprocessing.splits"} <= set(processed)
    assert not set(ingest + processed) & set(ORCHESTRATION)
    assert stage_code(SDSS_INGEST).startswith("src-")
    assert stage_code(SDSS_INGEST) != stage_code(SDSS_PREPROCESS)


def _codes(tree: Path) -> dict[str, str]:
    """Every stage's fingerprint, computed by a fresh interpreter on the code in ``tree``."""
    script = (
        "import json; from preprocessing.fingerprint import stage_code; "
        "from training.fingerprint import model_code; "
        f"print(json.dumps({{m: stage_code(m) for m in {[SDSS_INGEST, SDSS_PREPROCESS, IMAGES_INGEST, IMAGES_PREPROCESS]!r}}} | {{'model': model_code()}}))"  # noqa: E501
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    codes: dict[str, str] = json.loads(done.stdout)
    return codes


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    copy = tmp_path_factory.mktemp("tree")
    for item in ("data_catalog", "preprocessing", "training", "flows", "README.md", "docs"):
        source = ROOT / item
        if source.is_dir():
            shutil.copytree(source, copy / item, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, copy / item)
    return copy


def test_docs_training_and_cli_changes_keep_every_dataset_code(tree: Path) -> None:
    before = _codes(tree)
    (tree / "README.md").write_text((tree / "README.md").read_text() + "\na typo fixed\n")
    (tree / "docs" / "preprocessing.md").write_text("rewritten\n")
    (tree / "flows" / "cli.py").write_text((tree / "flows" / "cli.py").read_text() + "\n# a\n")
    models = tree / "training" / "models.py"
    models.write_text(models.read_text() + "\n# a comment in training/\n")
    after = _codes(tree)
    assert {k: v for k, v in after.items() if k != "model"} == {
        k: v for k, v in before.items() if k != "model"
    }
    assert after["model"] != before["model"]  # the models are the model's code


def test_a_changed_feature_computation_changes_the_processed_code_only(tree: Path) -> None:
    before = _codes(tree)
    module = tree / "preprocessing" / "sdss.py"
    text = module.read_text()
    changed = text.replace(
        "difference = scan.floats_of(table, first)[rows] - scan.floats_of(table, second)[rows]",
        "difference = scan.floats_of(table, second)[rows] - scan.floats_of(table, first)[rows]",
    )
    assert changed != text
    module.write_text(changed)
    after = _codes(tree)
    assert after[SDSS_PREPROCESS] != before[SDSS_PREPROCESS]
    assert after[SDSS_INGEST] == before[SDSS_INGEST]
    assert after[IMAGES_INGEST] == before[IMAGES_INGEST]
    assert after["model"] == before["model"]


def test_the_driver_and_the_catalog_are_no_stage_code(tree: Path) -> None:
    before = _codes(tree)
    for path in (tree / "preprocessing" / "driver.py", tree / "data_catalog" / "catalog.py"):
        path.write_text(path.read_text() + "\n# orchestration only\n")
    assert _codes(tree) == before


def test_a_new_folder_layout_changes_every_dataset_code(tree: Path) -> None:
    """Where a version's files go (data_catalog.layout.FOLDER_LAYOUT) is part of every dataset
    stage's identity: versions in a new layout get new ids; the model's code stays."""
    before = _codes(tree)
    layout = tree / "data_catalog" / "layout.py"
    text = layout.read_text()
    changed = text.replace("\nFOLDER_LAYOUT = 2\n", "\nFOLDER_LAYOUT = 3\n")
    assert changed != text
    layout.write_text(changed)
    after = _codes(tree)
    layout.write_text(text)
    assert all(after[k] != before[k] for k in before if k != "model")
    assert after["model"] == before["model"]


def test_the_model_code_is_the_rank_program_s_own() -> None:
    modules = module_closure(("training.worker",), within=("training",))
    assert {"training.worker", "training.models", "training.input"} <= set(modules)
    assert "training.launcher" not in modules
    assert model_code().startswith("src-")


# --- what runs while a stage writes, and what it writes --------------------------------------


@contextmanager
def _modules_run() -> Iterator[set[str]]:
    """The preprocessing modules whose functions are called inside the block (this thread)."""
    seen: set[str] = set()
    files: dict[str, str | None] = {}
    package = str(ROOT / "preprocessing")

    def module_of(filename: str) -> str | None:
        if filename not in files:
            path = Path(filename)
            files[filename] = None
            if filename.startswith(package) and path.suffix == ".py":
                parts = path.relative_to(ROOT).with_suffix("").parts
                files[filename] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        return files[filename]

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and (name := module_of(frame.f_code.co_filename)):
            seen.add(name)

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


def _digests(catalog: Catalog, manifest: Manifest) -> dict[str, str]:
    return {entry.path: entry.sha256 for entry in manifest.files}


def _sdss_run(root: Path, trace: Callable[[str, set[str]], None]) -> dict[str, Any]:
    from preprocessing.sdss import plan_sdss_job
    from preprocessing.sources.exports import plan_ingest
    from preprocessing.sources.synth import write_sdss_exports

    exports = root / "exports"
    write_sdss_exports(exports, rows=3_000, files=2, fmt="csv", seed=7)
    catalog = Catalog(root / "catalog")
    with _modules_run() as ran:
        raw = run_job(catalog, plan_ingest(str(exports)), runner=serial_runner)
    trace(SDSS_INGEST, ran)
    options = JobOptions(plan=PlanConfig(rank_multiple=4, target_rows_per_group=100))
    with _modules_run() as ran:
        processed = run_job(catalog, plan_sdss_job(catalog, raw, options), runner=serial_runner)
    trace(SDSS_PREPROCESS, ran)
    return {
        SDSS_INGEST: _digests(catalog, raw),
        SDSS_PREPROCESS: _digests(catalog, processed),
    }


def _images_run(root: Path, trace: Callable[[str, set[str]], None]) -> dict[str, Any]:
    import numpy as np

    from preprocessing.images import plan_job
    from preprocessing.sources import idx
    from preprocessing.sources.mnist import plan_ingest

    rng = np.random.default_rng(3)
    source = root / "idx"
    source.mkdir()
    for prefix, rows in (("train", 600), ("t10k", 100)):
        images = rng.integers(0, 256, size=(rows, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=rows, dtype=np.uint8)
        idx.write(source / f"{prefix}-images-idx3-ubyte.gz", images, compress=True)
        idx.write(source / f"{prefix}-labels-idx1-ubyte.gz", labels, compress=True)
    catalog = Catalog(root / "catalog")
    with _modules_run() as ran:
        raw = run_job(
            catalog, plan_ingest("fashion-mnist", source=str(source)), runner=serial_runner
        )
    trace(IMAGES_INGEST, ran)
    options = JobOptions(plan=PlanConfig(rank_multiple=4, target_rows_per_group=50))
    with _modules_run() as ran:
        processed = run_job(catalog, plan_job(catalog, raw, options), runner=serial_runner)
    trace(IMAGES_PREPROCESS, ran)
    return {IMAGES_INGEST: _digests(catalog, raw), IMAGES_PREPROCESS: _digests(catalog, processed)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    traced: dict[str, set[str]] = {}

    def trace(stage: str, ran: set[str]) -> None:
        traced[stage] = set(ran)

    digests = {
        **_sdss_run(tmp_path_factory.mktemp("sdss"), trace),
        **_images_run(tmp_path_factory.mktemp("images"), trace),
    }
    return {"digests": digests, "traced": traced}


@pytest.mark.parametrize("stage", [SDSS_INGEST, SDSS_PREPROCESS, IMAGES_INGEST, IMAGES_PREPROCESS])
def test_every_module_that_runs_is_in_the_stage_code_or_orchestration(
    runs: dict[str, Any], stage: str
) -> None:
    ran = runs["traced"][stage]
    assert stage in ran
    outside = ran - set(_closure(stage)) - set(ORCHESTRATION) - {"preprocessing"}
    assert outside == set(), f"{stage} ran {sorted(outside)}, which its fingerprint leaves out"


def test_bytes_do_not_change_while_the_code_stays_the_same(runs: dict[str, Any]) -> None:
    now = {
        stage: {"code": stage_code(stage), "digests": digests}
        for stage, digests in sorted(runs["digests"].items())
    }
    if os.environ.get("SHARDFLOW_UPDATE_GOLDEN") == "1" or not GOLDEN.exists():
        GOLDEN.write_text(json.dumps(now, indent=2, sort_keys=True) + "\n")
    recorded = json.loads(GOLDEN.read_text())
    for stage, entry in now.items():
        if recorded.get(stage, {}).get("code") != entry["code"]:
            continue  # the stage's code changed: its ids changed with it
        assert entry["digests"] == recorded[stage]["digests"], (
            f"{stage} wrote other bytes with the same code {entry['code']}: a change that shapes "
            "its output is outside its fingerprint (preprocessing/fingerprint.py)"
        )
