"""The layers of `app` (docs/architecture.md, "Layers"): a module imports only from its own
layer and the layers below, and no two packages import each other, directly or around a
loop. An `ast` walk of the source, so it runs without importing anything.

Also: no module outside `app/jobs/` writes a job's status or appends an event."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "app"

# Lowest first. A module belongs to the longest prefix listed.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "kit",
        (
            "app.settings",
            "app.egress",
            "app.db",
            "app.ingest.jsontext",
            "app.ingest.freeing",
            "app.notify",
            "app.backends",
        ),
    ),
    (
        "vocabulary",
        (
            "app.schemas",
            "app.errors",
            "app.jobs.lifecycle",
            "app.models",
            "app.trajectories",
        ),
    ),
    ("core", ("app.jobs",)),
    (
        "features",
        (
            "app.registry",
            "app.datasets",
            "app.checkpoints",
            "app.training",
            "app.rollouts",
            # Units of their own: rollouts score with `scoring`, which reads the graders;
            # evaluations sample with rollouts' client (no loop between the packages).
            "app.rollouts.graders",
            "app.evaluations",
            "app.evaluations.scoring",
            "app.runs",
            "app.webhooks",
            "app.gateway",
            "app.tinker",
            "app.tenants",
        ),
    ),
    (
        "wiring",
        (
            "app.metrics",
            "app.migrate",
            "app.worker",
            "app.process",
            "app.ingest.edge",
            "app.server",
            "app.api",
            "app.dashboard",
            "app.main",
            "app.cli",
            "app",
        ),
    ),
]
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}


def placed(module: str) -> tuple[str, str]:
    """(layer, unit): the longest prefix in LAYERS that holds `module`, and its layer."""
    best, unit = "", ""
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(unit):
                best, unit = name, prefix
    if not best:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and the docs")
    return best, unit


def layer_of(module: str) -> str:
    return placed(module)[0]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """The `app` modules (or packages) `path` imports, at any depth of its code."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = list(parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "app" or module.startswith("app."):
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    target = ROOT / full.replace(".", "/")
                    is_module = target.with_suffix(".py").exists() or target.is_dir()
                    found.add(full if is_module else module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name == "app" or a.name.startswith("app.")}
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(APP.rglob("*.py"))}


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = [
        f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})"
        for module, targets in graph().items()
        for target in sorted(targets)
        if RANK[layer_of(target)] > RANK[layer_of(module)]
    ]
    assert upward == []


def test_no_two_units_import_each_other_even_around_a_loop() -> None:
    """A unit: what one prefix of LAYERS names (`app.jobs.lifecycle` is one of its own,
    apart from the rest of `app.jobs`)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph().items():
        for target in targets:
            a, b = placed(module)[1], placed(target)[1]
            if a != b and a != "app" and b != "app":
                edges[a].add(b)
    cycles = []
    for start in sorted(edges):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in path and nxt > start:
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []


def test_every_layer_prefix_names_code_that_exists() -> None:
    for _, prefixes in LAYERS:
        for prefix in prefixes:
            target = ROOT / prefix.replace(".", "/")
            assert target.with_suffix(".py").exists() or target.is_dir(), prefix


def test_the_docs_list_every_layer() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name, prefixes in LAYERS:
        assert f"**{name}**" in text, name
        for prefix in prefixes:
            if prefix != "app":
                assert f"`{prefix.replace('.', '/')}" in text, prefix


def test_every_package_ships_in_the_wheel() -> None:
    """pyproject lists its packages one by one (the migrations are one, from elsewhere):
    a package moved or added is listed too, or an installed wheel lacks it."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {module_name(p.parent / "__init__.py") for p in APP.rglob("__init__.py")}
    assert (
        packages - listed == set()
        and {p for p in listed - packages if "migrations" not in p} == set()
    )


# What writes a job's status or appends an event: only app/jobs/.
@pytest.mark.parametrize(
    "path",
    [p for p in sorted(APP.rglob("*.py")) if p.relative_to(APP).parts[0] != "jobs"],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_status_write_or_event_append_outside_the_job_core(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = [
        line.strip()
        for line in text.splitlines()
        if re.search(r"append_event\(|add_events\(|update\(jobs\)|insert\(jobs\)", line)
        and not line.lstrip().startswith(("#", '"', "`"))
    ]
    assert found == []


@pytest.mark.parametrize("name", ["store.py", "statements.py", "events.py", "runs.py"])
def test_the_shared_store_code_takes_no_dialect_flag(name: str) -> None:
    """What differs per dialect is a strategy (`LeaseClock`, `fits_on_*`, a dialect's
    store class), never a `postgres` flag that shared code branches on."""
    text = (APP / "jobs" / name).read_text(encoding="utf-8")
    assert re.findall(r"\bpostgres\s*[:=]|if [\w.]*postgres\b", text) == []
