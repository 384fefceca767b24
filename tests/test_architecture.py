"""The package's shape, checked from its source (``ast``, no imports run): layers, no import cycles, module size.

Layers, lowest first; a module may import its own layer and those below, never one above - whether the
import is at the top of the module or inside a function (a lazy import is still a dependency):

    base      errors, limits, dtypes, _version, saves_in_flight
    formats   bytes on disk: torch zip, pickle policy and writer, safetensors, positional reads, casts
    zero      DeepSpeed's rules: layout, grid, reader, partitioning, optimizer state, companion files
    plan      pure plans: segments, consolidate, reshard, restage
    io        moving bytes: the reader, the writers, staging and publishing outputs (one commit protocol)
    parallel  the processes of a run (one, or torchrun's over gloo): views, byte transfer, shared publishing
    export    output formats and convert targets (registries + one module each), the client-state sidecar
    api       the public operations, one code path for one process or many: consolidate, reshard, convert, ...
    analysis  inspect, stats, diff, plot
    checkpoint_engine  torch + DeepSpeed: the background save, its commit protocol, weights-only and planned loads
    runtime   torch + DeepSpeed: training, resume
    cli       the commands
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dsckpt"
LAYERS = ("base", "formats", "zero", "plan", "io", "parallel", "export", "api", "analysis", "checkpoint_engine", "runtime",
          "cli")
BASE = {"errors", "limits", "dtypes", "_version", "jsondoc", "progress", "saves_in_flight"}
ENTRY_POINTS = {"dsckpt", "dsckpt.__main__"}  # the package root re-exports the API; it is above everything
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _known(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(every import, top-level imports only): module -> the dsckpt modules it imports."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    every: dict[str, set[str]] = {m: set() for m in modules}
    top: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        top_nodes = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                found = _known(target, modules) if target.startswith("dsckpt") else None
                if found and found != mod:
                    every[mod].add(found)
                    if id(node) in top_nodes:
                        top[mod].add(found)
    return every, top


def layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return 0 if part in BASE else LAYERS.index(part)


def test_no_import_reaches_a_higher_layer():
    every, _ = import_graph()
    upward = sorted(f"{m} ({LAYERS[layer(m)]}) imports {t} ({LAYERS[layer(t)]})"
                    for m, targets in every.items() if m not in ENTRY_POINTS
                    for t in targets if t not in ENTRY_POINTS and layer(t) > layer(m))
    assert upward == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    every, _ = import_graph()
    inner = {m: {t for t in ts if t not in ENTRY_POINTS and not m.startswith(t + ".")}  # (a package's own __init__)
             for m, ts in every.items() if m not in ENTRY_POINTS}
    assert _cycles(inner) == []


def test_modules_stay_small():
    long = {_module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def private_imports() -> list[str]:
    """``from X import _name`` across modules: another module's private name (a package's own __init__ aside)."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dsckpt")):
                found += [f"{_module_name(path)} imports {node.module or '.'}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return sorted(found)


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_the_checker_sees_violations():
    """The rules above are not vacuous: the graph holds the edges the code has."""
    every, top = import_graph()
    assert "dsckpt.plan.segments" in every["dsckpt.io.read"]
    assert "dsckpt.export.registry" in every["dsckpt.api.consolidation"]
    assert layer("dsckpt.cli.app") > layer("dsckpt.api.resharding") > layer("dsckpt.zero.layout")
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


# Module-level containers the write path may hold: caches of what a name or size always means, never a write's state.
CACHES = {"dsckpt.formats.crc._uses", "dsckpt.formats.pickle_policy._opaque_types", "dsckpt.formats.pickle_policy._SIZES"}


def test_a_write_runs_in_its_context_not_in_module_state():
    """#53: what a write runs with (storage, CRC ledger, streams, durable temps, progress) is handed down in one
    ``io.context.WriteContext``; no module of the write path keeps an empty list, set or dict at module level to be
    filled while a write runs (the four registries that did: ``ARRIVING``, ``_RECORDING``, ``_ACTIVE``,
    ``_durable``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module.split(".")[1:2] not in (["formats"], ["io"], ["parallel"], ["export"], ["api"]):
            continue
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            target, value = node.targets[0] if isinstance(node, ast.Assign) else node.target, node.value
            empty = (isinstance(value, (ast.List, ast.Set)) and not value.elts) \
                or (isinstance(value, ast.Dict) and not value.keys) \
                or (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    and value.func.id in ("list", "set", "dict") and not value.args)
            if empty and isinstance(target, ast.Name) and f"{module}.{target.id}" not in CACHES:
                found.append(f"{module}.{target.id}")
    assert found == []


# The storage modules: the one test of a path for a store (is_url) and the backend it picks (storage_for).
STORAGE_MODULES = {"dsckpt.formats.storage", "dsckpt.formats.backends"}
# Where a path's storage is chosen, once: what a reading command opens, a converter's source, a writing verb's
# checkpoint and its OUT, the engine's save target, and a zip's index or a CRC check given a bare path.
STORAGE_CHOSEN = {"dsckpt.parallel.readable": "what a reading command or a converter's source opens",
                  "dsckpt.parallel.view": "a writing verb's checkpoint (build_view)",
                  "dsckpt.api.frame": "a writing verb's OUT (destination)",
                  "dsckpt.checkpoint_engine.commit": "the engine's save target (Targets.for_path)",
                  "dsckpt.formats.torchzip": "a zip's index of a bare path",
                  "dsckpt.io.integrity": "a CRC check of a bare path"}


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def test_storage_is_chosen_once_where_a_path_enters():
    """#53 point 1: no URL test outside the storage modules (``is_url``, ``URL_RE``); a path's backend is what
    ``formats.backends.storage_for`` returns, asked where a path enters (``STORAGE_CHOSEN``) and nowhere below it:
    the layers under an entry point get what it chose (a view with its store, a staging destination, a local copy).
    Fails on the previous commit: parallel.readable, parallel.view, api.frame and checkpoint_engine.commit asked
    ``is_url`` themselves."""
    testing, choosing = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        module, names = _module_name(path), _names(path)
        if names & {"is_url", "URL_RE"} and module not in STORAGE_MODULES:
            testing.append(module)
        if "storage_for" in names and module not in STORAGE_MODULES:
            choosing.append(module)
    assert testing == []
    assert sorted(choosing) == sorted(STORAGE_CHOSEN)
