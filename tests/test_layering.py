"""The layers stay layers: libraries never import Prefect, data_catalog imports no other
package, training does not import preprocessing, the lab (experiments, probes, benches, test
hosts) sits between the flows and the libraries and no library imports it, and no package
imports another in a circle."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_catalog", "preprocessing", "training", "lab", "flows")
# Which packages each may import (itself always).
ALLOWED = {
    "data_catalog": set(),
    "preprocessing": {"data_catalog"},
    "training": {"data_catalog"},
    "lab": {"data_catalog", "preprocessing", "training"},
    "flows": {"data_catalog", "preprocessing", "training", "lab"},
}
# What only the lab holds: no library keeps an experiment, a probe or a benchmark.
LAB_ONLY = ("experiments", "netns", "allreduce_probe", "step_probe", "scaling_model", "bench")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_packages_import_only_the_layers_below() -> None:
    wrong = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _imports(path):
                top = name.split(".")[0]
                if top in PACKAGES and top != package and top not in ALLOWED[package]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
                if top in ("prefect", "prefect_dask") and package != "flows":
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_the_libraries_import_no_lab_module() -> None:
    """Core never imports the lab, not even inside a function (torchtitan keeps its
    experiments optional the same way)."""
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for package in ("data_catalog", "preprocessing", "training")
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _imports(path)
        if name.split(".")[0] == "lab"
    ]
    assert wrong == []


def test_the_libraries_hold_no_lab_module() -> None:
    found = [
        str(path.relative_to(ROOT))
        for package in ("preprocessing", "training")
        for path in (ROOT / package).iterdir()
        if path.stem in LAB_ONLY
    ]
    assert found == []


def test_no_module_imports_itself_through_others() -> None:
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            graph[_module(path)] = {n for n in _imports(path) if n.split(".")[0] in PACKAGES}
    modules = set(graph)

    def targets(name: str) -> set[str]:
        # "from pkg import module" names the package; count the package's own module too.
        return {n for n in graph.get(name, set()) if n in modules}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, trail = stack.pop()
            for following in targets(node):
                if following == start:
                    return [*trail, start]
                if following not in seen:
                    seen.add(following)
                    stack.append((following, [*trail, following]))
        return None

    cycles = [c for m in sorted(modules) if (c := cycle_from(m)) and not m.endswith("__init__")]
    # A package __init__ re-exporting its modules is not a cycle of behaviour.
    cycles = [c for c in cycles if not any(m in PACKAGES for m in c)]
    assert cycles == []


@pytest.mark.parametrize(
    ("filename", "banned"),
    [
        ("preprocessing/probe.py", True),
        ("training/probe.py", True),
        ("data_catalog/probe.py", True),
        ("flows/probe.py", False),
    ],
)
def test_the_lint_rule_bans_prefect_outside_flows(filename: str, banned: bool) -> None:
    """ruff's banned-api rule, with this repository's configuration, on a module that imports
    Prefect placed in each package."""
    source = "import prefect\nfrom prefect.artifacts import create_table_artifact\n"
    ruff = Path(sys.executable).parent / "ruff"
    checked = subprocess.run(
        [str(ruff), "check", "--select", "TID251", "--stdin-filename", filename, "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert ("TID251" in checked.stdout) is banned, checked.stdout
    assert (checked.returncode != 0) is banned


# Where each extra's modules may be imported: an extra is optional, so only the code that
# needs it imports it. An extra not named here has no place (s3, gcs, postgres: reached
# through fsspec and SQLAlchemy, never imported by name; dev: the tests' own tools).
EXTRA_PLACES = {
    "readers": ("lab/bench/peers/",),
    "bench": ("lab/bench/",),
    "lineage": ("data_catalog/openlineage_events.py",),
    "ray": ("lab/ray_train.py",),
    "cifar10-pool": ("lab/cifar10_pool.py",),
}
# Installed, not declared, and why.
NOT_DECLARED = {
    # Built from source after TensorFlow with the frameworks' flags (Makefile, docs/STACK.md):
    # a requirement in pyproject.toml would have pip build it without them.
    "horovod",
}


def _distribution(requirement: str) -> str:
    """The normalized distribution name of a PEP 508 requirement ("dask[dataframe]==1" → dask)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group()).lower()


def _third_party_imports() -> dict[str, set[str]]:
    """Every top-level module the packages import (at the top or inside a function) that is
    neither the standard library nor one of the packages, with the files importing it."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _imports(path):
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in PACKAGES or top == "__future__":
                    continue
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared_and_an_extras_only_where_it_is_needed() -> None:
    from importlib.metadata import packages_distributions

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_distribution(r) for r in project["dependencies"]}
    extras = {
        extra: {_distribution(r) for r in requirements}
        for extra, requirements in project["optional-dependencies"].items()
        if extra != "dev"
    }
    installed = packages_distributions()
    wrong = []
    for module, paths in sorted(_third_party_imports().items()):
        if module in NOT_DECLARED:
            continue
        distributions = {_distribution(d) for d in installed.get(module, [])}
        if not distributions:
            wrong.append(f"{module} (imported by {', '.join(sorted(paths))}) is not installed")
        elif distributions & core:
            continue
        else:
            places = tuple(
                place
                for extra, declared in extras.items()
                if distributions & declared
                for place in EXTRA_PLACES.get(extra, ())
            )
            if not places:
                wrong.append(
                    f"{module} ({', '.join(sorted(distributions))}) is imported by "
                    f"{', '.join(sorted(paths))} but declared in no dependency or extra"
                )
                continue
            wrong += [
                f"{path} imports {module}, which only an extra declares; its places: "
                f"{', '.join(places)}"
                for path in sorted(paths)
                if not path.startswith(places)
            ]
    assert wrong == [], "\n".join(wrong)
