"""The code that makes a model version: the rank program and every module of this package it
imports (the models, the input, the optimizer's set-up), with the versions of the libraries
that compute the weights. A model version's id depends on it, never on the repository's commit:
a change to docs, the CLI or preprocessing/ changes no model id.
"""

from __future__ import annotations

import functools

from data_catalog.identity import source_fingerprint

# tensorflow-cpu on CPU hosts, tensorflow on GPU hosts: one library under two names.
LIBRARIES = ("numpy", "tensorflow-cpu|tensorflow", "horovod", "keras")


@functools.cache
def model_code() -> str:
    """The fingerprint of the code every rank runs (``python -m training.worker``)."""
    return source_fingerprint(("training.worker",), within=("training",), libraries=LIBRARIES)
