"""The documentation as a reader meets it: every paragraph a whole one (no text cut mid-sentence, none starting
mid-sentence), every snippet section opened and closed, every page opening with a command and its output before the
reference, search that works from a site opened from disk, and configuration keys that break only at their dots."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "examples" not in p.parts and "hooks" not in p.parts)
SENTENCE_END = re.compile(r"""[.!?:](\*{1,2}|`|\)|"|')*$""")  # a paragraph ends a sentence, or opens a list or code
NOT_PROSE = ("#", "|", "- ", "* ", "<!--", "!!!", "???", "```", "    ", ":::", "[^", "--8<--", "1. ")
NAMES = re.compile(r"^(clbench\S*|timm|torchrun|\S*[._/]\S*)\b")  # a paragraph may start with a name in lower case


def nav_pages() -> list[Path]:
    """The pages mkdocs.yml's navigation lists."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))

    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [p for v in node.values() for p in walk(v)]
        if isinstance(node, list):
            return [p for v in node for p in walk(v)]
        return []

    return [DOCS / p for p in walk(config["nav"])]


def prose_paragraphs(text: str) -> list[str]:
    """The page's paragraphs of running text: code blocks, tables, lists, headings, comments and admonitions left
    out; a list item's continuation lines belong to the list."""
    text = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)  # fenced code
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    paragraphs = []
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if lines and not lines[0].lstrip().startswith(NOT_PROSE) and not lines[0].startswith(" "):
            paragraphs.append(" ".join(line.strip() for line in lines))
    return paragraphs


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_paragraph_is_whole(page: Path) -> None:
    """A paragraph ends a sentence (or opens a list or a code block with a colon) and starts one: with a capital,
    a number, code or a link, never with a lower-case word left over from a cut."""
    for paragraph in prose_paragraphs(page.read_text()):
        assert SENTENCE_END.search(paragraph), f"{page.name}: a paragraph stops mid-sentence: ...{paragraph[-80:]!r}"
        first = paragraph[0].islower() and not NAMES.match(paragraph)
        assert not first, f"{page.name}: a paragraph starts mid-sentence: {paragraph[:80]!r}..."


@pytest.mark.parametrize("page", [*PAGES, ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_snippet_sections_open_and_close_and_every_include_names_one(page: Path) -> None:
    text = page.read_text()
    starts = re.findall(r"--8<-- \[start:([\w-]+)\]", text)
    ends = re.findall(r"--8<-- \[end:([\w-]+)\]", text)
    assert sorted(starts) == sorted(ends) and len(set(starts)) == len(starts), f"{page.name}: {starts} vs {ends}"
    for path, section in re.findall(r'--8<-- "([^":]+):([\w-]+)"', text):
        source = (ROOT / path).read_text()
        assert f"[start:{section}]" in source and f"[end:{section}]" in source, f"{page.name}: {path}:{section}"
    for line in re.findall(r"^--8.*$", text, re.M):  # a whole-file include names a file (a formatter can mangle it)
        included = re.fullmatch(r'--8<-- "([^":]+)(:[\w-]+)?"', line)
        assert included and (ROOT / included[1]).is_file(), f"{page.name}: {line!r}"


@pytest.mark.parametrize("page", nav_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_page_opens_with_a_command_and_its_output_before_the_reference(page: Path) -> None:
    """Before the page's first section heading: a command block and a block of what it prints."""
    text = page.read_text()
    opening = text.split("\n## ", 1)[0]
    blocks = re.findall(r"^```(\w*)", opening, flags=re.M)[::2]  # the opening fence of each block
    assert "bash" in blocks and "text" in blocks[blocks.index("bash") :], f"{page.name}: its opening has {blocks}"


def test_search_works_from_a_site_opened_from_disk() -> None:
    """Material's offline plugin: search without a server (the site opened as site/index.html)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in config["plugins"]]
    assert "offline" in plugins and "search" in plugins


def test_configuration_keys_break_only_at_their_dots() -> None:
    """A key cell is code that the browser may break after a dot (<wbr>) and nowhere else: the stylesheet undoes the
    theme's break-anywhere for it."""
    import sys

    sys.path.insert(0, str(DOCS / "hooks"))
    from config_tables import table

    rows = [line for line in table("data").splitlines() if line.startswith("| <code")]
    (synthetic,) = [r for r in rows if "synthetic_train_per_class" in r]
    assert synthetic.startswith('| <code class="config-key">data.<wbr>synthetic_train_per_class</code> |')
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    css = "".join((DOCS / path).read_text() for path in config["extra_css"])
    rule = re.search(r"code\.config-key\s*\{([^}]*)\}", css)
    assert rule and "word-break: normal" in rule.group(1) and "overflow-wrap: normal" in rule.group(1)
