"""`shardflow run` with OPENLINEAGE_URL pointing at a lineage receiver on loopback: ingest,
preprocess and train arrive as three COMPLETE run events, each stage's output the next one's
input (same dataset, same version), with schema, row-count and code facets; the run ends with
a summary for a person that names the same versions, and no library warning."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Result

pytestmark = pytest.mark.e2e


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A stand-in for Marquez's `POST /api/v1/lineage`: keeps every event it is sent."""
    received: list[dict[str, Any]] = []

    class Lineage(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/api/v1/lineage":
                received.append(json.loads(body))
            self.send_response(201 if self.path == "/api/v1/lineage" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Lineage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def test_a_run_arrives_as_three_linked_run_events(
    shardflow: Callable[..., Result],
    fashion_subset: Path,
    receiver: tuple[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, received = receiver
    monkeypatch.setenv("OPENLINEAGE_URL", url)
    # A normal run (neither --json nor --verbose): a summary for a person, nothing on stderr.
    run = shardflow(
        *("run", "fashion-mnist", "--source", str(fashion_subset), "--np", "1", "--epochs", "1")
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr == ""
    said = dict(line.split(maxsplit=1) for line in run.stdout.splitlines()[-6:])
    assert run.stdout.splitlines()[-7].startswith("fashion-mnist: test accuracy ")
    assert list(said) == ["raw", "processed", "model", "report", "Prefect", "more"]
    assert Path(said["report"]).is_file()
    assert "/runs/flow-run/" in said["Prefect"]
    assert [e["job"]["name"] for e in received] == [
        "ingest.fashion-mnist",
        "preprocess.fashion-mnist-processed",
        "train.fashion-mnist-cnn",
    ]
    assert {e["eventType"] for e in received} == {"COMPLETE"}
    assert len({e["run"]["runId"] for e in received}) == 3

    def version(dataset: dict[str, Any]) -> tuple[str, str, str]:
        facet = dataset["facets"]["version"]["datasetVersion"]
        return dataset["namespace"], dataset["name"], facet

    ingest, preprocess, train = received
    assert ingest["inputs"] == []
    assert [version(d) for d in preprocess["inputs"]] == [version(ingest["outputs"][0])]
    assert [version(d) for d in train["inputs"]] == [version(preprocess["outputs"][0])]
    processed = preprocess["outputs"][0]
    for stage, event in zip(("raw", "processed", "model"), received, strict=True):
        output = event["outputs"][0]
        assert said[stage].split()[0] == f"{output['name']}@{version(output)[2]}"
    assert ingest["outputs"][0]["outputFacets"]["outputStatistics"]["rowCount"] == 3_000
    # Training keeps equal row groups: the rows cut off are counted, not written.
    assert 0 < processed["outputFacets"]["outputStatistics"]["rowCount"] <= 3_000
    columns = [f["name"] for f in processed["facets"]["schema"]["fields"]]
    assert {"image", "label"} <= set(columns)
    for event in received:
        assert event["run"]["facets"]["shardflow_code"]["codeVersion"]
