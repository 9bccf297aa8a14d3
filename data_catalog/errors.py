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


class ConfigError(ShardflowError):
    """A configuration field holds a value that cannot be used.

    ``field`` is the dataclass field's name; the CLI shows it as its flag (``num_ranks`` as
    ``--np``), a flow run as the parameter.
    """

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field} {problem}")
