"""What the catalog accepts as dataset names, version ids and kinds.

Names and versions become directory names, so they are checked before any path is built from
them: a name like ``../x`` must never reach the filesystem.
"""

from __future__ import annotations

import re

from data_catalog.errors import CatalogError, InvalidName

NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
VERSION_PATTERN = re.compile(r"[0-9a-f]{16}")
# A shorter hex prefix may select a version, as git does with commits.
VERSION_PREFIX_PATTERN = re.compile(r"[0-9a-f]{1,16}")
KINDS = ("raw", "processed", "model")


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid dataset name, else raise :class:`InvalidName`."""
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        raise InvalidName(
            f"invalid dataset name {name!r}: use lowercase letters, digits, '-' and '_' "
            "(1 to 64 characters, starting with a letter or digit)"
        )
    return name


def validate_version_prefix(version: str) -> str:
    """Return ``version`` if it is a version id or a prefix of one, else raise InvalidName."""
    if not isinstance(version, str) or VERSION_PREFIX_PATTERN.fullmatch(version) is None:
        raise InvalidName(
            f"invalid version {version!r}: a version is up to 16 lowercase hex digits; "
            "see `shardflow catalog list`"
        )
    return version


def validate_version(version: str) -> str:
    """Return ``version`` if it is a full 16-hex-digit version id, else raise InvalidName."""
    if not isinstance(version, str) or VERSION_PATTERN.fullmatch(version) is None:
        raise InvalidName(f"invalid version {version!r}: a version id is 16 lowercase hex digits")
    return version


def processed_name(dataset: str) -> str:
    """The catalog name of a dataset's processed versions."""
    return f"{dataset}-processed"


def model_name(dataset: str, model: str) -> str:
    """The catalog name of the versions of ``model`` trained on ``dataset``."""
    return f"{dataset}-{model}"


def validate_kind(kind: str) -> str:
    """Return ``kind`` if it is one of :data:`KINDS`, else raise :class:`CatalogError`."""
    if kind not in KINDS:
        raise CatalogError(f"invalid kind {kind!r}: use one of {', '.join(KINDS)}")
    return kind
