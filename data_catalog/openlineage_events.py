"""An OpenLineage run event for every committed version, through ``openlineage-python``.

```
Staging.commit ──► Catalog._publish ──► manifest written ──► emit_committed(catalog url, manifest)
                                                               │ configured? (below) else nothing
                                                               ▼
     RunEvent COMPLETE  job  shardflow / <stage>.<name>        (stage: ingest, preprocess, train)
                        inputs  every parent: <name>, version facet
                        outputs the new version: schema, outputStatistics (rows, bytes, files),
                                version facet; run facets: processing_engine, shardflow_code
     ──► the client's transport: HTTP (Marquez, DataHub), file, console, Kafka, ...
```

Configured the client's standard way: ``OPENLINEAGE_URL`` (HTTP), an ``openlineage.yml``
(``OPENLINEAGE_CONFIG``, the working directory, ``~/.openlineage/``), or
``OPENLINEAGE__TRANSPORT__*`` variables; ``OPENLINEAGE_DISABLED=true`` turns it off. With none
of these nothing is sent: the client itself would fall back to printing every event on the
console with a warning, which no user asked for. Datasets are named as the catalog names them
(namespace: the catalog's URL; name: the dataset's name; the version in the ``version`` facet),
so the output of one stage is the input of the next and a lineage server links the runs. A
transport that fails is a warning: the version is committed either way.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_catalog.manifest import Manifest

if TYPE_CHECKING:
    from openlineage.client.client import OpenLineageClient

log = logging.getLogger(__name__)

JOB_NAMESPACE = "shardflow"
STAGE_OF_KIND = {"raw": "ingest", "processed": "preprocess", "model": "train"}
# A URI that names the producer (the spec asks for one; a URN needs no web page).
PRODUCER = "urn:shardflow:data_catalog"

_clients: dict[str, OpenLineageClient] = {}


def configured(environ: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """Whether the user configured an OpenLineage transport the client's standard ways."""
    env = os.environ if environ is None else environ
    if env.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OPENLINEAGE_URL") or env.get("OPENLINEAGE_CONFIG"):
        return True
    if any(key.startswith("OPENLINEAGE__TRANSPORT") for key in env):
        return True
    # The client's own search path for openlineage.yml (OpenLineageClient._find_yaml_config_path).
    try:
        candidates = (
            Path.cwd() / "openlineage.yml",
            Path("~/.openlineage/openlineage.yml").expanduser(),
        )
        return any(path.is_file() for path in candidates)
    except (OSError, RuntimeError):  # a removed working folder, no home: no file there
        return False


def emit_committed(catalog_url: str, manifest: Manifest) -> bool:
    """Send the run event of a version just committed; False when lineage is not configured
    or the transport failed (logged as a warning)."""
    if not configured():
        return False
    try:
        from openlineage.client.client import OpenLineageClient
    except ImportError:
        log.warning(
            "OpenLineage is configured but openlineage-python is not installed "
            "(pip install 'shardflow[lineage]'); no lineage event for %s",
            manifest.ref,
        )
        return False
    key = os.environ.get("OPENLINEAGE_URL", "") + os.environ.get("OPENLINEAGE_CONFIG", "")
    try:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = OpenLineageClient()
        client.emit(run_event(catalog_url, manifest))
    except Exception as exc:  # any transport's failure: the commit stands
        log.warning(
            "OpenLineage event for %s not sent: %s", manifest.ref, " ".join(str(exc).split())
        )
        return False
    return True


def run_event(catalog_url: str, manifest: Manifest) -> Any:
    """The COMPLETE run event of ``manifest``'s commit (an ``openlineage`` ``RunEvent``)."""
    from openlineage.client.event_v2 import (
        InputDataset,
        Job,
        OutputDataset,
        Run,
        RunEvent,
        RunState,
    )
    from openlineage.client.facet_v2 import (
        dataset_version_dataset,
        output_statistics_output_dataset,
        processing_engine_run,
    )
    from openlineage.client.uuid import generate_new_uuid

    inputs = [
        InputDataset(
            namespace=catalog_url,
            name=parent.name,
            facets={"version": dataset_version_dataset.DatasetVersionDatasetFacet(parent.version)},
        )
        for parent in manifest.parents
    ]
    facets: dict[str, Any] = {
        "version": dataset_version_dataset.DatasetVersionDatasetFacet(manifest.version)
    }
    schema = _schema_facet(manifest)
    if schema is not None:
        facets["schema"] = schema
    output = OutputDataset(
        namespace=catalog_url,
        name=manifest.name,
        facets=facets,
        outputFacets={
            "outputStatistics": output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
                rowCount=manifest.rows,
                size=sum(entry.bytes for entry in manifest.files),
                fileCount=len(manifest.files),
            )
        },
    )
    run_facets: dict[str, Any] = {
        "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
            version=_shardflow_version(), name="shardflow"
        ),
        "shardflow_code": _code_facet(manifest),
    }
    return RunEvent(
        eventType=RunState.COMPLETE,
        eventTime=manifest.created,
        run=Run(runId=str(generate_new_uuid()), facets=run_facets),
        job=Job(
            namespace=JOB_NAMESPACE,
            name=f"{STAGE_OF_KIND.get(manifest.kind, manifest.kind)}.{manifest.name}",
        ),
        inputs=inputs,
        outputs=[output],
        producer=PRODUCER,
    )


def _schema_facet(manifest: Manifest) -> Any:
    """The columns of the version's tables: from the recorded Arrow schema (name: type per
    line, processed versions), else the recorded column names (raw tables); None for files
    that are not tables (IDX, a model)."""
    from openlineage.client.facet_v2 import schema_dataset

    arrow = manifest.schema.get("arrow_schema")
    fields: list[Any] = []
    if isinstance(arrow, str):
        for line in arrow.splitlines():
            name, sep, kind = line.partition(": ")
            if sep and not line.startswith((" ", "-")):
                fields.append(schema_dataset.SchemaDatasetFacetFields(name=name, type=kind.strip()))
    else:
        columns = manifest.schema.get("columns")
        if isinstance(columns, dict):
            columns = list(columns)
        if isinstance(columns, list):
            fields = [schema_dataset.SchemaDatasetFacetFields(name=str(c)) for c in columns]
    return schema_dataset.SchemaDatasetFacet(fields=fields) if fields else None


def _code_facet(manifest: Manifest) -> Any:
    """The fingerprint of the code that made the version's bytes, and the checkout it ran
    from: a run facet of shardflow's own (the base RunFacet schema)."""
    import attr
    from openlineage.client.generated.base import RunFacet

    @attr.define
    class ShardflowCodeRunFacet(RunFacet):
        codeVersion: str  # OpenLineage's camelCase
        checkout: str | None = None
        parameters: dict[str, Any] = attr.field(factory=dict)

    checkout = manifest.extra.get("run", {}).get("checkout")
    return ShardflowCodeRunFacet(
        codeVersion=manifest.code_version,
        checkout=checkout if isinstance(checkout, str) else None,
        parameters=manifest.parameters,
    )


def _shardflow_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardflow")
    except PackageNotFoundError:
        return "unknown"
