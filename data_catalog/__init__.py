"""shardflow's catalog: every dataset and model an immutable, verifiable version with lineage.

The lowest layer of shardflow; it imports none of the other packages and never Prefect. See
README.md in this folder for the commit protocol and the on-disk layout.

Local POSIX filesystems only for now. Object storage (fsspec/S3) needs a different commit step:
there is no atomic directory rename and no ``flock``, so a version would be published by writing
its manifest last with a conditional put, and the per-dataset lock would move to the index.
"""

from data_catalog.catalog import Catalog, Problem, Staging
from data_catalog.errors import CatalogError, InvalidName, NotFound, ShardflowError
from data_catalog.identity import code_version, version_id
from data_catalog.manifest import FORMAT_VERSION, FileEntry, Manifest, ParentRef
from data_catalog.names import KINDS, validate_name

__all__ = [
    "FORMAT_VERSION",
    "KINDS",
    "Catalog",
    "CatalogError",
    "FileEntry",
    "InvalidName",
    "Manifest",
    "NotFound",
    "ParentRef",
    "Problem",
    "ShardflowError",
    "Staging",
    "code_version",
    "validate_name",
    "version_id",
]
