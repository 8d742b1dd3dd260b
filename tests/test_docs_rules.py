"""The rule ids the code cites are defined in docs/, and no citation points outside the repository.

Comments, docstrings and conformance checks cite protocol rules by id ("R19", "D33", "A2").
A reader must be able to look each one up: every id is defined once under docs/protocol/ as a
heading `### <id> — <title>`, with a link to the official page it comes from, and docs/rules.md
indexes them all. Citations of sections of an outside document ("digest 5.5", "digest §5.2",
"(digest D4)") cannot be followed by a reader, so none may remain in src/.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
TESTS = ROOT / "tests"
DOCS = ROOT / "docs"
RULES_INDEX = DOCS / "rules.md"
OFFICIAL = "https://agentclientprotocol.com/"

# An id is R, D or A followed by 1 to 99, standing alone: not part of a longer word or number
# ("RFD1", "R100", "D1_x", "0xA1" are not ids), so "R18-R41" and "(R5, R6)" both count.
_RULE_ID = re.compile(r"(?<![A-Za-z0-9_])([RDA][1-9][0-9]?)(?![A-Za-z0-9_])")
_DEFINITION = re.compile(r"^#{2,4} ([RDA][1-9][0-9]?) — \S", re.MULTILINE)
# Section or rule citations of a document that is not in the repository.
_OUTSIDE_CITATIONS = (
    re.compile(r"\bdigest\s*§\s*\d"),  # "digest §5.2"
    re.compile(r"\bdigest\s+\d+(\.\d+)+"),  # "digest 5.5", "(digest 2.4, D22)"
    re.compile(r"\bdigest\s+[RDA][1-9]"),  # "(digest D4)", "digest R41"
    re.compile(r"\bof the digest\b"),  # "R18-R41 of the digest"
    re.compile(r"\bthe digest's (rules|rule numbers|sections)\b"),
    re.compile(r"§\s*\d"),  # any section sign with a number
)
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def rule_ids(text: str) -> set[str]:
    """The rule ids cited in `text`."""
    return set(_RULE_ID.findall(text))


def _python_files() -> list[Path]:
    here = Path(__file__).resolve()
    files = sorted(SRC.rglob("*.py")) + sorted(TESTS.rglob("*.py"))
    return [p for p in files if p.resolve() != here]


def _citations() -> dict[str, list[str]]:
    """Each cited id with the places ("path:line") that cite it, in src/ and tests/."""
    places: dict[str, list[str]] = {}
    for path in _python_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for rule in rule_ids(line):
                places.setdefault(rule, []).append(f"{path.relative_to(ROOT)}:{number}")
    return places


def _doc_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _definitions() -> dict[str, list[tuple[Path, str]]]:
    """Each defined id with (page, section text) for every place that defines it."""
    found: dict[str, list[tuple[Path, str]]] = {}
    for page in _doc_pages():
        text = page.read_text(encoding="utf-8")
        headings = list(re.finditer(r"^#{1,4} .*$", text, re.MULTILINE))
        for i, heading in enumerate(headings):
            match = _DEFINITION.match(heading.group(0))
            if match is None:
                continue
            end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
            found.setdefault(match.group(1), []).append((page, text[heading.start() : end]))
    return found


def test_extraction_finds_ids_and_nothing_else() -> None:
    # The guard is only as good as its extraction: ranges, lists and ids at line ends count;
    # longer words, three-digit numbers, zero and other letters do not.
    text = "see R18-R41 (R5, R6), D33; A7. RFD1 XR1 R100 R0 D1_x 0xA1 T1 `D4`"
    assert rule_ids(text) == {"R18", "R41", "R5", "R6", "D33", "A7", "D4"}


def test_the_code_cites_rules() -> None:
    # If the extraction or the paths broke, every other check here would pass vacuously.
    cited = _citations()
    assert {"R19", "R27", "D33", "D11"} <= cited.keys(), sorted(cited)


def test_every_cited_rule_is_defined_in_docs() -> None:
    defined = _definitions()
    missing = {rule: places for rule, places in _citations().items() if rule not in defined}
    assert not missing, (
        "rule ids cited in the code but defined nowhere under docs/ "
        "(add a `### <id> — <title>` section to a page of docs/protocol/ and to docs/rules.md): "
        + "; ".join(
            f"{rule} at {', '.join(places[:3])}" for rule, places in sorted(missing.items())
        )
    )


def test_each_rule_is_defined_once_with_its_official_source() -> None:
    definitions = _definitions()
    assert len(definitions) >= 100, "the definitions were not found: is the heading format intact?"
    twice = {
        rule: [str(p.relative_to(ROOT)) for p, _ in where]
        for rule, where in definitions.items()
        if len(where) > 1
    }
    assert not twice, f"rule ids defined more than once: {twice}"
    unsourced = sorted(
        {
            rule
            for rule, where in definitions.items()
            for _, section in where
            if OFFICIAL not in section
        }
    )
    assert not unsourced, f"rules without a link to {OFFICIAL}: {unsourced}"


def test_the_index_lists_exactly_the_defined_rules() -> None:
    index = RULES_INDEX.read_text(encoding="utf-8")
    rows = Counter(re.findall(r"^\| ([RDA][1-9][0-9]?) \|", index, re.MULTILINE))
    defined = set(_definitions())
    assert set(rows) == defined, (
        f"in docs/rules.md but not defined: {sorted(set(rows) - defined)}; "
        f"defined but not in docs/rules.md: {sorted(defined - set(rows))}"
    )
    assert all(n == 1 for n in rows.values()), [r for r, n in rows.items() if n > 1]


@pytest.mark.parametrize("pattern", _OUTSIDE_CITATIONS, ids=lambda p: p.pattern)
def test_no_citation_of_an_outside_document(pattern: re.Pattern[str]) -> None:
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "cite the rule id defined in docs/ instead:\n" + "\n".join(hits)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    return {_slug(h) for h in re.findall(r"^#{1,6} (.*)$", text, re.MULTILINE)}


def test_links_between_docs_resolve() -> None:
    # The index and the pages link to each other by anchor; a renamed heading must not leave
    # a link pointing nowhere.
    broken: list[str] = []
    for page in _doc_pages():
        for target in _MD_LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)} -> {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_conformance_check_cites_defined_rule_ids() -> None:
    """`acp-once check` prints each check's refs: each must be an id a reader can look up."""
    from acp_once.conformance.checks import CHECKS

    defined = set(_DEFINITION.findall("\n".join(p.read_text() for p in DOCS.rglob("*.md"))))
    for check in CHECKS:
        assert check.refs, check.id
        for ref in check.refs:
            assert _RULE_ID.fullmatch(ref) and ref in defined, (check.id, ref)
