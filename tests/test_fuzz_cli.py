"""Fuzz runs (issue #13): every command's flags with random strings and numbers, and the source
readers with random and damaged bytes.

- The CLI, in this process (``flows.cli.main``) against a temporary SHARDFLOW_HOME: never exit
  2 ("internal error"), never a traceback without --debug, and a failure ends with one
  ``shardflow...`` line. Nothing heavy runs: stages run their tasks serially in this process
  on a 50-image dataset, and what would start horovodrun, a Prefect server, a benchmark or a
  SkyServer query is replaced by a stand-in that refuses in one line, after every option has
  been parsed and checked.
- The readers (IDX, CSV / FITS / VOTable exports, CIFAR-10 pickles): a result, or one of the
  project's ShardflowError subclasses; never anything else.

The cases run are counted and printed at the end of the module (``-s`` shows them) and written
to ``$SHARDFLOW_FUZZ_REPORT`` when it is set.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import pickle
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_catalog import Catalog
from data_catalog.errors import ShardflowError
from flows import cli
from preprocessing import datasets
from preprocessing.sources import cifar10, exports, idx, mnist
from preprocessing.sources.errors import SourceError
from tests.conftest import write_idx_set

CASES: Counter[str] = Counter()
CLI_EXAMPLES = 600
READER_EXAMPLES = 300


@pytest.fixture(scope="module", autouse=True)
def report_cases() -> Iterator[None]:
    yield
    total = sum(CASES.values())
    line = f"fuzz cases run: {total} ({', '.join(f'{k} {v}' for k, v in sorted(CASES.items()))})"
    print("\n" + line)
    report = os.environ.get("SHARDFLOW_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({"total": total, **CASES}, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# The CLI


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command (``("catalog", "show")`` for nested ones) with its parser."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for name, sub in _subcommands(cli.build_parser()).items():
        nested = _subcommands(sub)
        if nested:
            found.update({(name, action): p for action, p in nested.items()})
        else:
            found[(name,)] = sub
    return found


COMMANDS = _commands()


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest not in ("help", "debug")]


def _positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not a.option_strings and a.dest != "help"]


# What a hostile or careless user types: numbers out of every range, non-finite numbers, the
# wrong kind of text, addresses half-written.
AWKWARD = [
    "nan", "NaN", "inf", "-inf", "Infinity", "1e999", "-1e999", "1e-320", "-0", "0", "1", "-1",
    "2", "64", "0.5", "1.5", "1_000", "0x10", "٣", "", " ", "\t", "--", "-", "=",
    "99999999999999999999999", "-99999999999999999999999", "1GB", "100MB", "0B", "12 GiB",
    "tcp://", "tcp://127.0.0.1:8786", "tcp://127.0.0.1:99999", "tcp://[::1]:8786",
    "tcp://[::1", "localhost", "localhost:", ":8786", "http://127.0.0.1:1", "inproc://x",
    "ucx://h:1", "localhost:0", "host:slots", "a:1,b:x", "localhost:-1", "../..", "/", ".",
    "~", "~nobody/x", "é", "x" * 300,
]  # fmt: skip
# No NUL (argv cannot hold one); no lone surrogates (hypothesis leaves them out by default).
TEXT = st.text(st.characters(blacklist_characters="\x00"), max_size=24)
VALUES = st.one_of(
    st.sampled_from(AWKWARD),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    TEXT,
)


@st.composite
def _argv(draw: st.DrawFn, paths: dict[str, str]) -> list[str]:
    command = draw(st.sampled_from(sorted(COMMANDS)))
    parser = COMMANDS[command]
    argv = list(command)
    for positional in _positionals(parser):
        if positional.choices is not None and draw(st.integers(0, 9)):
            argv.append(draw(st.sampled_from(sorted(positional.choices))))
        elif positional.nargs == "?" and draw(st.booleans()):
            continue
        else:
            argv.append(draw(st.one_of(st.sampled_from(["mnist@", "@", "sdss@latest"]), TEXT)))
    flags = _flags(parser)
    for action in draw(st.lists(st.sampled_from(flags), max_size=5)) if flags else []:
        flag = draw(st.sampled_from(action.option_strings))
        if action.nargs == 0:
            argv.append(flag)
            continue
        if action.dest == "source" and command == ("ingest",):
            continue  # chosen below, from paths that fail fast or hold 50 images
        if action.dest in ("out", "hostfile", "ssh_identity_file") and draw(st.booleans()):
            value = draw(st.sampled_from(sorted(paths.values())))
        elif action.choices is not None and draw(st.integers(0, 3)):
            value = draw(st.sampled_from(sorted(action.choices)))
        else:
            value = draw(VALUES)
        argv.append(f"{flag}={value}")
    if command == ("ingest",) and (argv[1] != "sdss" or draw(st.booleans())):
        # Never the default sources (the network), never an fsspec URL (s3:// asks AWS).
        source = draw(
            st.one_of(st.sampled_from(sorted(paths.values())), TEXT.filter(lambda t: ":" not in t))
        )
        argv.append(f"--source={source}")
    if draw(st.integers(0, 30)) == 0:
        argv.append(draw(st.sampled_from(["--help", "--no-such-flag", "-x"])))
    return argv


class _NotLaunched(ShardflowError):
    """What the stand-ins for heavy work raise, once every option was checked."""


def _refuse(*_args: Any, **_kwargs: Any) -> Any:
    raise _NotLaunched("fuzz: stopped before heavy work")


@contextmanager
def _refusing_context(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    raise _NotLaunched("fuzz: stopped before the Prefect server")
    yield


@pytest.fixture(scope="module")
def fuzz_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A home with a 50-image fashion-mnist raw version, and paths to hand to --source, --out
    and the like: a folder of 50 images, a missing path, a file, a read-only spot."""
    root = tmp_path_factory.mktemp("fuzz-cli")
    rng = np.random.default_rng(0)

    def images(n: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
        return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), (np.arange(n) % 10).astype(
            np.uint8
        )

    tiny = write_idx_set(root / "tiny", {"train": images(40), "test": images(10)})
    home = root / "home"
    home.mkdir()
    mnist.ingest(Catalog(str(home / "catalog")), "fashion-mnist", source=str(tiny))
    a_file = root / "a-file"
    a_file.write_text("x\n")
    return {
        "home": home,
        "cwd": root / "cwd",
        "tiny": tiny,
        "missing": root / "missing" / "deeper",
        "file": a_file,
        "below-file": a_file / "below",
        "proc": Path("/proc/version"),
    }


@pytest.fixture
def light(monkeypatch: pytest.MonkeyPatch, fuzz_home: dict[str, Path]) -> None:
    """Stages run serially in this process; whatever would launch heavy work refuses."""
    import flows.commands.bench as bench_commands
    import flows.commands.server as server_commands
    import flows.prefect_server
    import preprocessing.cluster
    import training.launcher
    from preprocessing.driver import serial_runner
    from preprocessing.sources import sdss

    cwd = fuzz_home["cwd"]
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)  # relative --out and --source land here
    monkeypatch.setenv("SHARDFLOW_HOME", str(fuzz_home["home"]))
    for name in ("SHARDFLOW_CATALOG", "SHARDFLOW_CATALOG_URL", "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(preprocessing.cluster, "dask_runner", lambda *_a, **_k: serial_runner())
    monkeypatch.setattr(training.launcher, "train", _refuse)
    monkeypatch.setattr(flows.prefect_server, "api_for_this_command", _refusing_context)
    monkeypatch.setattr(sdss._SkyServer, "fetch", _refuse)
    for name, (_measure, text) in list(bench_commands.BENCHMARKS.items()):
        monkeypatch.setitem(bench_commands.BENCHMARKS, name, (_refuse, text))
    # An experiment runs namespaced hosts, probes and training: its arguments are checked,
    # its run refuses.
    from dataclasses import replace

    from lab.experiments import EXPERIMENTS

    for name, chosen in list(EXPERIMENTS.items()):
        monkeypatch.setitem(EXPERIMENTS, name, replace(chosen, run=_refuse))
    monkeypatch.setattr(
        server_commands,
        "subprocess",
        SimpleNamespace(
            run=_refuse,
            Popen=_refuse,
            DEVNULL=subprocess.DEVNULL,
            PIPE=subprocess.PIPE,
            STDOUT=subprocess.STDOUT,
            TimeoutExpired=subprocess.TimeoutExpired,
        ),
    )
    real_dataset = datasets.dataset

    class BoundedSynth:
        """The dataset, but synth only writes small SDSS requests (the image pools are big)."""

        def __init__(self, name: str) -> None:
            self.name, self.real = name, real_dataset(name)

        def __getattr__(self, attribute: str) -> Any:
            return getattr(self.real, attribute)

        def synth(self, request: Any) -> Any:
            if self.name == "sdss" and 0 < request.rows <= 300 and 0 < (request.files or 1) <= 3:
                return self.real.synth(request)
            return _refuse()

    monkeypatch.setattr(datasets, "dataset", BoundedSynth)


@settings(
    max_examples=CLI_EXAMPLES,
    deadline=None,
    # The same cases on every run: a red `make test` must be reproducible, not the luck of a
    # draw. A case it finds becomes a test of its own (tests/e2e/test_hardening.py).
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_command_lines_are_one_line_errors_never_internal(
    data: st.DataObject,
    light: None,
    fuzz_home: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = data.draw(_argv({k: str(v) for k, v in fuzz_home.items() if k != "home"}))
    CASES["cli"] += 1
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse: usage errors (1) and --help (0)
        code = exit_.code if isinstance(exit_.code, int) else 1
    _out, err = capsys.readouterr()
    shown = f"argv={argv!r}\nexit {code}\nstderr:\n{err[-2000:]}"
    assert code in (0, 1), shown
    assert "Traceback" not in err and "internal error" not in err, shown
    if code == 1:
        lines = err.strip().splitlines()
        assert lines and lines[-1].startswith("shardflow"), shown


# ---------------------------------------------------------------------------------------------
# The readers


def _damage(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` with bytes overwritten, cut short or extended: the likely damage."""

    def damaged(edits: list[tuple[int, int]], length: int) -> bytes:
        data = bytearray(valid + bytes(16))[:length]
        for position, value in edits:
            if position < len(data):
                data[position] = value
        return bytes(data)

    return st.builds(
        damaged,
        st.lists(st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)), max_size=6),
        st.integers(0, len(valid) + 16),
    )


def _refused_or_read(call: Any) -> Any:
    try:
        return call()
    except ShardflowError as exc:
        assert str(exc), "an error without a message"
        return exc


IDX_IMAGES = idx.encode(np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5))


@settings(
    max_examples=READER_EXAMPLES,
    deadline=None,
    # The same cases on every run: a red `make test` must be reproducible, not the luck of a
    # draw. A case it finds becomes a test of its own (tests/e2e/test_hardening.py).
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    data=st.one_of(st.binary(max_size=120), _damage(IDX_IMAGES)),
    compress=st.booleans(),
    num_dims=st.sampled_from([1, 3]),
)
def test_fuzzed_idx_bytes_are_read_or_refused(
    tmp_path: Path, data: bytes, compress: bool, num_dims: int
) -> None:
    CASES["idx"] += 1
    path = tmp_path / "file"
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
    header = _refused_or_read(lambda: idx.inspect(path, num_dims=num_dims, max_side=64))
    if compress:
        copy = _refused_or_read(
            lambda: idx.decompressed_copy(path, tmp_path / "copy", num_dims=num_dims, max_side=64)
        )
        assert isinstance(copy, ShardflowError) == isinstance(header, ShardflowError)
        assert isinstance(copy, ShardflowError) or (tmp_path / "copy").exists()
    if not isinstance(header, ShardflowError):
        assert idx.read_records(path).shape == header.shape


@pytest.fixture(scope="module")
def valid_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A small CSV, FITS and VOTable export, as bytes."""
    from astropy.table import Table

    from preprocessing.sources.synth import write_sdss_exports

    root = tmp_path_factory.mktemp("exports")
    (csv,) = write_sdss_exports(root / "csv", rows=6, files=1, fmt="csv", seed=3)
    (fits,) = write_sdss_exports(root / "fits", rows=6, files=1, fmt="fits", seed=3)
    table = Table.read(fits)
    for name in ("objid", "specobjid"):
        # VOTable has no unsigned long: ids as text (the readers take both).
        table[name] = np.array([str(v) for v in table[name]])
    votable = io.BytesIO()
    table.write(votable, format="votable")
    return {"csv": csv.read_bytes(), "fits": fits.read_bytes(), "vot": votable.getvalue()}


def _csv_text(valid: bytes) -> st.SearchStrategy[bytes]:
    """Exports with cells replaced by awkward text, lines dropped, doubled or cut."""
    lines = valid.decode().splitlines()
    header, rows = lines[0], lines[1:]
    cell = st.one_of(
        st.sampled_from(AWKWARD), TEXT.filter(lambda t: "\n" not in t and "\r" not in t)
    )

    @st.composite
    def edited(draw: st.DrawFn) -> bytes:
        table = [row.split(",") for row in rows]
        for _ in range(draw(st.integers(0, 6))):
            r = draw(st.integers(0, len(table) - 1))
            c = draw(st.integers(0, len(table[r]) - 1))
            table[r][c] = draw(cell)
        out = [",".join(cells) for cells in table]
        if draw(st.booleans()):
            out = draw(st.permutations(out))
        if draw(st.integers(0, 4)) == 0:
            out.append(out[0])  # a duplicate row
        head = header if draw(st.integers(0, 6)) else draw(TEXT)
        text = "\n".join([head, *out]) + draw(st.sampled_from(["\n", "", "\r\n", "\n\n"]))
        return text.encode(draw(st.sampled_from(["utf-8", "utf-8-sig", "latin-1"])), "replace")

    return st.one_of(edited(), st.binary(max_size=200), _damage(valid))


@settings(
    max_examples=READER_EXAMPLES,
    deadline=None,
    # The same cases on every run: a red `make test` must be reproducible, not the luck of a
    # draw. A case it finds becomes a test of its own (tests/e2e/test_hardening.py).
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), fmt=st.sampled_from(["csv", "fits", "vot"]))
def test_fuzzed_exports_are_converted_or_refused(
    tmp_path: Path, valid_exports: dict[str, bytes], data: st.DataObject, fmt: str
) -> None:
    CASES[f"export-{fmt}"] += 1
    valid = valid_exports[fmt]
    strategy = (
        _csv_text(valid) if fmt == "csv" else st.one_of(_damage(valid), st.binary(max_size=300))
    )
    path = tmp_path / f"export.{fmt}"
    path.write_bytes(data.draw(strategy))
    out = tmp_path / "out.parquet"
    out.unlink(missing_ok=True)
    result = _refused_or_read(lambda: exports.convert_export(str(path), str(out)))
    if isinstance(result, ShardflowError):
        assert isinstance(result, SourceError), repr(result)
        assert not out.exists()
    else:
        assert out.exists() and result["rows"] >= 0


def _cifar_pickle() -> bytes:
    batch = {
        b"data": np.zeros((2, 3072), dtype=np.uint8),
        b"labels": [1, 2],
        b"batch_label": b"x",
        b"filenames": [b"a.png", b"b.png"],
    }
    return pickle.dumps(batch, protocol=2)


@settings(
    max_examples=READER_EXAMPLES // 2,
    deadline=None,
    # The same cases on every run: a red `make test` must be reproducible, not the luck of a
    # draw. A case it finds becomes a test of its own (tests/e2e/test_hardening.py).
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.one_of(_damage(_cifar_pickle()), st.binary(max_size=200)))
def test_fuzzed_cifar10_pickles_are_read_or_refused(tmp_path: Path, data: bytes) -> None:
    CASES["cifar10-pickle"] += 1
    path = tmp_path / "data_batch_1"
    path.write_bytes(data)
    _refused_or_read(lambda: cifar10.read_batch(path))
