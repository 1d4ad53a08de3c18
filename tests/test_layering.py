"""The layers of tunerd, enforced: who may import whom, and no import cycles.

    cli ──(socket)──▶ daemon ──▶ placement, binding, tuners, monitor, policy, topology,
                                 watch, allocation, procfs ──▶ errors, cpulist

- Nothing outside tunerd/daemon/ imports tunerd.daemon (the daemon composes the
  layers below it; they never reach up).
- tunerd/cli/ talks to the daemon through tunerd.client only: it imports neither
  the daemon, the tuners nor binding.
- No import cycles between modules, counting every import (module level, inside
  functions, and under TYPE_CHECKING).

The graph is read from the source with ast, so a new import that breaks a rule
fails this test whether or not the code path runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "tunerd"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, mod: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                if not is_pkg:
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.add(target)
            for a in node.names:  # `from tunerd.daemon import jobs` imports a module too
                out.add(f"{target}.{a.name}")
    return {m for m in out if m == "tunerd" or m.startswith("tunerd.")}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    g: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps = set()
        for imp in imports_of(path, mod):
            # an import of a.b.c names module a.b.c if it exists, else a.b (an attribute)
            while imp and imp not in files:
                imp = imp.rpartition(".")[0]
            if imp and imp != mod:
                deps.add(imp)
        g[mod] = deps
    return g


GRAPH = graph()


def test_the_graph_is_read() -> None:
    assert "tunerd.daemon.wiring" in GRAPH
    assert "tunerd.daemon.jobs" in GRAPH["tunerd.daemon.wiring"]
    assert "tunerd.errors" in GRAPH["tunerd.placement"]


def violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        in_daemon = mod == "tunerd.daemon" or mod.startswith("tunerd.daemon.")
        for dep in sorted(deps):
            if not in_daemon and (dep == "tunerd.daemon" or dep.startswith("tunerd.daemon.")):
                bad.append(f"{mod} imports {dep}: only the daemon may import tunerd.daemon")
            if mod.startswith("tunerd.cli") and dep.startswith(
                    ("tunerd.daemon", "tunerd.tuners", "tunerd.binding")):
                bad.append(f"{mod} imports {dep}: the CLI talks to the daemon through "
                           "tunerd.client only")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_layers() -> None:
    assert violations(GRAPH) == []


def test_no_import_cycles() -> None:
    assert cycles(GRAPH) == []


@pytest.mark.parametrize(("mod", "dep", "why"), [
    ("tunerd.tuners.nccl", "tunerd.daemon.state", "only the daemon may import"),
    ("tunerd.monitor.service", "tunerd.daemon.app", "only the daemon may import"),
    ("tunerd.cli.cmd_bind", "tunerd.binding", "through tunerd.client only"),
    ("tunerd.cli.main", "tunerd.daemon.config", "only the daemon may import"),
])
def test_a_forbidden_import_is_caught(mod: str, dep: str, why: str) -> None:
    g = {k: set(v) for k, v in GRAPH.items()}
    g[mod].add(dep)
    assert any(why in v and mod in v for v in violations(g))


def test_a_new_cycle_is_caught() -> None:
    g = {k: set(v) for k, v in GRAPH.items()}
    g["tunerd.errors"].add("tunerd.placement")
    assert any("tunerd.errors" in c and "tunerd.placement" in c for c in cycles(g))


# -- what `tunerctl bind` loads at start-up ------------------------------------------
# bench/bind_latency.py: `tunerctl bind` <= 1.3x `python -c "import click"`. The
# modules on its path may import, at module level (what runs when they are imported;
# function bodies and TYPE_CHECKING blocks do not count), only these: anything else
# is imported inside the function that needs it. Not allowed, with what they cost:
# `socket` (its enum set-up; tunerd.client uses `_socket`), `locale`/`gettext`
# (tunerd.cli.types.Command), dataclasses, pathlib, re, shlex, logging, tomllib.
BIND_PATH = ("tunerd.cli.main", "tunerd.cli.cmd_bind", "tunerd.cpulist", "tunerd.text")
BIND_PATH_TUNERD = {"tunerd", "tunerd.cli", "tunerd.cli.main", "tunerd.cli.cmd_bind",
                    "tunerd.cli.context", "tunerd.cli.types", "tunerd.client",
                    "tunerd.cpulist", "tunerd.errors", "tunerd.protocol", "tunerd.text"}
BIND_PATH_OTHERS = {"__future__", "_socket", "click", "collections.abc", "enum", "functools",
                    "importlib", "json", "os", "struct", "sys", "time", "typing"}


def module_level_imports(path: Path, mod: str) -> set[str]:
    """Every module ``mod`` imports when it is imported (tunerd's and others)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def visit(stmts: list[ast.stmt]) -> None:
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = mod.split(".")[:None if is_pkg else -1]
                if node.level > 1:
                    base = base[:len(base) - (node.level - 1)]
                target = (".".join([*base, node.module] if node.module else base)
                          if node.level else node.module or "")
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit(inner)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return out


def startup_imports(start: tuple[str, ...],
                    imports: dict[str, set[str]]) -> tuple[set[str], set[str]]:
    """(tunerd modules, other modules) loaded by importing ``start``; ``imports`` maps
    each tunerd module to its module-level imports."""
    seen: set[str] = set()
    others: set[str] = set()
    todo = list(start)
    while todo:
        mod = todo.pop()
        parts = mod.split(".")
        # importing a.b.c runs a/__init__ and a/b/__init__ first
        for m in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:
            if m in seen:
                continue
            seen.add(m)
            for imp in imports.get(m, ()):
                if imp == "tunerd" or imp.startswith("tunerd."):
                    while imp not in imports:  # a.b.name: an attribute of module a.b
                        imp = imp.rpartition(".")[0]
                    todo.append(imp)
                else:
                    others.add(imp)
    # `from typing import Any` adds "typing" and "typing.Any": keep the module
    others = {o for o in others if o.rpartition(".")[0] not in others}
    return seen, others


IMPORTS = {m: module_level_imports(p, m)
           for m, p in ((module_name(p), p) for p in PKG.rglob("*.py"))}


def test_tunerctl_bind_imports_only_what_it_needs_at_start_up() -> None:
    mods, others = startup_imports(BIND_PATH, IMPORTS)
    assert mods <= BIND_PATH_TUNERD, sorted(mods - BIND_PATH_TUNERD)
    assert others <= BIND_PATH_OTHERS, sorted(others - BIND_PATH_OTHERS)
    assert "tunerd.client" in mods and "_socket" in others  # the rule sees the path


@pytest.mark.parametrize(("mod", "dep"), [
    ("tunerd.client", "socket"),
    ("tunerd.cli.main", "tunerd.cli.service_hint"),
    ("tunerd.text", "re"),
    ("tunerd.protocol", "dataclasses"),
])
def test_a_start_up_import_creeping_back_is_caught(mod: str, dep: str) -> None:
    imports = {k: set(v) for k, v in IMPORTS.items()}
    imports[mod].add(dep)
    mods, others = startup_imports(BIND_PATH, imports)
    assert not (mods <= BIND_PATH_TUNERD and others <= BIND_PATH_OTHERS)
