"""Regenerate docs/api.md from the public docstrings: `python docs/gen_api.py`."""

from __future__ import annotations

import inspect
import pathlib
import sys


def render() -> str:
    import lossfx
    import lossfx.reference as reference
    import lossfx.testing as testing

    lines = [
        "# API",
        "",
        "Generated from the docstrings by `python docs/gen_api.py`; `tests/test_docs.py` checks it is current.",
        "",
    ]

    def section(title: str, module, names: list[str]) -> None:
        lines.extend([f"## {title}", ""])
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = "(...)"
            lines.extend([f"### `{module.__name__}.{name}{sig}`", ""])
            doc = inspect.getdoc(obj) or "(no docstring)"
            lines.extend(["```text", doc, "```", ""])

    section("lossfx", lossfx, sorted(n for n in lossfx.__all__ if not n.startswith("_")))
    section("lossfx.reference", reference, sorted(reference.__all__))
    section("lossfx.testing", testing, sorted(testing.__all__))
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    out = pathlib.Path(__file__).with_name("api.md")
    out.write_text(render())
    print(f"wrote {out}", file=sys.stderr)
