"""Code lines of the boundary (`_boundary/` + the public faces) against the maths (`_core`,
`_kernels`, `_layouts`): issue 25's size measure, reproducible.

A code line is a line holding a Python token other than a comment, and not inside a docstring
(a string statement: module, class or function documentation). Blank lines, comments and
docstrings are not counted. Run `python3 benchmarks/code_lines.py` from the repository root;
`--tests` counts the boundary's own tests the same way (`--root DIR`: another checkout, e.g. a
`git worktree` of an older commit; files it lacks are skipped).
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lossfx"
# the public faces: the public functions and the entry points (docs/design.md, "Layers")
PUBLIC = (
    "logprobs gather filtering divergence topk fused_linear linear_filtering linear_objective linear_divergence "
    "context_parallel sequence_layout next_token packing draft distillation opd_full loss_masks interfaces "
    "loss_input linear_loss_input"
).split()
BOUNDARY = ["_boundary/*.py", *(f"{m}.py" for m in PUBLIC)]
MATHS = ["_core/*.py", "_kernels/*.py", "_layouts/*.py"]
# the boundary's own tests: cross-rank checks, DTensor views, argument errors, the adversarial suite
# (every name they have had, so that `--root` of an older checkout counts the same set)
BOUNDARY_TESTS = (
    "adversarial_cases test_adversarial test_adversarial_heldout test_boundary_once test_check_order "
    "test_check_trace_cost test_compile_errors test_debug_mode test_dtensor test_dtensor_fused test_errors "
    "test_front_door_checks test_group_names test_host_reads test_opd_full_dtensor test_parameters "
    "test_rank_agreement test_rank_consistency test_rank_consistency_fused"
).split()


def code_lines(path: Path) -> int:
    """Lines of `path` with a token that is neither a comment nor part of a docstring."""
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def total(patterns: list[str], folder: Path = PACKAGE) -> dict[str, int]:
    """`{path: code lines}` of the files matching `patterns` under `folder` (`lossfx/`)."""
    files = sorted({p for pattern in patterns for p in folder.glob(pattern)})
    return {str(p.relative_to(folder)): code_lines(p) for p in files}


def main() -> None:
    root = Path(sys.argv[sys.argv.index("--root") + 1]).resolve() if "--root" in sys.argv else ROOT
    if "--tests" in sys.argv:
        tests = total([f"{name}.py" for name in BOUNDARY_TESTS], root / "tests")
        if "-v" in sys.argv:
            for name, n in sorted(tests.items(), key=lambda x: -x[1]):
                print(f"{n:6d}  {name}")
        print(f"the boundary's tests ({len(tests)} files): {sum(tests.values())} code lines")
        return
    boundary, maths = total(BOUNDARY, root / "lossfx"), total(MATHS, root / "lossfx")
    if "-v" in sys.argv:
        for name, n in sorted({**boundary, **maths}.items(), key=lambda x: -x[1]):
            print(f"{n:6d}  {name}")
    b, m = sum(boundary.values()), sum(maths.values())
    print(f"boundary (_boundary/ + public faces): {b} code lines")
    print(f"maths (_core + _kernels + _layouts):  {m} code lines")
    print(f"ratio boundary / maths: {b / m:.2f}")


if __name__ == "__main__":
    main()
