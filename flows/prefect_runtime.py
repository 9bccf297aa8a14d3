"""What a flow process changes in how Prefect runs, each because it costs time nobody sees.

    import flows.pipeline ─► long_lived_imports(): Prefect imported without garbage
                             collections, its objects then frozen (~0.1 s of its ~1 s)
                             blocks_on_first_use(): Prefect's notification and webhook
                             blocks loaded when first used, not at import (~0.2 s)
                             logging_settings_on_demand(): Prefect's logging setup reads the
                             three settings its logging.yml names, not all 289 (~0.1 s)
                             heartbeats_without_join(): a flow run's end waits no longer for
                             its heartbeat thread (up to 1 s per flow run)
    each @flow            ─► flows.prefect_flow.flow: its parameter schema made when first
                             read, not when defined (~0.1 s for the five)
                             parameters_as_json(): its parameters sent to the API as JSON
                             without importing FastAPI (~0.1 CPU-s per process)
    after the import      ─► verified_tls_shared(): Prefect's API clients share one verified
                             TLS context per CA file instead of each parsing certifi's
                             bundle again (~0.04 CPU-s a client, three of four per flow run)
    each flow run's start ─► freeze_imports(): once per process, the objects made so far
                             (Prefect's ~150,000 models, settings, modules) leave the garbage
                             collector's care (~0.25 s at the process's exit)

Nothing here changes what a run records in Prefect or shows in its UI (docs/prefect.md, "What
the flow path costs"; docs/STACK.md says what each works around).
"""

from __future__ import annotations

import functools
import gc
import importlib.machinery
import importlib.util
import inspect
import os
import ssl
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from prefect import Flow
    from prefect.settings.base import PrefectBaseSettings

_UNJOINED = "__shardflow_unjoined__"

AnyFlow = TypeVar("AnyFlow", bound="Flow[Any, Any]")


@contextmanager
def long_lived_imports() -> Iterator[None]:
    """Around the imports of Prefect: no garbage collection while they run, and what they
    made frozen (:func:`gc.freeze`) after them.

    Importing Prefect makes about 95,000 objects (its settings, client schemas and blocks are
    pydantic models built at import), all of which live until the process exits: the full
    collections its growth sets off while importing found nothing to free and cost ~0.1 CPU-s
    of the import's ~1.0 (measured: 0.93 against 0.82), and every later full collection would
    walk them again. A collector the process had turned off stays off.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


# Modules Prefect's import runs only to define block classes (``prefect/blocks/__init__.py``
# imports them "to ensure core blocks are registered", and ``prefect/main.py`` the first).
DEFERRED_BLOCK_MODULES = ("prefect.blocks.notifications", "prefect.blocks.webhook")


class _FirstUse:
    """A module in ``sys.modules`` whose code runs when one of its attributes is first asked
    for (PEP 562's module ``__getattr__``), or when :meth:`load` is called.

    Not :class:`importlib.util.LazyLoader`: its module loads on any attribute access, and the
    ``import`` statement itself reads ``__spec__`` (``import_ensure_initialized``), so Prefect's
    own ``import prefect.blocks.notifications`` would load it at once.
    """

    def __init__(self, spec: importlib.machinery.ModuleSpec) -> None:
        self.spec = spec
        self.module = importlib.util.module_from_spec(spec)
        self.lock = threading.RLock()
        self.module.__getattr__ = self.attribute  # type: ignore[method-assign]

    @property
    def loaded(self) -> bool:
        return "__getattr__" not in vars(self.module)

    def load(self) -> None:
        with self.lock:
            if self.loaded:
                return
            del vars(self.module)["__getattr__"]
            assert self.spec.loader is not None
            try:
                self.spec.loader.exec_module(self.module)
            except BaseException:
                # As a failed import leaves it: not in sys.modules.
                sys.modules.pop(self.spec.name, None)
                raise

    def attribute(self, name: str) -> Any:
        self.load()
        return getattr(self.module, name)


@contextmanager
def blocks_on_first_use() -> Iterator[list[str]]:
    """Around the first import of Prefect: its notification and webhook block modules
    (:data:`DEFERRED_BLOCK_MODULES`) run their code when first used instead; yields their
    names (none when Prefect's blocks were imported before).

    Importing Prefect imports them only to define their block classes (SlackWebhook, Twilio,
    Webhook, ...: a dozen pydantic models, each building its JSON schema for the block
    registry), and ``prefect.blocks.webhook`` builds four HTTP transports, two of which load
    the system's CA certificates: ~0.2 of the ~1.0 CPU-s of Prefect's import, in a process
    that never sends a notification. Anything that uses them loads them: an attribute
    (``from prefect.blocks.notifications import SlackWebhook``), or a block looked up by its
    type's slug (``Block.load("slack-webhook/...")``, which calls
    ``load_prefect_collections`` first: after the import, that loads the deferred modules
    before it runs).
    """
    if "prefect.blocks" in sys.modules:
        yield []
        return
    prefect_spec = importlib.util.find_spec("prefect")  # a top-level spec: imports nothing
    locations = list((prefect_spec and prefect_spec.submodule_search_locations) or [])
    blocks = [os.path.join(location, "blocks") for location in locations]
    deferred: list[_FirstUse] = []
    for name in DEFERRED_BLOCK_MODULES:
        # PathFinder, not importlib.util.find_spec: that imports the parent package, whose
        # __init__ imports these modules.
        spec = importlib.machinery.PathFinder.find_spec(name, blocks)
        if spec is None or spec.loader is None:
            continue
        module = _FirstUse(spec)
        sys.modules[name] = module.module
        deferred.append(module)
    try:
        yield [module.spec.name for module in deferred]
    finally:
        if deferred and "prefect.blocks.core" in sys.modules:
            _lookups_load(deferred)


def _lookups_load(deferred: list[_FirstUse]) -> None:
    """Make a block class looked up by its slug find the deferred modules' blocks:
    ``Block.get_block_class_from_key`` calls ``load_prefect_collections()`` first
    (``prefect/blocks/core.py``), so that installed collections can register theirs."""
    from prefect.blocks import core

    # Imported there, not re-exported: mypy refuses the attribute itself.
    collections: Callable[..., Any] = getattr(core, "load_prefect_collections")  # noqa: B009

    @functools.wraps(collections)
    def load_collections(*args: Any, **kwargs: Any) -> Any:
        for module in deferred:
            module.load()
        return collections(*args, **kwargs)

    setattr(core, "load_prefect_collections", load_collections)  # noqa: B010


def logging_settings_on_demand() -> bool:
    """Let Prefect's logging setup serialise only the settings its logging.yml names; whether
    it (now) does. Call it after ``import prefect`` and before ``prefect.main`` (``from prefect
    import flow``), whose import sets logging up.

    Prefect 3.8.8's ``load_logging_config`` (``prefect/logging/configuration.py``) fills the
    ``${NAME}`` placeholders of logging.yml from ``get_current_settings()
    .to_environment_variables(include_aliases=True)``: all 289 settings as environment
    variables, each of its 53 groups serialising its subgroups again (0.07-0.19 s), for the
    three its default file names (PREFECT_LOGGING_LEVEL, PREFECT_SERVER_LOGGING_LEVEL,
    PREFECT_INTERNAL_LOGGING_LEVEL). Here that call gets a mapping that serialises the group
    a name belongs to (the one whose ``env_prefix`` begins it) when the name is asked for, and
    every setting for a name no group gives (an alias): the same values
    (tests/flows/test_prefect_runtime.py compares every name). ``get_current_settings`` is
    replaced only in that module, where only ``load_logging_config`` calls it. A Prefect
    whose module reads settings otherwise is left as it is.
    """
    from prefect.logging import configuration

    current: Callable[[], Any] | None = getattr(configuration, "get_current_settings", None)
    if current is None or not hasattr(configuration, "load_logging_config"):
        return False
    if getattr(current, _ON_DEMAND, False):
        return True

    def settings_for_logging() -> Any:
        assert current is not None
        return _SettingsForLogging(current())

    setattr(settings_for_logging, _ON_DEMAND, True)
    setattr(configuration, "get_current_settings", settings_for_logging)  # noqa: B010
    return True


_ON_DEMAND = "__shardflow_on_demand__"


class _SettingsForLogging:
    """Prefect's settings, their environment variables serialised as they are asked for."""

    def __init__(self, settings: PrefectBaseSettings) -> None:
        self._settings = settings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._settings, name)

    def to_environment_variables(self, **options: Any) -> Mapping[str, str]:
        if options != {"include_aliases": True}:
            return self._settings.to_environment_variables(**options)
        return SettingsEnvironment(self._settings)


class SettingsEnvironment(Mapping[str, str]):
    """``settings.to_environment_variables(include_aliases=True)``, each name's group
    serialised when the name is first asked for."""

    def __init__(self, settings: PrefectBaseSettings) -> None:
        from prefect.settings.base import PrefectBaseSettings

        self._settings = settings
        self._groups: list[tuple[str, PrefectBaseSettings]] = []
        pending = [settings]
        while pending:
            group = pending.pop()
            for field in type(group).model_fields:
                child = getattr(group, field)
                if isinstance(child, PrefectBaseSettings):
                    prefix = str(child.model_config.get("env_prefix") or "").upper()
                    self._groups.append((prefix, child))
                    pending.append(child)
        self._groups.sort(key=lambda named: len(named[0]), reverse=True)
        self._serialised: dict[int, dict[str, str]] = {}

    def _variables(self, group: PrefectBaseSettings) -> dict[str, str]:
        variables = self._serialised.get(id(group))
        if variables is None:
            variables = group.to_environment_variables(include_aliases=True)
            self._serialised[id(group)] = variables
        return variables

    def every(self) -> dict[str, str]:
        return self._variables(self._settings)

    def __getitem__(self, name: str) -> str:
        for prefix, group in self._groups:
            if prefix and name.startswith(prefix):
                variables = self._variables(group)
                if name in variables:
                    return variables[name]
                break
        return self.every()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.every())

    def __len__(self) -> int:
        return len(self.every())


# Prefect's modules that make a verified TLS context for each API client they build, each
# from ``ssl.create_default_context(cafile=...)`` (PrefectClient, SyncPrefectClient, the
# events client's server version check).
TLS_CONTEXT_MODULES = ("prefect.client.orchestration", "prefect._internal.version_checking")


class _VerifiedContextsShared(types.ModuleType):
    """The :mod:`ssl` module as a Prefect module sees it, except that a verified context for
    a CA file is made once (per the file's size and modification time) and shared.

    Only the exact call Prefect makes for a verified context is shared; any other call
    (Prefect's insecure branch calls ``create_default_context()`` and then changes the
    context it gets) makes a new one, as :mod:`ssl` does.
    """

    def __init__(self) -> None:
        super().__init__("ssl", ssl.__doc__)
        self._contexts: dict[tuple[str, int, int], ssl.SSLContext] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(ssl, name)

    def create_default_context(
        self,
        purpose: ssl.Purpose = ssl.Purpose.SERVER_AUTH,
        *,
        cafile: str | None = None,
        capath: str | None = None,
        cadata: str | bytes | None = None,
    ) -> ssl.SSLContext:
        if (
            cafile is None
            or capath is not None
            or cadata is not None
            or purpose != ssl.Purpose.SERVER_AUTH
        ):
            return ssl.create_default_context(purpose, cafile=cafile, capath=capath, cadata=cadata)
        stat = os.stat(cafile)  # a missing file fails here as it would in ssl
        key = (os.path.realpath(cafile), stat.st_size, stat.st_mtime_ns)
        with self._lock:
            context = self._contexts.get(key)
            if context is None:
                context = ssl.create_default_context(purpose, cafile=cafile)
                self._contexts[key] = context
        return context


def verified_tls_shared() -> list[str]:
    """Let Prefect's API clients in this process share one verified TLS context per CA file;
    the modules (of :data:`TLS_CONTEXT_MODULES`) that now do. Call it after Prefect's import.

    Prefect 3.8.8 builds a new ``ssl.create_default_context(cafile=certifi.where())`` for each
    client it makes (``PrefectClient.__init__``, ``SyncPrefectClient.__init__``,
    ``check_server_version``): each parses certifi's ~150 CA certificates, 0.04 CPU-s, and a
    flow run makes four (its engine's synchronous client, the asynchronous clients of Prefect's
    log and events workers, the events client's version check), whatever the API's scheme. A
    context that verifies is shared safely: Prefect does not change it after making it, and
    httpcore, which sets each connection's ALPN protocols on it before the handshake, already
    shares its own default context between clients. A changed CA file (its size or time)
    gets a new context; ``PREFECT_API_TLS_INSECURE_SKIP_VERIFY`` still makes a new unverified
    context each time.
    """
    shared = _VerifiedContextsShared()
    patched: list[str] = []
    for name in TLS_CONTEXT_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue
        current = getattr(module, "ssl", None)
        if isinstance(current, _VerifiedContextsShared):
            patched.append(name)
        elif current is ssl:
            setattr(module, "ssl", shared)  # noqa: B010
            patched.append(name)
    return patched


def heartbeats_without_join() -> bool:
    """Let a synchronous flow run end without waiting for its heartbeat thread; whether
    Prefect's engine is (now) so.

    Prefect 3.8.8's flow heartbeat thread (``prefect/flow_engine.py``, ``_send_heartbeats``,
    every 180 s by default) sleeps in 1 s steps between its checks of a stop event, and the
    synchronous engine joins it (``join_on_exit=True``, up to 2 s) when the flow function has
    returned: every flow run ended 0-1 s late (0.5 s on average; the pipeline flow four times,
    its three stage flows and itself), with nothing to do. The asynchronous engine already
    leaves the thread with ``join_on_exit=False``: set, the stop event ends the daemon thread
    at its next check, and it sends nothing after (it checks the event before each heartbeat).
    Heartbeats themselves stay on: they are how a server's automation notices a crashed run.

    A Prefect whose ``_send_heartbeats`` takes no ``join_on_exit`` is left as it is.
    """
    from prefect import flow_engine

    joining: Callable[..., AbstractContextManager[None]] = flow_engine._send_heartbeats
    if getattr(joining, _UNJOINED, False):
        return True
    if "join_on_exit" not in inspect.signature(joining).parameters:
        return False

    @contextmanager
    def unjoined(engine: Any, join_on_exit: bool = True) -> Iterator[None]:
        with joining(engine, join_on_exit=False):
            yield

    setattr(unjoined, _UNJOINED, True)
    flow_engine._send_heartbeats = unjoined  # the engine looks it up by name at each flow run
    return True


@functools.cache
def freeze_imports() -> None:
    """Once per process, at a flow run's start: move every object the garbage collector
    tracks so far into its permanent generation (:func:`gc.freeze`).

    By then the process holds Prefect's imported modules, its pydantic models and settings
    (about 150,000 tracked objects against 40,000 for the CLI): objects that live until the
    process exits. Python's finalisation runs full collections over all of them: a process
    that imported Prefect took ~0.3 s to exit against ~0.03 s frozen, and each full collection
    during the run walked them too. Objects made afterwards (the stage's own) are collected as
    before; garbage cycles already made by then (import-time leftovers) are never freed, a
    bounded cost paid once.
    """
    gc.freeze()


def parameters_as_json(flow: AnyFlow) -> AnyFlow:
    """``flow``, its parameters turned into JSON for the API by pydantic-core
    (``to_jsonable_python``) instead of FastAPI's ``jsonable_encoder``.

    Prefect 3.8.8 serialises a flow run's parameters (``Flow.serialize_parameters``, when it
    creates the run) with ``from fastapi.encoders import jsonable_encoder``: the first flow run
    of a process imports all of FastAPI (its applications, routing and OpenAPI models), ~0.1
    CPU-s, for nothing else. Our flows' parameters are strings, numbers, None and the frozen
    config dataclasses (``ClusterConfig``, ``JobOptions``, ``TrainConfig``, ...), which both
    encoders turn into the same JSON (tests/flows/test_flows.py). A value pydantic-core cannot
    encode, a future or a state, goes to Prefect's own method as before.
    """
    from prefect.client.schemas.objects import State
    from prefect.futures import PrefectFuture
    from pydantic_core import to_jsonable_python

    prefects = flow.serialize_parameters

    def serialize(parameters: dict[str, Any]) -> dict[str, Any]:
        if any(isinstance(value, (PrefectFuture, State)) for value in parameters.values()):
            return prefects(parameters)
        try:
            return {key: to_jsonable_python(value) for key, value in parameters.items()}
        except (TypeError, ValueError):  # PydanticSerializationError is a ValueError
            return prefects(parameters)

    # An attribute of this flow object only: any other flow keeps Prefect's method.
    setattr(flow, "serialize_parameters", serialize)  # noqa: B010  (mypy refuses a method assigned)
    return flow
