"""Prefect's ``@flow``, each flow's parameter schema made when something first reads it.

Prefect 3.8.8's ``Flow.__init__`` builds ``self.parameters`` (``parameter_schema(fn)``,
``prefect/flows.py:363``) when the flow is defined: a pydantic model of the function's
signature turned into an OpenAPI schema, its docstring parsed by griffe. ``flows.pipeline``
defines five flows; a process runs one of them and never reads a schema: running a flow
validates its parameters with ``ValidatedFunction`` (still built at definition, so a signature
pydantic refuses still fails there), and deploying one builds the deployment's schema afresh
from the function (``parameter_schema(flow)`` in ``prefect/deployments/runner.py`` and
``prefect/cli/deploy/_core.py``). Defining the five took ~0.1 CPU-s of a flow process's start,
~0.02 here (docs/prefect.md, "Two more pieces of the import"). A flow made here is Prefect's
Flow in every other way, and ``flow.parameters`` gives the same schema, made on first read.

Only ``Flow.__init__`` calls ``prefect.flows.parameter_schema``; the replacement below skips it
while, in this thread, a flow of this module is being defined, and calls Prefect's otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

# Not `from prefect import Flow`: that imports prefect.main, which sets logging up
# (flows.prefect_runtime.logging_settings_on_demand comes after this import).
from prefect import flows as prefect_flows
from prefect.flows import Flow
from prefect.utilities.callables import ParameterSchema
from prefect.utilities.callables import parameter_schema as _prefects_schema

P = ParamSpec("P")
R = TypeVar("R")

_defining = threading.local()


def _schema_unless_deferred(fn: Callable[..., Any]) -> ParameterSchema:
    if getattr(_defining, "deferred", False):
        return None  # type: ignore[return-value]  # SchemaOnFirstRead.parameters makes it
    return _prefects_schema(fn)


class SchemaOnFirstRead(Flow[P, R]):
    """A Prefect flow whose ``parameters`` (its parameter schema) is made when first read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _defining.deferred = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            _defining.deferred = False

    @property
    def parameters(self) -> ParameterSchema:
        # Not made yet: None (also in a copy unpickled elsewhere, where an identity marker
        # would not survive).
        schema = self.__dict__.get("parameters")
        if not isinstance(schema, ParameterSchema):
            schema = self.__dict__["parameters"] = _prefects_schema(self.fn)
        return schema

    @parameters.setter
    def parameters(self, schema: ParameterSchema) -> None:
        self.__dict__["parameters"] = schema


def flow(*, name: str, **options: Any) -> Callable[[Callable[P, R]], Flow[P, R]]:
    """``@flow(name=..., ...)`` as Prefect's, making a :class:`SchemaOnFirstRead`."""

    def define(fn: Callable[P, R]) -> Flow[P, R]:
        return SchemaOnFirstRead(fn=fn, name=name, **options)

    return define


# Prefect looks the function up in its module at each flow's definition (imported there from
# prefect.utilities.callables, not re-exported: mypy refuses the attribute itself).
if getattr(prefect_flows, "parameter_schema") is _prefects_schema:  # noqa: B009
    setattr(prefect_flows, "parameter_schema", _schema_unless_deferred)  # noqa: B010
