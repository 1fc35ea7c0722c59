"""Every relative link and anchor in README.md, CHANGELOG.md and docs/*.md resolves.

A link is `[text](path#anchor)`, `![alt](path)` or a bare `[text](#anchor)`. Its path is read
relative to the linking file and must exist inside the repository; its anchor must match a
heading of the target under GitHub's rules (lowercase, markup and punctuation other than '-'
and '_' dropped, spaces to '-', a repeated heading gets -1, -2, ...). Only absolute URLs
(http, https, mailto) are skipped. Code blocks and inline code are not read for links or
headings.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_SKIPPED = re.compile(r"^(https?|mailto):", re.IGNORECASE)
_LINE_ANCHOR = re.compile(r"^L\d+(-L\d+)?$")


def _prose_lines(text: str) -> list[str]:
    """The file's lines outside fenced code blocks and HTML comments."""
    text = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL)
    lines, fence = [], None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)     # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text)                         # inline HTML tags
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file offers: its headings' slugs (repeats numbered) and HTML anchors."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The link targets of a markdown file, outside code; a link's text may wrap a line."""
    prose = _CODE_SPAN.sub("", "\n".join(_prose_lines(path.read_text(encoding="utf-8"))))
    return [m.group(2) for m in _LINK.finditer(prose)]


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """Each link of `path` that does not resolve, with why."""
    broken = []
    for target in links(path):
        if _SKIPPED.match(target):
            continue
        if not target:
            broken.append(f"{target!r}: empty link")
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.is_relative_to(root.resolve()):
            broken.append(f"{target!r}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target!r}: {dest.relative_to(root.resolve())} does not exist")
        elif not anchor:
            continue
        elif dest.is_dir():
            broken.append(f"{target!r}: an anchor on a folder")
        elif dest.suffix.lower() == ".md":
            if unquote(anchor) not in anchors(dest):
                broken.append(f"{target!r}: no heading in {dest.name} has the anchor #{anchor}")
        elif not _LINE_ANCHOR.match(anchor):
            broken.append(f"{target!r}: #{anchor} is not a line anchor (#L10, #L10-L20)")
    return broken


def test_the_documentation_files_are_there():
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    assert {"README.md", "CHANGELOG.md", "docs/index.md", "docs/performance.md",
            "docs/build-under-test.md"} <= names


@pytest.mark.parametrize("path", DOCS, ids=[p.relative_to(REPO).as_posix() for p in DOCS])
def test_every_relative_link_and_anchor_resolves(path):
    assert broken_links(path) == []


def test_every_docs_page_is_reachable_from_the_readme_or_the_index():
    linked = set()
    for page in (REPO / "README.md", REPO / "docs" / "index.md"):
        linked |= {(page.parent / t.partition("#")[0]).resolve() for t in links(page) if not _SKIPPED.match(t)}
    assert [p.name for p in DOCS if p.parent.name == "docs" and p.resolve() not in linked
            and p.name != "index.md"] == []


def test_slugs_follow_githubs_rules():
    assert slug("The vLLM under test") == "the-vllm-under-test"
    assert slug("Set-up: two commands") == "set-up-two-commands"
    assert slug("History, drift and charts") == "history-drift-and-charts"
    assert slug("How `cpu_e2e` runs") == "how-cpu_e2e-runs"
    assert slug("The wrapper: `scripts/run-cpu-test.sh`") == "the-wrapper-scriptsrun-cpu-testsh"
    assert slug("vLLM's own pipeline") == "vllms-own-pipeline"
    assert (slug("2026-11-30: issue 12, before the bench of 18:42 UTC")
            == "2026-11-30-issue-12-before-the-bench-of-1842-utc")
    assert slug("**Bold** and [a link](x.md)") == "bold-and-a-link"


def test_a_broken_file_or_anchor_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Same\n\n## Same\n\n```\n# not a heading\n```\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "[ok](docs/page.md) [ok](docs/page.md#a-page) [ok](docs/page.md#same-1) [ok](#top)\n"
        "[web](https://example.com/x#y) [mail](mailto:a@b.c) `[in code](nowhere.md)`\n"
        "[gone](docs/missing.md) [bad anchor](docs/page.md#nope) [bad local](#nowhere)\n"
        "[code heading](docs/page.md#not-a-heading) [escape](../outside.md) [a wrapped\nlink](gone.md)\n"
        "```\n[in a block](nowhere.md)\n```\n")
    assert broken_links(readme, tmp_path) == [
        "'docs/missing.md': docs/missing.md does not exist",
        "'docs/page.md#nope': no heading in page.md has the anchor #nope",
        "'#nowhere': no heading in README.md has the anchor #nowhere",
        "'docs/page.md#not-a-heading': no heading in page.md has the anchor #not-a-heading",
        "'../outside.md': outside the repository",
        "'gone.md': gone.md does not exist",
    ]


def _noxfile_defaults() -> dict[str, bool]:
    """Each session of noxfile.py and whether a bare `nox` runs it (nox's default=True unless said)."""
    import ast

    found = {}
    for node in ast.parse((REPO / "noxfile.py").read_text(encoding="utf-8")).body:
        for decorator in getattr(node, "decorator_list", []):
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "nox.session":
                default = next((k.value for k in decorator.keywords if k.arg == "default"), ast.Constant(True))
                found[node.name] = bool(ast.literal_eval(default))
    return found


def test_the_sessions_a_bare_nox_runs_are_the_ones_the_readme_says():
    """README's sessions table says, per session, whether `nox` runs it by default (yes/no)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    table = text[text.index("## Sessions"):text.index("### Session options")]
    said = {m.group(1): m.group(2) == "yes" for m in re.finditer(r"^\| `(\w+)` \|.*\| (yes|no)\b[^|]*\|$", table, re.M)}
    assert said and said == _noxfile_defaults()
