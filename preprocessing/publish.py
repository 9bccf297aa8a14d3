"""The one way a preprocessing job publishes its processed version: the staged shards with the
typed layout (:class:`data_catalog.layout.ProcessedLayout`) that training reads back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from data_catalog import FileEntry, Manifest, ParentRef, Staging
from data_catalog.layout import ProcessedLayout, SplitLayout
from preprocessing.plan import SplitPlan


def split_layouts(plans: Sequence[SplitPlan]) -> dict[str, SplitLayout]:
    """Each planned split's layout, by split name."""
    return {plan.split: plan.layout() for plan in plans}


def commit_processed(
    stage: Staging,
    *,
    code: str,
    layout: ProcessedLayout,
    parents: Sequence[ParentRef],
    parameters: Mapping[str, Any],
    described: Mapping[str, FileEntry],
) -> Manifest:
    """Commit ``stage`` with ``layout`` as its manifest's schema and statistics; its rows are
    the splits' rows. ``code``: the fingerprint of the job's code (preprocessing.fingerprint).
    ``described``: the shards as their writers hashed and counted them."""
    return stage.commit(
        code_version=code,
        parents=parents,
        parameters=parameters,
        **layout.to_manifest(),
        rows=layout.rows,
        described=described,
    )
