"""The seed papers' experiments, each one command on shardflow's own pipeline.

request (quick or full, results folder) ─ Experiment.run ─ Pipeline.prepare (ingest +
preprocess: a raw and a processed catalog version) ─ Pipeline.train (a model version per run)
─ report.md, results.json and PNG plots in the results folder

An experiment is one module of this package that defines ``EXPERIMENT``: adding a module adds
the experiment to :data:`EXPERIMENTS` (and so to ``shardflow experiment --help``). The pipeline
is handed in by the caller (``flows.commands.experiment`` wires it to the CLI's stages), so
this package needs neither Prefect nor preprocessing.
"""

from __future__ import annotations

import importlib
import pkgutil

from lab.experiments.base import Experiment, ExperimentRequest, Pipeline, Prepared, Sample

__all__ = [
    "EXPERIMENTS",
    "Experiment",
    "ExperimentRequest",
    "Pipeline",
    "Prepared",
    "Sample",
    "experiment",
]

# Modules of this package that hold the shared machinery, not an experiment.
_MACHINERY = frozenset({"base", "report", "sources"})


def _discover() -> dict[str, Experiment]:
    found: dict[str, Experiment] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if module in _MACHINERY:
            continue
        defined = importlib.import_module(f"{__name__}.{module}").EXPERIMENT
        assert isinstance(defined, Experiment), f"{module}.EXPERIMENT is not an Experiment"
        assert defined.name not in found, f"two experiments named {defined.name}"
        found[defined.name] = defined
    return found


EXPERIMENTS: dict[str, Experiment] = _discover()


def experiment(name: str) -> Experiment:
    """The experiment called ``name``; KeyError names the known ones."""
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}") from None
