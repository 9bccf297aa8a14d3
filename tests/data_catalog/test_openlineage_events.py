"""OpenLineage events of commits: off unless configured the client's standard ways; through
the client's file transport, one COMPLETE event per new version (none for a rerun that finds
it committed), its parents as inputs; a transport that fails leaves the commit standing."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from data_catalog import Catalog, openlineage_events
from tests.data_catalog.commit_helper import commit


@pytest.fixture(autouse=True)
def own_environment() -> Iterator[None]:
    """The client writes OPENLINEAGE_URL's aliases into os.environ: none may outlive a test."""
    with mock.patch.dict(os.environ):
        yield
    openlineage_events._clients.clear()


def test_configured_only_the_clients_standard_ways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert not openlineage_events.configured({})
    assert openlineage_events.configured({"OPENLINEAGE_URL": "http://127.0.0.1:5000"})
    assert openlineage_events.configured({"OPENLINEAGE__TRANSPORT__TYPE": "console"})
    assert not openlineage_events.configured(
        {"OPENLINEAGE_URL": "http://127.0.0.1:5000", "OPENLINEAGE_DISABLED": "true"}
    )
    (tmp_path / "openlineage.yml").write_text("transport:\n  type: console\n")
    assert openlineage_events.configured({})


def test_a_commit_sends_one_event_through_the_file_transport(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = tmp_path / "events.jsonl"
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "file")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__LOG_FILE_PATH", str(events))
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__APPEND", "true")
    root = tmp_path / "catalog"
    parent = Catalog(root).get("a", commit(root, "a", 1))
    child = commit(root, "b", 2, parents=(parent.ref,))
    commit(root, "b", 2, parents=(parent.ref,))  # already committed: no new event
    sent = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["job"]["name"] for e in sent] == ["preprocess.a", "preprocess.b"]
    last = sent[-1]
    assert last["eventType"] == "COMPLETE"
    assert [(i["name"], i["facets"]["version"]["datasetVersion"]) for i in last["inputs"]] == [
        ("a", parent.version)
    ]
    (output,) = last["outputs"]
    assert output["namespace"] == str(root) == sent[0]["outputs"][0]["namespace"]
    assert output["facets"]["version"]["datasetVersion"] == child
    assert output["outputFacets"]["outputStatistics"]["rowCount"] == 10
    assert last["run"]["facets"]["shardflow_code"]["codeVersion"] == "test-code"


def test_a_failing_transport_is_a_warning_and_the_version_stands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OPENLINEAGE_URL", "http://127.0.0.1:9")  # discard port: refused
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TIMEOUT", "2")
    root = tmp_path / "catalog"
    with caplog.at_level(logging.WARNING, logger="data_catalog.openlineage_events"):
        version = commit(root, "a", 1)
    assert Catalog(root).exists("a", version)
    assert any("OpenLineage event for a@" in r.getMessage() for r in caplog.records)


def test_a_removed_working_folder_is_no_configuration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert not openlineage_events.configured({})
