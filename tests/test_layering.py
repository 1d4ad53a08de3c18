"""The layers of tunerd, as docs/layers.md writes them down: every rule of it, checked.

The table in docs/layers.md is this test's input: each folder of tunerd/ is a layer
that may import its own modules and the layers its row names. Checked here:

1. no loose module at tunerd/'s top, and every module in a layer of the table;
2. every import goes to the module's own layer or a layer its row allows;
3. the table itself is acyclic (it lists layers lowest first, each allowing only
   layers listed before it);
4. no import cycles between modules;
5. `tunerctl bind`'s start-up path imports only a short list at module level;
6. only tunerd/jobs/actuate.py writes to other processes;
7. tunerd/jobs/ is typed: no function over 60 lines, no Any;
8. the composition root (daemon/wiring.py) only wires: short functions, none nested;
9. tunerd/jobs/, daemon/, watch/ and policy/ test and hold no role or placement mode as
   a string (they compare against and hold the ``Role``/``Mode`` enums; strings are
   parsed at the edges);
10. no /proc/PID path is built outside adapters/procfs.py (and base/procpath.py for
   the layers that may not import adapters).
11. in tunerd/jobs/ no attribute is a map or set keyed by a process (a pid, a ProcKey,
   a (pid, start) tuple) outside jobs/ledger.py, and every map or set attribute has an
   annotation to read its key from.

The graph is read from the source with ast, so a new import that breaks a rule
fails this test whether or not the code path runs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "tunerd"
LAYERS_DOC = PKG.parent / "docs" / "layers.md"


def read_layers(text: str) -> dict[str, tuple[str, ...]]:
    """docs/layers.md's table: layer -> the layers it may import, in the table's order."""
    body = text.split("<!-- layers:", 1)[1].split("<!-- /layers -->", 1)[0]
    out: dict[str, tuple[str, ...]] = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        allowed = () if cells[2] == "-" else tuple(a.strip() for a in cells[2].split(","))
        out[cells[0]] = allowed
    return out


LAYERS = read_layers(LAYERS_DOC.read_text())


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


def test_the_graph_and_the_table_are_read() -> None:
    assert "tunerd.daemon.wiring" in GRAPH
    assert "tunerd.jobs.registry" in GRAPH["tunerd.daemon.wiring"]
    assert "tunerd.base.errors" in GRAPH["tunerd.jobs.placement"]
    assert next(iter(LAYERS)) == "base" and LAYERS["base"] == ()
    assert "jobs" in LAYERS["daemon"] and "daemon" not in LAYERS["cli"]
    assert len(LAYERS) >= 10


def layer_of(mod: str) -> str | None:
    """The layer (top folder) of a module; None for tunerd itself."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def loose_modules(graph: dict[str, set[str]]) -> list[str]:
    """Modules at tunerd/'s top (a file, not a folder), and modules of no listed layer."""
    bad = []
    for mod in sorted(graph):
        layer = layer_of(mod)
        if layer is None:
            continue
        if (PKG / f"{layer}.py").exists():
            bad.append(f"{mod}: a loose module at tunerd/'s top (docs/layers.md, rule 1)")
        elif layer not in LAYERS:
            bad.append(f"{mod}: tunerd/{layer}/ is not a layer of docs/layers.md (rule 1)")
    return bad


def violations(graph: dict[str, set[str]],
               layers: dict[str, tuple[str, ...]] = LAYERS) -> list[str]:
    """Every import that goes to a layer the importer's row does not allow (rule 2)."""
    bad = []
    for mod, deps in sorted(graph.items()):
        own = layer_of(mod)
        if own is None or own not in layers:
            continue
        for dep in sorted(deps):
            to = layer_of(dep)
            if to is None or to == own:
                continue
            if to not in layers[own]:
                bad.append(f"{mod} imports {dep}: layer {own} may import only "
                           f"{', '.join(layers[own]) or 'nothing of tunerd'} "
                           "(docs/layers.md)")
    return bad


def table_problems(layers: dict[str, tuple[str, ...]]) -> list[str]:
    """Rule 3: each layer allows only known layers listed before it (so no cycle)."""
    bad = []
    order = list(layers)
    for i, (layer, allowed) in enumerate(layers.items()):
        for a in allowed:
            if a not in layers:
                bad.append(f"{layer} allows {a}, which is not a layer of the table")
            elif order.index(a) >= i:
                bad.append(f"{layer} allows {a}, listed at or after it: the table would "
                           "have a cycle")
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


def test_no_loose_modules() -> None:
    assert loose_modules(GRAPH) == []
    tops = sorted(p.name for p in PKG.iterdir() if p.suffix == ".py")
    assert tops == ["__init__.py"]


def test_every_import_goes_down_the_table() -> None:
    assert violations(GRAPH) == []


def test_the_table_has_no_cycle() -> None:
    assert table_problems(LAYERS) == []


def test_no_import_cycles() -> None:
    assert cycles(GRAPH) == []


@pytest.mark.parametrize(("mod", "dep"), [
    ("tunerd.tuners.nccl", "tunerd.daemon.state"),
    ("tunerd.monitor.service", "tunerd.daemon.app"),
    ("tunerd.cli.cmd_bind", "tunerd.jobs.binding"),
    ("tunerd.cli.main", "tunerd.daemon.config"),
    ("tunerd.jobs.placer", "tunerd.daemon.state"),
    ("tunerd.base.errors", "tunerd.adapters.procfs"),
    ("tunerd.adapters.procfs", "tunerd.topology.model"),
    ("tunerd.topology.nodemap", "tunerd.jobs.placement"),
])
def test_a_forbidden_import_is_caught(mod: str, dep: str) -> None:
    g = {k: set(v) for k, v in GRAPH.items()}
    g[mod].add(dep)
    assert any(v.startswith(f"{mod} imports {dep}: layer ") for v in violations(g))


def test_a_loose_module_is_caught() -> None:
    g = {k: set(v) for k, v in GRAPH.items()}
    g["tunerd.stray"] = set()
    assert loose_modules(g) == ["tunerd.stray: tunerd/stray/ is not a layer of "
                                "docs/layers.md (rule 1)"]


def test_a_table_with_a_cycle_is_caught() -> None:
    doc = LAYERS_DOC.read_text()
    bad = re.sub(r"(\| base \|[^|]*\|) - \|", r"\1 jobs |", doc, count=1)
    assert bad != doc
    problems = table_problems(read_layers(bad))
    assert any(p.startswith("base allows jobs, listed at or after it") for p in problems)


def test_a_new_cycle_is_caught() -> None:
    g = {k: set(v) for k, v in GRAPH.items()}
    g["tunerd.base.errors"].add("tunerd.jobs.placement")
    assert any("tunerd.base.errors" in c and "tunerd.jobs.placement" in c for c in cycles(g))


# -- what `tunerctl bind` loads at start-up ------------------------------------------
# bench/bind_latency.py: `tunerctl bind` <= 1.3x `python -c "import click"`. The
# modules on its path may import, at module level (what runs when they are imported;
# function bodies and TYPE_CHECKING blocks do not count), only these: anything else
# is imported inside the function that needs it. Not allowed, with what they cost:
# `socket` (its enum set-up; tunerd.wire.client uses `_socket`), `locale`/`gettext`
# (tunerd.cli.types.Command), dataclasses, pathlib, re, shlex, logging, tomllib.
BIND_PATH = ("tunerd.cli.main", "tunerd.cli.cmd_bind", "tunerd.base.cpulist", "tunerd.base.text")
BIND_PATH_TUNERD = {"tunerd", "tunerd.cli", "tunerd.cli.main", "tunerd.cli.cmd_bind",
                    "tunerd.cli.context", "tunerd.cli.types", "tunerd.wire", "tunerd.wire.client",
                    "tunerd.base", "tunerd.base.cpulist", "tunerd.base.errors",
                    "tunerd.wire.protocol", "tunerd.base.text"}
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
    assert "tunerd.wire.client" in mods and "_socket" in others  # the rule sees the path


@pytest.mark.parametrize(("mod", "dep"), [
    ("tunerd.wire.client", "socket"),
    ("tunerd.cli.main", "tunerd.cli.service_hint"),
    ("tunerd.base.text", "re"),
    ("tunerd.wire.protocol", "dataclasses"),
])
def test_a_start_up_import_creeping_back_is_caught(mod: str, dep: str) -> None:
    imports = {k: set(v) for k, v in IMPORTS.items()}
    imports[mod].add(dep)
    mods, others = startup_imports(BIND_PATH, imports)
    assert not (mods <= BIND_PATH_TUNERD and others <= BIND_PATH_OTHERS)


# -- rule 6: one writer of other processes ------------------------------------------
WRITER = "tunerd/jobs/actuate.py"
# (file, function) -> why it acts on its own process only
SELF_ONLY = {
    ("tunerd/torch/affinity.py", "_pin"): "a DataLoader worker pins its own threads "
                                          "(/proc/self/task)",
    ("tunerd/cli/cmd_leases.py", "set_mempolicy_bind"): "tunerctl run: set_mempolicy acts "
                                                        "on the caller, before its exec",
}
MEMORY_CALLS = re.compile(r"(?i)(migrate_pages|set_mempolicy|mbind|move_pages)")


class _Writers(ast.NodeVisitor):
    """Every write to another process found in one module (rule 6)."""

    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.func = "<module>"
        self.found: list[str] = []
        self._called: set[int] = set()  # os.sched_setaffinity nodes that are called

    def _bad(self, node: ast.AST, what: str) -> None:
        if (self.rel, self.func) not in SELF_ONLY:
            self.found.append(f"{self.rel}:{getattr(node, 'lineno', '?')} ({self.func}): "
                              f"{what} (docs/layers.md, rule 6: only {WRITER})")

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer, self.func = self.func, node.name
        self.generic_visit(node)
        self.func = outer

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            if a.name in ("sched_setaffinity", "prlimit"):
                self._bad(node, f"from {node.module} import {a.name} (an alias)")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if node.value in ("sched_setaffinity", "prlimit"):
            self._bad(node, f"{node.value!r} as a string (getattr)")

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and MEMORY_CALLS.search(node.id) \
                and node.id not in {f for _, f in SELF_ONLY}:  # calling a self-only spot
            self._bad(node, f"{node.id}: a memory-policy system call")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "sched_setaffinity" and not (
                isinstance(node.value, ast.Name) and node.value.id == "os"):
            self._bad(node, "sched_setaffinity through another name than os")
        elif node.attr == "sched_setaffinity" and id(node) not in self._called:
            self._bad(node, "os.sched_setaffinity taken as a value (an alias)")
        elif node.attr == "syscall" or MEMORY_CALLS.search(node.attr):
            self._bad(node, f".{node.attr}: a raw system call")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name == "sched_setaffinity":
            self._called.add(id(f))
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Constant) and first.value == 0):
                self._bad(node, f"sched_setaffinity({ast.unparse(first) if first else ''}, "
                                "...) on another process")
            for child in [node.func, *node.args, *(k.value for k in node.keywords)]:
                self.visit(child)
            return
        if name == "prlimit" and len(node.args) + len(node.keywords) > 2:
            self._bad(node, "prlimit with a new limit")
        self.generic_visit(node)


def writers(sources: dict[str, str]) -> list[str]:
    """Rule 6 over ``sources`` (path relative to the checkout -> text)."""
    out: list[str] = []
    for rel, text in sorted(sources.items()):
        if rel == WRITER:
            continue
        v = _Writers(rel)
        v.visit(ast.parse(text, filename=rel))
        out += v.found
    return out


SOURCES = {str(p.relative_to(PKG.parent)): p.read_text() for p in PKG.rglob("*.py")}


def test_only_actuate_writes_to_other_processes() -> None:
    assert writers(SOURCES) == []
    # the writer itself does (the check reads what it should)
    assert _writes(SOURCES[WRITER], "tunerd/jobs/elsewhere.py")


def _writes(text: str, rel: str) -> list[str]:
    return writers({rel: text})


@pytest.mark.parametrize("planted", [
    "import os\ndef f(pid):\n    os.sched_setaffinity(pid, {0})\n",
    "import os\nos.sched_setaffinity(1234, {0})\n",
    "from os import sched_setaffinity\nsched_setaffinity(0, {1})\n",
    "import os as o\no.sched_setaffinity(0, {1})\n",
    "import os\nset_cpus = os.sched_setaffinity\n",
    "import os\ngetattr(os, 'sched_setaffinity')(5, {1})\n",
    "import resource\nresource.prlimit(5, resource.RLIMIT_NOFILE, (1, 1))\n",
    "import ctypes\nSYS_MIGRATE_PAGES = 256\nctypes.CDLL(None).syscall(256, 5)\n",
    "def f(libc):\n    libc.set_mempolicy(2, 0, 0)\n",
])
def test_a_planted_writer_is_caught(planted: str) -> None:
    assert _writes(planted, "tunerd/jobs/registry.py"), planted


@pytest.mark.parametrize("allowed", [
    "import os\nos.sched_setaffinity(0, {1})\n",  # its own process
    "import resource\nresource.prlimit(5, resource.RLIMIT_NOFILE)\n",  # a read
    "import os\nos.sched_getaffinity(5)\n",
])
def test_what_is_not_a_write_to_another_process_passes(allowed: str) -> None:
    assert _writes(allowed, "tunerd/jobs/registry.py") == []


# -- rule 7: the bind domain is typed -------------------------------------------------
JOBS = "tunerd/jobs/"
MAX_FUNCTION_LINES = 60
# Offenders in the files another branch (`types`) is typing now: (file, function) for a
# long function, (file, "Any") for a file that still uses Any. Only these four files may
# be listed; the lead empties this set once that branch is merged (a listed offender
# that is gone fails test_known_offenders_still_offend, so the set cannot go stale).
KNOWN_UNTIL_TYPES_MERGES: set[tuple[str, str]] = set()  # none left: keep it empty
KNOWN_FILES: set[str] = set()


def _annotations(tree: ast.AST) -> list[ast.expr]:
    """Every annotation in ``tree``, a string one parsed (``x: "dict[str, Any]"``), and
    the value of a ``TypeAlias``."""
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            out.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            out.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            out.append(node.annotation)
            if node.value is not None and "TypeAlias" in ast.unparse(node.annotation):
                out.append(node.value)
    parsed = []
    for a in out:
        if isinstance(a, ast.Constant) and isinstance(a.value, str):
            try:
                a = ast.parse(a.value, mode="eval").body
            except SyntaxError:
                continue
        parsed.append(a)
    return parsed


def _uses_any(tree: ast.AST) -> list[int]:
    """Lines where ``Any`` is imported or named (in code or in an annotation)."""
    lines = []
    for node in ast.walk(tree):
        imported = isinstance(node, ast.ImportFrom) and any(a.name == "Any" for a in node.names)
        named = (isinstance(node, ast.Attribute) and node.attr == "Any") or (
            isinstance(node, ast.Name) and node.id == "Any")
        if imported or named:
            lines.append(getattr(node, "lineno", 0))
    for a in _annotations(tree):
        if any(isinstance(n, ast.Name) and n.id == "Any" for n in ast.walk(a)):
            lines.append(getattr(a, "lineno", 0))
    return sorted(set(lines))


def untyped(sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """Rule 7 over ``sources``: (file, function or "Any", what) for each function of
    tunerd/jobs/ over MAX_FUNCTION_LINES lines and each file there that uses Any."""
    out = []
    for rel, text in sorted(sources.items()):
        if not rel.startswith(JOBS):
            continue
        tree = ast.parse(text, filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append((rel, node.name, f"{rel}:{node.lineno}: {node.name} is {n} "
                                f"lines (docs/layers.md, rule 7: at most {MAX_FUNCTION_LINES})"))
        lines = _uses_any(tree)
        if lines:
            out.append((rel, "Any", f"{rel}: Any on line(s) {', '.join(map(str, lines))} "
                                    "(docs/layers.md, rule 7: precise types)"))
    return out


def test_the_bind_domain_is_typed() -> None:
    found = untyped(SOURCES)
    assert [what for rel, name, what in found
            if (rel, name) not in KNOWN_UNTIL_TYPES_MERGES] == []


def test_known_offenders_still_offend() -> None:
    """The exceptions are only the other branch's files, and each is still an offender
    (typed meanwhile: take it off the list)."""
    assert {rel for rel, _ in KNOWN_UNTIL_TYPES_MERGES} <= KNOWN_FILES
    found = {(rel, name) for rel, name, _ in untyped(SOURCES)}
    assert found >= KNOWN_UNTIL_TYPES_MERGES, sorted(KNOWN_UNTIL_TYPES_MERGES - found)


LONG = "def long_one(x: int) -> int:\n" + "    x += 1\n" * 60 + "    return x\n"


@pytest.mark.parametrize("planted", [
    "from typing import Any\n\ndef f(x: Any) -> None:\n    pass\n",
    "import typing\n\nX: typing.Any = None\n",
    "def f(x: 'dict[str, Any]') -> None:\n    pass\n",
    "from typing import TypeAlias\n\nJ: TypeAlias = 'list[Any]'\n",
    "def f() -> 'Any':\n    return 1\n",
    LONG,
    "class C:\n    async def run(self) -> None:\n" + "        await x()\n" * 60,
])
def test_a_planted_untyped_spot_is_caught(planted: str) -> None:
    found = untyped({"tunerd/jobs/registry.py": planted})
    assert found, planted
    assert all((rel, name) not in KNOWN_UNTIL_TYPES_MERGES for rel, name, _ in found)


def test_a_planted_long_function_in_a_known_file_is_caught() -> None:
    text = SOURCES["tunerd/jobs/placer.py"] + "\n\n" + LONG
    found = untyped({"tunerd/jobs/placer.py": text})
    assert [w for r, name, w in found if (r, name) not in KNOWN_UNTIL_TYPES_MERGES] \
        == [w for r, name, w in found if name == "long_one"] != []


@pytest.mark.parametrize("allowed", [
    "def f(x: object) -> None:\n    '''Anything at all.'''\n",
    "def short(x: int) -> int:\n" + "    x += 1\n" * 58 + "    return x\n",  # 60 lines
    "from tunerd.base.jsontypes import JSONObject\n\ndef f() -> JSONObject:\n    return {}\n",
])
def test_what_is_typed_passes(allowed: str) -> None:
    assert untyped({"tunerd/jobs/registry.py": allowed}) == []
    # outside tunerd/jobs/ the rule does not apply
    assert untyped({"tunerd/daemon/app.py": LONG + "from typing import Any\n"}) == []


# -- rule 8: the composition root only wires ------------------------------------------
ROOT = "tunerd/daemon/wiring.py"


def wiring_faults(sources: dict[str, str]) -> list[str]:
    """Rule 8 over ``sources``: every function of the composition root at most
    MAX_FUNCTION_LINES lines, and none nested in another (a callback a service is
    given is a named method, not a closure over ``_build``'s locals)."""
    text = sources.get(ROOT)
    if text is None:
        return [f"{ROOT} is missing"]
    out = []
    tree = ast.parse(text, filename=ROOT)
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if not isinstance(node, funcs):
            continue
        n = (node.end_lineno or node.lineno) - node.lineno + 1
        if n > MAX_FUNCTION_LINES:
            out.append(f"{ROOT}:{node.lineno}: {node.name} is {n} lines (docs/layers.md, "
                       f"rule 8: at most {MAX_FUNCTION_LINES})")
        for inner in ast.walk(node):
            if inner is not node and isinstance(inner, (*funcs, ast.Lambda)):
                out.append(f"{ROOT}:{inner.lineno}: a function nested in {node.name} "
                           "(docs/layers.md, rule 8: a named method instead)")
    return out


def test_the_composition_root_only_wires() -> None:
    assert wiring_faults(SOURCES) == []


@pytest.mark.parametrize("planted", [
    "def _build(cfg: int) -> int:\n    def cb() -> int:\n        return cfg\n    return cb()\n",
    "def _build(cfg: int) -> object:\n    return lambda: cfg\n",
    "def _build(cfg: int) -> int:\n" + "    cfg += 1\n" * 60 + "    return cfg\n",
])
def test_a_nested_or_long_function_in_the_root_is_caught(planted: str) -> None:
    assert wiring_faults({ROOT: planted}), planted


# -- rule 9: roles and placement modes are enums, not strings ---------------------------

ENUM_SOURCES = ("tunerd/jobs/intake.py", "tunerd/base/modes.py")
# where a role or mode is carried: held as the enum, compared as the enum
ENUM_AREAS = ("tunerd/jobs/", "tunerd/daemon/", "tunerd/watch/", "tunerd/policy/")


def _enum_values(sources: dict[str, str]) -> frozenset[str]:
    """The values of the Role and Mode enums, read from their source."""
    out: set[str] = set()
    for rel in ENUM_SOURCES:
        for node in ast.walk(ast.parse(sources[rel])):
            if isinstance(node, ast.ClassDef) and node.name in ("Role", "Mode"):
                out |= {a.value.value for a in node.body if isinstance(a, ast.Assign)
                        and isinstance(a.value, ast.Constant) and isinstance(a.value.value, str)}
    return frozenset(out)


ENUM_VALUES = _enum_values(SOURCES)
ENUM_SUBJECTS = re.compile(r"(^|\.)(role|mode|placement)$")


def _strings(node: ast.expr) -> list[str]:
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def string_enum_tests(sources: dict[str, str]) -> list[str]:
    """Rule 9: `x.role == "rank"`, `mode in ("node", "socket")` and the like."""
    out = []
    for rel, text in sorted(sources.items()):
        if not rel.startswith(ENUM_AREAS):
            continue
        for node in ast.walk(ast.parse(text, filename=rel)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            subject = any(ENUM_SUBJECTS.search(ast.unparse(s)) for s in sides)
            hit = [v for s in sides for v in _strings(s) if v in ENUM_VALUES]
            if subject and hit:
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}: compare with Role/Mode")
    return out


def test_no_role_or_mode_is_tested_as_a_string() -> None:
    assert {"rank", "launcher", "gpu-local", "exclusive", "socket"} <= ENUM_VALUES
    assert string_enum_tests(SOURCES) == []


def _names_str(ann: ast.expr | None) -> bool:
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return False
    return ann is not None and any(isinstance(n, ast.Name) and n.id == "str"
                                   for n in ast.walk(ann))


def string_enum_fields(sources: dict[str, str]) -> list[str]:
    """Rule 9 at the edges: a role or placement mode held as text where it is carried
    (``mode: str``, ``placement: str = "gpu-local"``, an argument ``role: str``, a
    property ``def placement(self) -> str``): the text is parsed into the enum where it
    enters (policy load, a dataclass's ``__post_init__``) and the enum kept inside."""
    out = []
    for rel, text in sorted(sources.items()):
        if not rel.startswith(ENUM_AREAS):
            continue
        for node in ast.walk(ast.parse(text, filename=rel)):
            if isinstance(node, ast.AnnAssign):
                name, ann = ast.unparse(node.target), node.annotation
            elif isinstance(node, ast.arg):
                name, ann = node.arg, node.annotation
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name, ann = node.name, node.returns
            else:
                continue
            if ENUM_SUBJECTS.search(name) and _names_str(ann):
                out.append(f"{rel}:{node.lineno}: {name}: {ast.unparse(ann) if ann else ''}"
                           ": hold a Role/Mode (docs/layers.md, rule 9)")
    return out


def test_no_role_or_mode_is_held_as_a_string() -> None:
    assert string_enum_fields(SOURCES) == []


@pytest.mark.parametrize("planted", [
    "from dataclasses import dataclass\n@dataclass\nclass R:\n    mode: str = 'node'\n",
    "class R:\n    placement: 'str | None' = None\n",
    "def f(role: str) -> None:\n    pass\n",
    "class C:\n    def __init__(self) -> None:\n        self.mode: str = 'socket'\n",
    "class P:\n    @property\n    def placement(self) -> str: ...\n",
])
def test_a_planted_string_role_or_mode_field_is_caught(planted: str) -> None:
    for rel in ("tunerd/jobs/registry.py", "tunerd/watch/rules.py", "tunerd/policy/typed.py"):
        assert string_enum_fields({rel: planted}), (rel, planted)


def test_an_enum_field_passes() -> None:
    ok = ("class R:\n    mode: Mode = Mode.NODE\n    compute_mode: str | None = None\n"
          "    role: 'Role | None' = None\n")
    assert string_enum_fields({"tunerd/jobs/registry.py": ok}) == []
    # the bench's arms name a placement "unbound | tunerd | exclusive": no Mode
    assert string_enum_fields({"tunerd/bench/arms.py": "placement: str = 'unbound'\n"}) == []


@pytest.mark.parametrize("planted", [
    "def f(ctx):\n    return ctx.role == 'rank'\n",
    "def f(ctx):\n    return ctx.role not in ('wrapper', 'launcher')\n",
    "def f(req):\n    return req.exclusive or req.mode == 'exclusive'\n",
    "def f(rule):\n    return rule.placement == 'exclusive'\n",
    "def f(mode):\n    return mode in ('node', 'socket')\n",
])
def test_a_planted_string_role_or_mode_is_caught(planted: str) -> None:
    assert string_enum_tests({"tunerd/jobs/registry.py": planted}), planted


def test_an_enum_comparison_passes() -> None:
    ok = ("from tunerd.jobs.intake import Role\ndef f(ctx, w):\n"
          "    return ctx.role == Role.RANK or w.mode == 'proc-scan'\n")
    assert string_enum_tests({"tunerd/jobs/registry.py": ok}) == []


# -- rule 10: /proc/PID paths only in adapters/procfs.py --------------------------------

PROC_PATH_OWNERS = {
    "tunerd/adapters/procfs.py": "the proc adapter, over an injectable proc root",
    "tunerd/base/procpath.py": "pid_path() for the layers that may not import adapters (cli)",
}


def proc_paths(sources: dict[str, str]) -> list[str]:
    """Rule 10: f"/proc/{pid}/..." and "/proc/" + ... outside the owners. Fixed paths
    (/proc/self/..., /proc/sys/..., /proc/cpuinfo) and docstrings are not a process's."""
    out = []
    for rel, text in sorted(sources.items()):
        if rel in PROC_PATH_OWNERS:
            continue
        for node in ast.walk(ast.parse(text, filename=rel)):
            head = None
            if isinstance(node, ast.JoinedStr) and len(node.values) > 1:
                first, second = node.values[0], node.values[1]
                if isinstance(first, ast.Constant) and isinstance(second, ast.FormattedValue):
                    head = str(first.value)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod) \
                    and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
                head = node.left.value.split("%", 1)[0]
            if head is not None and head.rstrip("/") == "/proc":
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}: use tunerd.adapters.procfs")
    return out


def test_no_proc_pid_path_outside_procfs() -> None:
    assert proc_paths(SOURCES) == []


@pytest.mark.parametrize("planted", [
    "def f(pid):\n    return open(f'/proc/{pid}/comm').read()\n",
    "def f(pid):\n    return '/proc/' + str(pid) + '/maps'\n",
    "def f(pid):\n    return '/proc/%d/stat' % pid\n",
])
def test_a_planted_proc_path_is_caught(planted: str) -> None:
    assert proc_paths({"tunerd/cli/cmd_bind.py": planted}), planted


def test_a_fixed_proc_path_passes() -> None:
    ok = ('def f(fd):\n    """/proc/PID/status"""\n'
          "    return f'/proc/self/fd/{fd}', '/proc/sys/vm'\n")
    assert proc_paths({"tunerd/policy/loader.py": ok}) == []


# -- rule 11: pid-keyed maps live only in the ledger ----------------------------------

LEDGER = "tunerd/jobs/ledger.py"
# containers whose first type argument is a key: a map, or a set of its members
# (frozenset and tuple are values, such as a CPU set, not tables that must forget a
# process when it exits)
KEYED = {"dict", "Dict", "Mapping", "MutableMapping", "OrderedDict", "defaultdict",
         "DefaultDict", "Counter", "ChainMap", "WeakValueDictionary", "WeakKeyDictionary",
         "set", "Set", "MutableSet", "AbstractSet", "WeakSet"}
PID_KEYS = {"int", "ProcKey", "tuple[int, int]"}  # a pid, or (pid, start)
# Maps and sets keyed by an int that is no process, each with what the int is. An entry
# whose key is no longer an int fails test_allowed_int_keys_are_still_int_keyed.
ALLOWED_INT_KEYS: dict[tuple[str, str], str] = {
    ("tunerd/jobs/actuate.py", "ThreadsSet.failed"): "a thread id, in one set_threads "
                                                     "call's result",
    ("tunerd/jobs/binding.py", "Originals.threads"): "a thread id of the one process the "
                                                     "record is of (its threads' CPUs)",
    ("tunerd/jobs/gate.py", "_TEST_NODES"): "(major, minor) of a device node (tests only)",
    ("tunerd/jobs/gpuuse.py", "GpuUse._minors"): "an NVIDIA device minor (-> GPU index)",
    ("tunerd/jobs/peer.py", "PidNamespaces._scans"): "a pid namespace's inode",
    ("tunerd/jobs/peer.py", "PidNamespaces._users"): "a uid",
    ("tunerd/jobs/cpusetwatch.py", "CpusetWatch._wds"): "an inotify watch descriptor",
    ("tunerd/jobs/placement.py", "_Index.gpus"): "a GPU index",
    ("tunerd/jobs/placement.py", "_Index.cost"): "a pair of GPU indexes",
    ("tunerd/jobs/placement.py", "_Index.core_cpus"): "a core id",
    ("tunerd/jobs/placement.py", "_Index.cpu_core"): "a CPU id",
    ("tunerd/jobs/placement.py", "_Index.core_node"): "a core id",
    ("tunerd/jobs/placement.py", "_Index.core_l3"): "a core id",
    ("tunerd/jobs/placement.py", "_Index.node_cores"): "a NUMA node",
    ("tunerd/jobs/placement.py", "_Index.package_nodes"): "a CPU package (socket)",
    ("tunerd/jobs/placement.py", "_Index.node_package"): "a NUMA node",
    ("tunerd/jobs/placement.py", "_Index.distance"): "a NUMA node (-> node -> distance)",
    ("tunerd/jobs/placement.py", "_Job.held"): "a CPU id (-> who holds it)",
}
# Pid-keyed outside the ledger, and why it must stay (at most one more module than the
# ledger: test_pid_maps_live_in_at_most_two_modules).
PID_MAPS_ELSEWHERE: dict[tuple[str, str], str] = {
    ("tunerd/jobs/peer.py", "PidNamespaces._maps"):
        "keyed by a pid namespace's inode; each value is that namespace's pid -> host pid "
        "table, a bounded LRU cache of one /proc scan: its pids are another namespace's "
        "numbers, not host processes the ledger could hold a record of",
}
# Pid-keyed maps still to move into ledger slots: none since issue 33 item 6 (26 maps in
# 9 modules were moved). A map listed here that is gone fails
# test_known_pid_maps_still_exist, so the set cannot go stale.
KNOWN_UNTIL_SLOTS_MERGE: set[tuple[str, str]] = set()
CONTAINER_CALLS = {"dict", "set", "OrderedDict", "defaultdict", "Counter",
                   "WeakValueDictionary", "WeakKeyDictionary", "WeakSet"}


def _aliases(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level type aliases (``PidMap = dict[int, X]``, ``Pid = NewType("Pid",
    int)``, ``X: TypeAlias = ...``), so an alias cannot hide a key type."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.value is not None and "TypeAlias" in ast.unparse(node.annotation):
            name, value = node.target.id, node.value
        else:
            continue
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "NewType" \
                and len(value.args) == 2:
            value = value.args[1]
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            try:
                value = ast.parse(value.value, mode="eval").body
            except SyntaxError:
                continue
        if isinstance(value, ast.Subscript | ast.Name | ast.Attribute | ast.BinOp):
            out[name] = value
    return out


def _type_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _key_text(node: ast.expr, aliases: dict[str, ast.expr], depth: int = 0) -> str:
    """A key type as the rule reads it: aliases resolved, ``typing.``/``Tuple`` spelt
    as builtins (``tuple[int, int]``)."""
    if isinstance(node, ast.Name) and node.id in aliases and depth < 8:
        return _key_text(aliases[node.id], aliases, depth + 1)
    if isinstance(node, ast.Subscript) and _type_name(node.value) in ("tuple", "Tuple"):
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return f"tuple[{', '.join(_key_text(e, aliases, depth + 1) for e in elts)}]"
    return _type_name(node) or ast.unparse(node)


def pid_keyed_annotation(ann: ast.expr, aliases: dict[str, ast.expr]) -> str | None:
    """The first map or set type in ``ann`` keyed by a process (a pid, a ProcKey or a
    ``(pid, start)`` tuple), written out; None when there is none. Unions, Optional,
    ClassVar and a map's values are searched too (``dict[str, set[int]]`` holds pids
    of each job)."""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    seen = 0
    todo = [ann]
    while todo and seen < 64:
        node = todo.pop()
        seen += 1
        if isinstance(node, ast.Name) and node.id in aliases:
            todo.append(aliases[node.id])
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                todo.append(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                pass
            continue
        if isinstance(node, ast.BinOp):
            todo += [node.left, node.right]
            continue
        if not isinstance(node, ast.Subscript):
            continue
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if _type_name(node.value) in KEYED and args \
                and _key_text(args[0], aliases) in PID_KEYS:
            return ast.unparse(node)
        todo += list(args)
    return None


def _is_container(value: ast.expr | None) -> bool:
    """``{}``, ``set()``, ``dict()``, ``OrderedDict()``, ``defaultdict(...)`` and the
    like, comprehensions included."""
    if isinstance(value, ast.Dict | ast.Set | ast.DictComp | ast.SetComp):
        return True
    return isinstance(value, ast.Call) and _type_name(value.func) in CONTAINER_CALLS


class _Attrs(ast.NodeVisitor):
    """Each class's attributes in one module: annotated (on ``self`` or in the class
    body) and those given a container literal without an annotation."""

    def __init__(self, rel: str, aliases: dict[str, ast.expr]) -> None:
        self.rel, self.aliases = rel, aliases
        self.cls: list[str] = []
        self.annotated: dict[str, tuple[int, ast.expr]] = {}  # Class.attr -> (line, type)
        self.bare: dict[str, int] = {}  # Class.attr -> line of `self.x = {}`

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.cls.append(node.name)
        for stmt in node.body:  # class fields (dataclass fields, ClassVars)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                self.annotated[f"{node.name}.{stmt.target.id}"] = (stmt.lineno, stmt.annotation)
            elif isinstance(stmt, ast.Assign) and _is_container(stmt.value):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        self.bare.setdefault(f"{node.name}.{t.id}", stmt.lineno)
        self.generic_visit(node)
        self.cls.pop()

    def _self_attr(self, target: ast.expr) -> str | None:
        if self.cls and isinstance(target, ast.Attribute) \
                and isinstance(target.value, ast.Name) and target.value.id == "self":
            return f"{self.cls[-1]}.{target.attr}"
        return None

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        name = self._self_attr(node.target)
        if name is not None:
            self.annotated.setdefault(name, (node.lineno, node.annotation))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            pairs: list[tuple[ast.expr, ast.expr]] = [(t, node.value)]
            if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                # self.a, self.b = {}, set()
                pairs = list(zip(t.elts, node.value.elts, strict=False))
            for target, value in pairs:
                name = self._self_attr(target)
                if name is not None and _is_container(value):
                    self.bare.setdefault(name, node.lineno)
        self.generic_visit(node)


def pid_keyed_maps(sources: dict[str, str],
                   allowed: set[tuple[str, str]] | None = None) -> list[tuple[str, str, str]]:
    """Rule 11 over ``sources``: (file, Class.attr, what) for each attribute of a class
    in tunerd/jobs/ (outside the ledger) that is a map or set keyed by a process, and
    each one given a container literal with no annotation to read its key type from.
    Module-level annotated maps count too (``_SEEN: dict[int, X] = {}``). ``allowed``:
    (file, attribute)s let pass, by default ALLOWED_INT_KEYS and PID_MAPS_ELSEWHERE."""
    if allowed is None:
        allowed = set(ALLOWED_INT_KEYS) | set(PID_MAPS_ELSEWHERE)
    out = []
    for rel, text in sorted(sources.items()):
        if not rel.startswith(JOBS) or rel == LEDGER:
            continue
        tree = ast.parse(text, filename=rel)
        aliases = _aliases(tree)
        v = _Attrs(rel, aliases)
        v.visit(tree)
        for stmt in tree.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                    and "TypeAlias" not in ast.unparse(stmt.annotation):
                v.annotated.setdefault(stmt.target.id, (stmt.lineno, stmt.annotation))
        for name, (line, ann) in sorted(v.annotated.items()):
            hit = pid_keyed_annotation(ann, aliases)
            if hit is not None and (rel, name) not in allowed:
                out.append((rel, name, f"{rel}:{line}: {name}: {ast.unparse(ann)}: {hit} is "
                            "keyed by a process: make it a Slot of jobs/ledger.py, or list "
                            "what the int is in ALLOWED_INT_KEYS (docs/layers.md, rule 11)"))
        for name, line in sorted(v.bare.items()):
            if name not in v.annotated:
                out.append((rel, name, f"{rel}:{line}: {name} is a map or set with no "
                            "annotation: annotate its key type (docs/layers.md, rule 11)"))
    return out


def test_pid_keyed_maps_live_only_in_the_ledger() -> None:
    found = pid_keyed_maps(SOURCES)
    assert [what for rel, name, what in found
            if (rel, name) not in KNOWN_UNTIL_SLOTS_MERGE] == []
    # the ledger itself is pid-keyed (the check reads what it should)
    assert pid_keyed_maps({"tunerd/jobs/elsewhere.py": SOURCES[LEDGER]})


def test_known_pid_maps_still_exist() -> None:
    """Each map the slot branches are moving is still there: moved meanwhile, take it
    off KNOWN_UNTIL_SLOTS_MERGE (the lead empties it as the branches merge)."""
    found = {(rel, name) for rel, name, _ in pid_keyed_maps(SOURCES)}
    assert found >= KNOWN_UNTIL_SLOTS_MERGE, sorted(KNOWN_UNTIL_SLOTS_MERGE - found)


def test_allowed_int_keys_are_still_int_keyed() -> None:
    """The exceptions are real: each still exists with an int (or pid-like) key, so a
    removed or renamed map leaves no stale entry that a new pid map could hide behind."""
    allowed = set(ALLOWED_INT_KEYS) | set(PID_MAPS_ELSEWHERE)
    unlisted = {(rel, name) for rel, name, _ in pid_keyed_maps(SOURCES, allowed=set())}
    assert unlisted >= allowed, sorted(allowed - unlisted)
    assert not allowed & KNOWN_UNTIL_SLOTS_MERGE


def test_pid_maps_live_in_at_most_two_modules() -> None:
    """The ledger and at most one more module of jobs/ (issue 33 item 6)."""
    assert len({rel for rel, _ in PID_MAPS_ELSEWHERE} - {LEDGER}) <= 1
    assert all(rel.startswith(JOBS) for rel, _ in PID_MAPS_ELSEWHERE)


PLANTED_CLASS = "class Binder:\n    def __init__(self) -> None:\n        {}\n"


@pytest.mark.parametrize("planted", [
    PLANTED_CLASS.format("self.bound: dict[int, str] = {}"),
    PLANTED_CLASS.format("self.seen: set[int] = set()"),
    PLANTED_CLASS.format("self.where: dict[tuple[int, int], str] = {}"),
    PLANTED_CLASS.format("self.where: 'Dict[Tuple[int, int], str]' = {}"),
    PLANTED_CLASS.format("self.recs: OrderedDict[ProcKey, int] = OrderedDict()"),
    PLANTED_CLASS.format("self.waits: defaultdict[int, list[str]] = defaultdict(list)"),
    PLANTED_CLASS.format("self.jobs: dict[str, set[int]] = {}"),  # job -> its pids
    PLANTED_CLASS.format("self.maybe: dict[int, str] | None = None"),
    PLANTED_CLASS.format("self.cache = {}"),  # no annotation: its key type is unknown
    PLANTED_CLASS.format("self.a, self.b = {}, set()"),
    "from dataclasses import dataclass, field\n@dataclass\nclass Memory:\n"
    "    settled: set[int] = field(default_factory=set)\n",
    "PidMap = dict[int, str]\n" + PLANTED_CLASS.format("self.m: PidMap = {}"),
    "from typing import NewType\nPid = NewType('Pid', int)\n"
    + PLANTED_CLASS.format("self.m: dict[Pid, str] = {}"),
    "_SEEN: set[tuple[int, int]] = set()\n",  # module level
])
def test_a_planted_pid_keyed_map_is_caught(planted: str) -> None:
    found = pid_keyed_maps({"tunerd/jobs/registry.py": planted})
    assert found, planted
    assert all((rel, name) not in KNOWN_UNTIL_SLOTS_MERGE for rel, name, _ in found)


@pytest.mark.parametrize("allowed", [
    PLANTED_CLASS.format("self.by_name: dict[str, int] = {}"),
    PLANTED_CLASS.format("self.cpus: frozenset[int] = frozenset()"),  # a value
    PLANTED_CLASS.format("self.order: list[int] = []"),
    PLANTED_CLASS.format("self.cache: dict[str, int] = {}\n        self.cache = {}"),
    "class C:\n    names: dict[str, int] = {}\n    def f(self) -> None:\n"
    "        self.names = {}\n",
    "def f() -> None:\n    local: dict[int, str] = {}\n    seen = set()\n",  # locals
])
def test_what_is_not_a_pid_map_passes(allowed: str) -> None:
    assert pid_keyed_maps({"tunerd/jobs/registry.py": allowed}) == []


def test_pid_maps_outside_jobs_or_in_the_ledger_pass() -> None:
    planted = PLANTED_CLASS.format("self.bound: dict[int, str] = {}")
    assert pid_keyed_maps({LEDGER: planted, "tunerd/daemon/app.py": planted}) == []
    # an allowed name in another module is not allowed
    assert pid_keyed_maps({"tunerd/jobs/registry.py": planted.replace(
        "class Binder", "class GpuUse").replace("bound", "_minors")})
