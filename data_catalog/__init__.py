"""shardflow's catalog: every dataset and model an immutable, verifiable version with lineage.

The lowest layer of shardflow; it imports none of the other packages and never Prefect. See
README.md in this folder for the commit protocol and the on-disk layout.

A root is a local POSIX directory (fsync, atomic rename, ``flock``) or the URL of any fsspec
filesystem (``s3://``, ``gs://``, ``hdfs://``, ``memory://``). Object storage has no atomic
rename and no ``flock``, so there a version is published by uploading its files and then writing
its manifest last with one conditional PUT; content-derived version ids make concurrent writers
of one version harmless. See README.md, "Object storage", and docs/catalog-storage.md.
"""

from data_catalog.catalog import Catalog, Problem, Staging
from data_catalog.errors import CatalogError, ConfigError, InvalidName, NotFound, ShardflowError
from data_catalog.identity import code_version, derived_version, version_id
from data_catalog.manifest import FORMAT_VERSION, FileEntry, Manifest, ParentRef
from data_catalog.names import KINDS, model_name, processed_name, validate_name

__all__ = [
    "FORMAT_VERSION",
    "KINDS",
    "Catalog",
    "CatalogError",
    "ConfigError",
    "FileEntry",
    "InvalidName",
    "Manifest",
    "NotFound",
    "ParentRef",
    "Problem",
    "ShardflowError",
    "Staging",
    "code_version",
    "derived_version",
    "model_name",
    "processed_name",
    "validate_name",
    "version_id",
]
