"""MkDocs hooks for the acp-once site (mkdocs.yml names this file).

- Links outside docs/: the pages link to a few files outside docs/ (the README, the
  benchmarks), which GitHub shows but the site does not contain. On the site such a link
  becomes the file's path as code, so the strict build has no dangling link and the reader
  still learns where to look; a link to a path that does not exist is left alone, and the
  build reports it.
- The API pages show each package's `__all__`. Griffe cannot hold a submodule and a member of
  the same name (`acp_once.agent.serve`, the module, hides `serve`, the function it exports),
  so for every such exported name the page also renders the submodule's member. After
  rendering, every name of `__all__` must have its entry on the page, or the build warns
  (and `--strict` fails): a name someone adds is documented, or the build says why not.
- Generated parts (scripts/render_docs.py writes them into the markdown, so a page reads the
  same in the repository): the code, the file and the `--help` parts are rendered as they
  are; an `<!-- api: MODULE -->` part becomes the `::: MODULE` directive (its options kept)
  instead of its table, and the `<!-- api-links -->` definitions are dropped, so the API
  links resolve to the exact entry (autorefs).
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.acp_once")

_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")
_API = re.compile(
    r"^<!-- api: (acp_once(?:\.\w+)*)((?:\n    [^\n]*)*)\n?-->\n.*?^<!-- /api -->$",
    re.MULTILINE | re.DOTALL,
)
_API_LINKS = re.compile(r"^<!-- api-links -->\n.*?^<!-- /api-links -->\n?", re.M | re.S)
_DIRECTIVE = re.compile(r"^::: (acp_once(?:\.\w+)*)\s*$", re.MULTILINE)


def _source(root: Path, dotted: str) -> Path | None:
    base = root / "src" / Path(*dotted.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


def exported(root: Path, dotted: str) -> list[str]:
    """The names in the `__all__` of module `dotted` (read from its source), or []."""
    path = _source(root, dotted)
    if path is None:
        return []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                assert node.value is not None
                return [str(name) for name in ast.literal_eval(node.value)]
    return []


def shadowed(root: Path, dotted: str) -> list[str]:
    """Exported names that are also the names of a submodule (which griffe shows instead)."""
    return [name for name in exported(root, dotted) if _source(root, f"{dotted}.{name}")]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    here = (docs / page.file.src_path).parent

    markdown = _API_LINKS.sub("", markdown)
    markdown = _API.sub(lambda m: f"::: {m.group(1)}{m.group(2)}\n", markdown)

    def outside(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if re.match(r"[a-z]+:", target):
            return match.group(0)  # a URL
        dest = (here / target).resolve()
        if dest.is_relative_to(docs) or not dest.exists() or not dest.is_relative_to(root):
            return match.group(0)
        path = dest.relative_to(root).as_posix()
        if text.strip("`").endswith(dest.name):  # the link's text is the path itself
            return f"`{path}`"
        return f"{text} (`{path}` in the repository)"

    markdown = _LINK.sub(outside, markdown)

    def with_shadowed(match: re.Match[str]) -> str:
        dotted = match.group(1)
        extra = [
            f"\n::: {dotted}.{name}.{name}\n    options:\n      heading_level: 2\n"
            for name in shadowed(root, dotted)
        ]
        return match.group(0) + "\n" + "".join(extra)

    return _DIRECTIVE.sub(with_shadowed, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    root = Path(config["docs_dir"]).resolve().parent
    for dotted in _DIRECTIVE.findall(page.markdown or ""):
        if dotted.count(".") and _source(root, dotted) is None:
            continue  # an object, not a module
        for name in exported(root, dotted):
            ids = (f'id="{dotted}.{name}"', f'id="{dotted}.{name}.{name}"')
            if not any(anchor in html for anchor in ids):
                log.warning(
                    "%s: `%s` is in the `__all__` of %s but has no entry on the page",
                    page.file.src_path,
                    name,
                    dotted,
                )
    return html
