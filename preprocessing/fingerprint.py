"""The code of each stage that writes dataset versions: what their ids depend on besides their
inputs and parameters.

    stage module (preprocessing.sdss, preprocessing.sources.exports, ...)
        │ every module of this package it imports, directly or through others
        │ (not ORCHESTRATION: modules that plan, run and report tasks but write no byte)
        ▼
    sha256 of their source + the versions of LIBRARIES + the folder layout
    (data_catalog.layout.FOLDER_LAYOUT) ──► "src-<16 hex>", the version's code

A change to docs, tests, training/, the CLI or the driver changes no dataset id; a change to
the SDSS feature code (preprocessing/sdss.py) changes the processed ids and not the raw ones.
tests/preprocessing/test_fingerprints.py checks that every module whose code runs while a stage
writes its files is in its fingerprint or named here, and that a stage's bytes do not change
while its fingerprint stays the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from data_catalog.identity import source_fingerprint
from data_catalog.layout import FOLDER_LAYOUT

# They decide where and when tasks run, validate options or watch progress; what each task
# writes is decided by the stage's own modules. (A module here that starts to shape bytes must
# leave this list: the test above runs every stage and compares its bytes.)
ORCHESTRATION = (
    "preprocessing.driver",
    "preprocessing.cluster",
    "preprocessing.config",
    "preprocessing.datasets",
    "preprocessing.jobs",
    "preprocessing.verify_processed",
    "preprocessing.work_gc",
    "preprocessing.fingerprint",
    "preprocessing.input_check",
    "preprocessing.sources.task_progress",
)
# What writes or encodes the bytes: Parquet and Arrow IPC (pyarrow), arrays (numpy), the
# Petastorm codec and metadata (petastorm), FITS and VOTable parsing (astropy).
LIBRARIES = ("numpy", "pyarrow", "petastorm", "astropy")


@functools.cache
def stage_code(module: str) -> str:
    """The fingerprint of the stage whose tasks live in ``module``."""
    # The folder layout decides where every file of the version goes (split=train/ or train/,
    # _manifest.json or manifest.json): a version in a new layout gets a new id.
    return source_fingerprint(
        (module,),
        within=("preprocessing",),
        exclude=ORCHESTRATION,
        libraries=LIBRARIES,
        facts={"folder_layout": FOLDER_LAYOUT},
    )


def code_of(fn: Callable[..., Any]) -> str:
    """The fingerprint of the stage a task function belongs to."""
    return stage_code(fn.__module__)


def stage_codes(modules: Sequence[str]) -> dict[str, str]:
    """:func:`stage_code` of each of ``modules`` (what a Dask worker is asked, to compare)."""
    return {module: stage_code(module) for module in modules}
