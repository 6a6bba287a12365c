"""The docs say only what holds: every name they give as importable imports, every link resolves.

Names: ``from ddpkit[.module] import A, B`` and ``ddpkit.a.b.C`` anywhere in README.md,
docs/*.md (prose and code) or examples/*.py. Links: every relative ``[text](target)`` outside
code blocks points to a file that exists, and a ``#anchor`` to a heading of that file (GitHub's
slugs). Paths: every ``tests/...``, ``bench/...``, ``examples/...``, ``scripts/...``, ``src/...``
or ``ddpkit/...`` path named outside code blocks exists, and a ``path::test_name`` names a test
of that file.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import ddpkit

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))

FROM_IMPORT = re.compile(r"from (ddpkit(?:\.\w+)*) import (\([^)]*\)|[^\n#]+)")
DOTTED = re.compile(r"(?<![\w./-])ddpkit(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def documented_names() -> dict[str, set[str]]:
    """``{dotted name: files that mention it}`` for every ddpkit name in the docs."""
    found: dict[str, set[str]] = {}
    for doc in DOCS + EXAMPLES:
        text = doc.read_text()
        names = set(DOTTED.findall(text))
        for module, imported in FROM_IMPORT.findall(text):
            listed = [n.split(" as ")[0].strip() for n in imported.strip("()").split(",")]
            names |= {f"{module}.{n}" for n in listed if n}
        for name in names:
            found.setdefault(name, set()).add(_name(doc))
    return found


def resolve(dotted: str) -> object:
    """Import ``ddpkit.a.b.C`` as a user would: modules imported, the rest read as attributes."""
    obj: object = ddpkit
    parts = dotted.split(".")
    for index, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[:index]))
    return obj


NAMES = documented_names()


def test_the_docs_mention_names_to_check():
    assert "ddpkit.init_runtime" in NAMES and "ddpkit.testing.run_distributed" in NAMES
    assert "examples/train_custom.py" in NAMES["ddpkit.build_eval_loader"]


@pytest.mark.parametrize("dotted", sorted(NAMES))
def test_every_documented_name_imports_as_written(dotted):
    try:
        resolve(dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{dotted} (in {', '.join(sorted(NAMES[dotted]))}) does not import: {exc}")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in FENCE.sub("", doc.read_text()).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links() -> list[tuple[str, str]]:
    links = []
    for doc in DOCS:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if not re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                links.append((_name(doc), target))
    return links


LINKS = relative_links()


def test_the_docs_have_links_to_check():
    assert ("README.md", "docs/performance.md") in LINKS


@pytest.mark.parametrize(("doc", "target"), LINKS, ids=[f"{d}->{t}" for d, t in LINKS])
def test_every_relative_link_points_to_an_existing_file_and_heading(doc, target):
    path, _, anchor = target.partition("#")
    resolved = (REPO / doc).parent / path if path else REPO / doc
    assert resolved.exists(), f"{doc} links to {target}: {resolved} does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), (
            f"{doc} links to {target}: no heading of {_name(resolved)} has the anchor #{anchor}"
        )


def test_the_sbatch_script_in_the_slurm_docs_is_the_tested_file():
    # tests/slurm submits examples/slurm/train.sbatch; docs/slurm.md must show that very file
    script = (REPO / "examples" / "slurm" / "train.sbatch").read_text()
    blocks = re.findall(
        r"^```bash\n(.*?)^```", (REPO / "docs" / "slurm.md").read_text(), re.S | re.M
    )
    assert script in blocks


REPO_PATH = re.compile(
    r"(?<![\w./-])((?:tests|bench|examples|scripts|src|docs|ddpkit|\.ci)/[\w./-]*[\w/])"
    r"(?:::\s*(\w+))?"
)


def repo_paths() -> list[tuple[str, str, str]]:
    """``(doc, path, test name or "")`` for every repository path named outside code blocks."""
    found = []
    for doc in DOCS:
        for path, test in REPO_PATH.findall(FENCE.sub("", doc.read_text())):
            found.append((_name(doc), path, test))
    return found


PATHS = repo_paths()


def test_the_docs_name_paths_to_check():
    assert ("README.md", "tests/e2e/test_readme_example.py", "") in PATHS
    assert any(test for _, _, test in PATHS)


@pytest.mark.parametrize(("doc", "path", "test"), PATHS, ids=[f"{d}:{p}" for d, p, _ in PATHS])
def test_every_path_the_docs_name_exists(doc, path, test):
    candidates = [REPO / path, REPO / "src" / path]  # ddpkit/x.py is src/ddpkit/x.py
    existing = [c for c in candidates if c.exists()]
    assert existing, f"{doc} names {path}: no such file or folder in the repository"
    if test:
        assert re.search(rf"^(?:async )?def {test}\(", existing[0].read_text(), re.M), (
            f"{doc} names {path}::{test}: {path} has no test of that name"
        )
