"""The generated API page is current, and the README starts with the two commands CI relies on."""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_api_md_is_current():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    gen_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_api)
    assert (ROOT / "docs" / "api.md").read_text() == gen_api.render(), "run: python docs/gen_api.py"


def test_readme_starts_with_install_and_test_commands():
    lines = [l for l in (ROOT / "README.md").read_text().splitlines() if l.startswith("pip install")]
    assert "python -m lossfx.selfcheck" in lines[0]
    readme_test = lines[1].split("&&")[1].split("#")[0].split()  # e.g. python -m pytest -n auto
    assert readme_test[:3] == ["python", "-m", "pytest"]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ["python3", *readme_test[1:]] in [line.split() for line in ci], "CI runs the README's test command"


def _written_files():
    for pattern in ("*.md", "docs/*.md", "proofs/*.md", "benchmarks/*.md", "examples/*.md"):
        yield from ROOT.glob(pattern)
    for folder in ("lossfx", "benchmarks", "examples", "tests"):
        yield from (ROOT / folder).rglob("*.py")


def test_the_repository_stands_alone():
    """No doc, docstring or comment points at material outside the repository (the spec pages the
    project started from): what was adopted from them lives in docs/decisions.md."""
    outside = ("shared/", "semantics.md", "seed-api", "anchors.md", "conventions.md")
    this_file = pathlib.Path(__file__).resolve()
    offenders = []
    for path in _written_files():
        if path.resolve() == this_file:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(word in line for word in outside):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "references outside the repository:\n" + "\n".join(offenders)
    assert (ROOT / "docs" / "decisions.md").is_file()


def _decision_numbers() -> set[str]:
    """`{"1", "2", "2.1", ...}`: the sections (`## N.`) of docs/decisions.md and their numbered items."""
    numbers, section = set(), None
    for line in (ROOT / "docs" / "decisions.md").read_text().splitlines():
        if heading := re.match(r"## (\d+)\. ", line):
            section = heading.group(1)
            numbers.add(section)
        elif line.startswith("## "):
            section = None
        elif section and (item := re.match(r"(\d+)\. ", line)):
            numbers.add(f"{section}.{item.group(1)}")
    return numbers


def test_every_cited_decision_exists():
    """A citation `decisions.md §N` (or `§N.M`) anywhere points at a section or item of docs/decisions.md."""
    numbers = _decision_numbers()
    assert {"1", "2.5", "2.9", "3", "4"} <= numbers  # the parser is not vacuous
    cited, missing = 0, []
    for path in _written_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for ref in re.findall(r"decisions(?:\.md)?\)?,? ?§ ?(\d+(?:\.\d+)?)", line):
                cited += 1
                if ref not in numbers:
                    missing.append(f"{path.relative_to(ROOT)}:{number}: §{ref}")
    assert cited > 5 and not missing, "citations of docs/decisions.md that point nowhere:\n" + "\n".join(missing)
