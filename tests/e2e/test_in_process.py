"""A job small enough to finish sooner in one process starts no LocalCluster (decided from its
plan) and writes the same version, byte for byte, as the same job on a cluster."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from data_catalog import Catalog
from tests.conftest import Result

pytestmark = pytest.mark.e2e


def _digests(home: Path, name: str) -> dict[str, str]:
    catalog = Catalog(home / "catalog")
    manifest = catalog.get(name)
    return {
        entry.path: hashlib.sha256(catalog.file_path(manifest, entry).read_bytes()).hexdigest()
        for entry in manifest.files
    }


def _ok(run: Result) -> Result:
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_a_small_job_runs_in_process_and_writes_what_a_cluster_writes(
    shardflow: Callable[..., Result], tmp_path: Path
) -> None:
    exports = tmp_path / "exports"
    _ok(shardflow("synth", "sdss", "--rows", "30000", "--files", "3", "--out", str(exports)))
    homes = {"in_process": tmp_path / "small", "cluster": tmp_path / "cluster"}
    flags = {"in_process": [], "cluster": ["--in-process-below", "0"]}
    results = {}
    for way, home in homes.items():
        ingest = _ok(
            shardflow("ingest", "sdss", "--source", str(exports), "--json", *flags[way], home=home)
        )
        processed = _ok(shardflow("preprocess", "sdss", "-v", "--json", *flags[way], home=home))
        results[way] = (ingest, processed)
    for stage, name in ((0, "sdss"), (1, "sdss-processed")):
        small, cluster = (results[way][stage] for way in homes)
        # The tasks ran in the command's process: no worker, and it said so.
        assert small.json["resources"]["workers"] == 0
        assert cluster.json["resources"]["workers"] == 2
        # Either way, the CPU the tasks took is counted.
        assert small.json["resources"]["cpu_seconds"] > 0
        assert cluster.json["resources"]["cpu_seconds"] > 0
        assert small.json["version"] == cluster.json["version"]
        assert _digests(homes["in_process"], name) == _digests(homes["cluster"], name)
    assert "no cluster started" in results["in_process"][1].stderr
    assert "no cluster started" not in results["cluster"][1].stderr


def test_csv_exports_above_the_bound_convert_on_threads_as_a_cluster_would(
    shardflow: Callable[..., Result], tmp_path: Path
) -> None:
    # Past --in-process-below, CSV exports convert on threads of the command's process (their
    # parser and writer release the GIL): no cluster, and the same version as on one.
    exports = tmp_path / "exports"
    _ok(shardflow("synth", "sdss", "--rows", "30000", "--files", "3", "--out", str(exports)))
    runs = {}
    for way, bound in (("threads", "1"), ("cluster", "0")):
        runs[way] = _ok(
            shardflow(
                *("ingest", "sdss", "--source", str(exports), "-v", "--json", "--workers", "2"),
                *("--in-process-below", bound),
                home=tmp_path / way,
            )
        )
    assert "3 tasks reading 11 MiB: on 2 threads of this process, no cluster started" in (
        runs["threads"].stderr
    )
    assert runs["threads"].json["resources"]["workers"] == 0
    assert runs["cluster"].json["resources"]["workers"] == 2
    assert runs["threads"].json["version"] == runs["cluster"].json["version"]
    assert _digests(tmp_path / "threads", "sdss") == _digests(tmp_path / "cluster", "sdss")


def test_a_bad_export_among_threads_is_refused_in_one_line(
    shardflow: Callable[..., Result], tmp_path: Path
) -> None:
    exports = tmp_path / "exports"
    _ok(shardflow("synth", "sdss", "--rows", "40000", "--files", "4", "--out", str(exports)))
    bad = sorted(exports.glob("*.csv"))[0]
    lines = bad.read_text().splitlines(keepends=True)
    fields = lines[5].split(",")
    fields[0] = "1.2376458768612728e+18"  # an id a spreadsheet turned into a float
    lines[5] = ",".join(fields)
    bad.write_text("".join(lines))
    home = tmp_path / "home"
    run = shardflow(
        *("ingest", "sdss", "--source", str(exports), "--workers", "2"),
        *("--in-process-below", "1"),
        home=home,
    )
    assert run.returncode != 0
    error = run.stderr.strip().splitlines()
    assert error == [
        f"shardflow: error: {bad}: objid in row 5 is '1.2376458768612728e+18', not a uint64; "
        "64-bit ids lose digits as floats, re-export them as bigint or text"
    ], run.stderr
    assert Catalog(home / "catalog").names() == []
    # Nothing half-written: the files the other threads finished stay for a rerun, whole.
    assert not list(home.rglob("*.partial"))


def test_sdss_preprocess_above_the_bound_runs_on_threads_as_a_cluster_would(
    shardflow: Callable[..., Result], tmp_path: Path
) -> None:
    # Past --in-process-below, every pass of an SDSS preprocess (verify, scan, duplicates,
    # rescan, write) releases the GIL: threads of the command's process, no cluster, and the
    # same version, byte for byte, as on one.
    exports = tmp_path / "exports"
    _ok(shardflow("synth", "sdss", "--rows", "30000", "--files", "3", "--out", str(exports)))
    base = tmp_path / "base"
    _ok(shardflow("ingest", "sdss", "--source", str(exports), "--json", home=base))
    runs = {}
    for way, bound in (("threads", "1"), ("cluster", "0")):
        shutil.copytree(base, tmp_path / way)
        runs[way] = _ok(
            shardflow(
                *("preprocess", "sdss", "-v", "--json", "--workers", "2"),
                *("--in-process-below", bound),
                home=tmp_path / way,
            )
        )
    assert "on 2 threads of this process, no cluster started" in runs["threads"].stderr
    assert "LocalCluster" not in runs["threads"].stderr
    assert runs["threads"].json["resources"]["workers"] == 0
    assert runs["threads"].json["resources"]["cpu_seconds"] > 0
    assert runs["cluster"].json["resources"]["workers"] == 2
    assert runs["threads"].json["version"] == runs["cluster"].json["version"]
    assert runs["threads"].json["quarantine"] == runs["cluster"].json["quarantine"]
    assert _digests(tmp_path / "threads", "sdss-processed") == _digests(
        tmp_path / "cluster", "sdss-processed"
    )


def test_images_verify_on_threads_then_decode_on_a_cluster(
    shardflow: Callable[..., Result], tmp_path: Path
) -> None:
    # The verification of the raw files releases the GIL, the decoding of images does not:
    # the first on threads, then a LocalCluster for the rest; the same version as in-process.
    source = tmp_path / "src"
    _ok(shardflow("synth", "fashion-mnist", "--rows", "3000", "--out", str(source)))
    base = tmp_path / "base"
    _ok(shardflow("ingest", "fashion-mnist", "--source", str(source), "--json", home=base))
    runs = {}
    for way, bound in (("switched", "1"), ("in_process", str(2**30))):
        shutil.copytree(base, tmp_path / way)
        runs[way] = _ok(
            shardflow(
                *("preprocess", "fashion-mnist", "-v", "--json", "--workers", "2"),
                *("--in-process-below", bound),
                home=tmp_path / way,
            )
        )
    stderr = runs["switched"].stderr
    assert "on 2 threads of this process, no cluster started" in stderr
    assert stderr.index("no cluster started") < stderr.index("dask: LocalCluster with 2 workers")
    assert runs["switched"].json["resources"]["workers"] == 2
    assert runs["in_process"].json["resources"]["workers"] == 0
    assert runs["switched"].json["version"] == runs["in_process"].json["version"]
    assert _digests(tmp_path / "switched", "fashion-mnist-processed") == _digests(
        tmp_path / "in_process", "fashion-mnist-processed"
    )
