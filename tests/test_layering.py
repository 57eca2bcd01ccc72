"""The import layering of `lossfx/` is the one `docs/design.md` draws, and has no cycle.

The layer table is parsed from docs/design.md ("## Layers"), so the documentation and the code
cannot drift apart: a new module must be placed in the table, and an import that points up the
table (or sideways where the table forbids it) fails here. Every import is read with `ast`,
including imports inside functions (a lazy import hides a cycle from Python, not from this test).
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lossfx"


def _layer_table() -> tuple[dict[str, str], dict[str, set[str]]]:
    """`(module → layer, layer → layers it may import)` from the table in docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layer_of: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        layer, modules, may_import = cells
        allowed[layer] = {x.strip() for x in may_import.split(",")} if not may_import.startswith("(") else set()
        for module in re.findall(r"`([\w.]+)`", modules):
            assert module not in layer_of, f"{module} is listed twice in the design.md layer table"
            layer_of[module] = layer
    assert layer_of, "no layer table found under '## Layers' in docs/design.md"
    return layer_of, allowed


def _module_name(path: pathlib.Path) -> str:
    """`lossfx/reference/_logprobs.py` → `reference._logprobs`; `lossfx/__init__.py` → `__init__`."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(dotted: str, modules: dict[str, pathlib.Path]) -> str:
    """`lossfx.x.y` → the module it loads: `x.y` if that is a module, else `x`, ... else `__init__`."""
    parts = dotted.split(".")[1:]
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return "__init__"


def _imports(source: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """Every lossfx module that `source` imports, at any depth of its syntax tree."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name, modules) for a in node.names if a.name.split(".")[0] == "lossfx"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "lossfx":
            for alias in node.names:  # `from lossfx import reference` imports a module, not a name
                found.add(_resolve(f"{node.module}.{alias.name}", modules))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"line {node.lineno}: use absolute imports (`from lossfx.x import y`)")
    return found


def _layer(module: str, layer_of: dict[str, str]) -> str:
    if module in layer_of:
        return layer_of[module]
    top = module.split(".")[0]
    if top in layer_of and module != top:  # a subpackage listed as a whole, e.g. `reference`
        return layer_of[top]
    raise AssertionError(
        f"lossfx/{module.replace('.', '/')} is in no layer: add it to the table under '## Layers' in docs/design.md"
    )


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path.read_text(), modules) - {name} for name, path in modules.items()}


def test_every_module_is_in_the_layer_table_and_every_listed_module_exists():
    layer_of, allowed = _layer_table()
    modules = _modules()
    for module in modules:
        _layer(module, layer_of)
    for module in layer_of:
        assert module in modules, f"docs/design.md lists `{module}` but lossfx/ has no such module"
    for layer, may_import in allowed.items():
        assert may_import <= set(allowed), f"layer {layer!r} may import unknown layers {may_import - set(allowed)}"


def test_imports_only_point_down_the_layer_table():
    layer_of, allowed = _layer_table()
    violations = []
    for module, imported in _graph().items():
        layer = _layer(module, layer_of)
        for dep in sorted(imported):
            dep_layer = _layer(dep, layer_of)
            if dep_layer not in allowed[layer]:
                violations.append(f"{module} ({layer}) imports {dep} ({dep_layer})")
    assert not violations, "imports against docs/design.md's layer table:\n" + "\n".join(violations)


def test_kernels_import_only_the_floors_below():
    """The issue's rule spelled out, independently of the table's third column: the pure floors
    never import the boundary (nor anything above them)."""
    layer_of, _ = _layer_table()
    graph = _graph()
    floors = {  # every module of a package listed as a whole (`_kernels.filtering`) included
        "pure kernels": ("ground", "core", "pure kernels"),
        "pure layouts": ("ground", "core", "pure kernels", "pure layouts"),
    }
    for module in graph:
        layer = _layer(module, layer_of)
        if layer in floors:
            wrong = {dep for dep in graph[module] if _layer(dep, layer_of) not in floors[layer]}
            assert not wrong, f"{layer} module {module} imports {sorted(wrong)}"


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_checker_sees_function_level_and_package_imports():
    """The parser is not vacuous: it sees the lazy import that hid the old `filtering` ↔ `next_token` cycle."""
    modules = {name: PACKAGE / f"{name}.py" for name in ("__init__", "filtering", "next_token", "reference")}
    lazy = "def f():\n    from lossfx.next_token import sharded_next_token_logprobs\n"
    eager = "import torch\nimport lossfx.filtering\nfrom lossfx import reference, entropy\n"
    assert _imports(lazy, modules) == {"next_token"}
    assert _imports(eager, modules) == {"filtering", "reference", "__init__"}


# The floors below the public functions know no parameter of them: the cross-rank check learns
# which parameters are the groups, the vocabulary shards and their layout from the `Roles` each
# public function declares (`boundary(roles=...)`), and the DTensor boundary gets the names its
# messages use and its views fill in from the caller (the sharded argument's `name`, its `Roles`).
FLOORS = ("ground", "core", "pure kernels", "pure layouts", "boundary")
PROTOCOL = {"cp_group"}  # the attribute a context-parallel sharder object carries (not a parameter)


def _public_parameters() -> set[str]:
    """Parameter names of the public functions and entry points."""
    import importlib
    import inspect

    layer_of, _ = _layer_table()
    names: set[str] = set()
    for module, layer in layer_of.items():
        if layer not in ("public functions", "entry points"):
            continue
        mod = importlib.import_module(f"lossfx.{module}")
        for public in getattr(mod, "__all__", []):
            obj = getattr(mod, public)
            if callable(obj) and not inspect.isclass(obj):
                names |= set(inspect.signature(obj).parameters)
    return names


def _string_literals(source: str) -> set[str]:
    """String constants of `source` but docstrings, f-string format specs (`:016x`) and the
    module's own exported names (`__all__`: a pure `shard` function is no `shard` parameter)."""
    tree = ast.parse(source)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            skip |= {id(n) for n in ast.walk(node.value)}
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            skip.add(id(first.value))
        if isinstance(node, ast.FormattedValue) and node.format_spec is not None:
            skip |= {id(n) for n in ast.walk(node.format_spec)}
    constants = (n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return {n.value for n in constants if id(n) not in skip}


def test_foundations_name_no_parameter_of_the_floors_above():
    params = _public_parameters()
    assert {"logits", "vocab_parallel_group", "teacher_output_layer_weight_by_index"} <= params  # not vacuous
    layer_of, _ = _layer_table()
    scanned = {m: p for m, p in _modules().items() if _layer(m, layer_of) in FLOORS}
    assert {"_boundary.dtensor", "_boundary.consistency", "_core.distributed", "_kernels.logprobs"} <= set(scanned)
    found = {}
    for module, path in scanned.items():
        named = (_string_literals(path.read_text()) & params) - PROTOCOL
        if named:
            found[module] = sorted(named)
    assert not found, f"modules below the public functions name their parameters (declare them with Roles): {found}"


def test_the_literal_scan_sees_a_parameter_name():
    source = '"""doc"""\n__all__ = ["shard"]\nx = f"{v:016x}"\nROLE = ("logits",)\nmsg = f"{v} of logits"\n'
    assert _string_literals(source) == {"logits", " of logits"}
