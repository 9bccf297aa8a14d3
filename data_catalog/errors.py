"""Errors a user can act on.

Every package raises subclasses of :class:`ShardflowError` for bad input; the CLI prints the
message as one line on stderr and exits non-zero. Anything else is a bug and keeps its traceback.
"""


class ShardflowError(Exception):
    """Bad input or state that the user can fix; the message says how."""


class CatalogError(ShardflowError):
    """The catalog cannot do what was asked: bad manifest, bad staged files, bad kind."""


class InvalidName(CatalogError):
    """A dataset name or version id that the catalog does not accept."""


class NotFound(CatalogError):
    """The named dataset or version is not committed in the catalog."""
