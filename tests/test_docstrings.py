"""Docstrings that cannot silently contradict the code.

What a machine can check about a docstring, it checks here, over every public function of
`lossfx` and `lossfx.testing` (their `__all__`, which is what docs/api.md is generated from):

1. every parameter of the signature is documented, and every documented parameter exists: the
   `Args:` section names exactly the signature's parameters; a docstring without one names each
   parameter in backticks or defers to a public function that documents it ("as in `f`");
2. no docstring anywhere in the package announces a missing capability ("not yet supported",
   "... until then": the stale claims issue 11 found), and one that names `NotImplementedError`
   belongs to code that raises it; `prepare_loss_input` dispatches every `LossInputType`;
3. every parameter with a default is passed by some test or doctest that calls the function
   (by keyword, as a `"name"` kwargs key, or positionally): a documented option no test passes is
   a claim nobody checks.
"""

from __future__ import annotations

import ast
import doctest
import functools
import inspect
import pathlib
import re
from collections.abc import Callable
from types import SimpleNamespace

import torch

import lossfx
import lossfx.testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A docstring describes what is, not a plan: these phrases are stale the day the feature lands.
# ("Double backward is not supported" is a permanent fact and stays allowed.)
PLANNED = re.compile(r"not yet (supported|implemented)|not (supported|implemented) yet|has not landed|until then")


def _public_functions() -> dict[str, Callable]:
    """The functions of `lossfx.__all__` and `lossfx.testing.__all__`, by name."""
    found = {}
    for module in (lossfx, lossfx.testing):
        for name in sorted(module.__all__):
            if inspect.isfunction(getattr(module, name)):
                assert name not in found, f"{name} is public in two modules"
                found[name] = getattr(module, name)
    return found


def _args_section(doc: str) -> set[str] | None:
    """Names listed in a Google-style `Args:` section (`a, b: ...` lists two); `None` without one."""
    match = re.search(r"^Args:\n((?:[ \t]+\S.*\n?|[ \t]*\n)*)", doc, re.M)
    if match is None:
        return None
    lines = [line for line in match.group(1).splitlines() if line.strip()]
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    names: set[str] = set()
    for line in lines:
        if len(line) - len(line.lstrip()) == indent and ":" in line:
            names |= {n.strip().lstrip("*") for n in line.split(":", 1)[0].split(",")}
    return names


def _documented(name: str, fn: Callable, functions: dict[str, Callable]) -> set[str]:
    """The parameters `fn`'s docstring documents, directly or through a public function it cites."""
    doc = inspect.getdoc(fn) or ""
    listed = _args_section(doc)
    if listed is not None:
        return listed
    quoted = set(re.findall(r"`(\w+)`", doc))
    documented = quoted & set(inspect.signature(fn).parameters)
    for cited in sorted(quoted & set(functions) - {name}):
        documented |= _args_section(inspect.getdoc(functions[cited]) or "") or set()
    return documented


def test_the_args_parser_reads_grouped_and_continued_entries():
    doc = "f.\n\nArgs:\n    x: `[N]` values,\n        continued.\n    top_k, top_p: filter.\n\nReturns:\n    y."
    assert _args_section(doc) == {"x", "top_k", "top_p"}
    assert _args_section("No sections.") is None


def test_every_parameter_is_documented_and_every_documented_parameter_exists():
    functions = _public_functions()
    problems = []
    for name, fn in functions.items():
        params = set(inspect.signature(fn).parameters)
        documented = _documented(name, fn, functions)
        if params - documented:
            problems.append(f"{fn.__module__}.{name}: undocumented {sorted(params - documented)}")
        if _args_section(inspect.getdoc(fn) or "") is not None and documented - params:
            problems.append(f"{fn.__module__}.{name}: documents {sorted(documented - params)}, not in its signature")
    assert not problems, "\n".join(problems)


def _raises_not_implemented(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Raise) and sub.exc is not None:
            exc = sub.exc.func if isinstance(sub.exc, ast.Call) else sub.exc
            if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                return True
    return False


def test_no_docstring_claims_a_missing_capability():
    """No "not yet supported"; and `NotImplementedError` is named only where that code raises it."""
    problems = []
    for path in sorted((ROOT / "lossfx").rglob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        for node in nodes:
            doc = ast.get_docstring(node) or ""  # type: ignore[arg-type]
            where = f"{path.relative_to(ROOT)}: {getattr(node, 'name', 'module docstring')}"
            if match := PLANNED.search(doc):
                problems.append(f"{where} says {match.group(0)!r}")
            if "NotImplementedError" in doc and not _raises_not_implemented(node):
                problems.append(f"{where} names NotImplementedError but raises none")
    assert not problems, "\n".join(problems)


def test_prepare_loss_input_has_a_branch_for_every_input_type():
    """Its docstring lists no NotImplementedError: no input type may reach the fallback raise."""
    logits = torch.zeros(1, 4, 8)
    for input_type in lossfx.LossInputType:
        loss_fn = SimpleNamespace(input_type=input_type)
        try:
            lossfx.prepare_loss_input(logits, {}, loss_fn)
        except NotImplementedError as err:
            raise AssertionError(f"{input_type} has no branch: {err}") from err
        except (ValueError, TypeError):
            pass  # missing columns: the branch exists and validates its input


@functools.cache
def _test_sources() -> list[tuple[str, ast.AST]]:
    return [(p.read_text(), ast.parse(p.read_text())) for p in sorted((ROOT / "tests").glob("*.py"))]


def _sources_calling(name: str, fn: Callable) -> list[ast.AST]:
    """Parsed tests that mention `name`, and `fn`'s own doctest examples."""
    trees = [tree for text, tree in _test_sources() if re.search(rf"\b{name}\b", text)]
    for test in doctest.DocTestFinder().find(fn, name, globs={}):
        trees.append(ast.parse("\n".join(example.source for example in test.examples)))
    return trees


def _passed(param: inspect.Parameter, position: int, name: str, trees: list[ast.AST]) -> bool:
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                if any(k.arg == param.name for k in node.keywords):
                    return True  # f(..., p=...) or an indirect call with the keyword (FAST[kind](x, group=g))
                positional = param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and position < len(node.args)
                if callee == name and positional:
                    return True
            if isinstance(node, ast.Dict) and any(
                isinstance(k, ast.Constant) and k.value == param.name for k in node.keys
            ):
                return True  # a kwargs dict splatted into the call
    return False


def test_every_optional_parameter_is_passed_by_some_test_or_doctest():
    problems = []
    for name, fn in _public_functions().items():
        trees = _sources_calling(name, fn)
        if not trees:
            problems.append(f"{fn.__module__}.{name}: no test or doctest mentions it")
            continue
        for position, param in enumerate(inspect.signature(fn).parameters.values()):
            if param.default is not inspect.Parameter.empty and not _passed(param, position, name, trees):
                problems.append(f"{fn.__module__}.{name}({param.name}=...): no test or doctest passes it")
    assert not problems, "\n".join(problems)
