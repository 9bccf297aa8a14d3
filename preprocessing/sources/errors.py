"""The error every source raises for input it cannot read or that does not hold what it should."""

from data_catalog.errors import ShardflowError


class SourceError(ShardflowError):
    """A source cannot be read or does not hold what it should; the message names it."""
