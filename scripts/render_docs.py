"""Write into docs/ what the pages show from elsewhere, so each page reads the same as plain
markdown in the repository as on the built site.

    python3 dev.py run python scripts/render_docs.py           # rewrite the pages
    python3 dev.py run python scripts/render_docs.py --check   # exit 1 if a page is stale

Each generated part sits between two HTML comments (invisible on a code host) and is
rewritten on every run; tests/test_docs_render.py fails when a page differs from what this
script would write:

- `<!-- file: PATH -->` ... `<!-- /file -->`: the whole file PATH of the repository (an example
  the tests run) as a code block;
- `<!-- code: PATH QUALNAME -->` ... `<!-- /code -->`: the source of a class or function
  (`Class.method` for a method) in PATH, as the file has it now;
- `<!-- cli: acp-once -->` ... `<!-- /cli -->`: the `--help` of `acp-once` and of every command
  and subcommand, at 80 columns;
- `<!-- api: MODULE -->` (optionally with mkdocstrings options on the lines after, inside the
  comment) ... `<!-- /api -->`: a table of what MODULE's `__all__` exports, each name with
  its kind and a link to the file defining it; on the site the hook (docs/hooks.py) renders
  the full reference there instead;
- `<!-- api-links -->` ... `<!-- /api-links -->` at the end of a page: a link definition for
  each `[text][acp_once.NAME]` API link of the page, to the API page documenting it, so the
  link works on a code host; the site's hook removes them and links to the exact entry.

The older forms are converted on the way: a code block holding `--8<-- "PATH"` becomes a
`file` part, a lone `<!-- code: PATH QUALNAME -->` line a `code` part, a `::: MODULE`
directive an `api` part.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

_SNIPPET = re.compile(r'^```(\w*)\n--8<-- "([^"]+)"\n```$', re.MULTILINE)
_LONE_CODE = re.compile(r"^<!-- code: (\S+) ([\w.]+) -->$(?!\n```|\n<!-- /code -->)", re.M)
_DIRECTIVE = re.compile(r"^::: (acp_once(?:\.\w+)*)\n((?:    .*\n)*)", re.MULTILINE)
_FILE = re.compile(r"^<!-- file: (\S+) -->\n.*?^<!-- /file -->$", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"^<!-- code: (\S+) ([\w.]+) -->\n.*?^<!-- /code -->$", re.MULTILINE | re.DOTALL)
_LONE_CLI = re.compile(r"^<!-- cli: acp-once -->$(?!\n## |\n<!-- /cli -->)", re.MULTILINE)
_CLI = re.compile(r"^<!-- cli: acp-once -->\n.*?^<!-- /cli -->$", re.MULTILINE | re.DOTALL)
_API = re.compile(
    r"^<!-- api: (acp_once(?:\.\w+)*)((?:\n    [^\n]*)*)\n?-->\n.*?^<!-- /api -->$",
    re.MULTILINE | re.DOTALL,
)
_API_LINKS = re.compile(r"\n*^<!-- api-links -->\n.*?^<!-- /api-links -->\n?", re.M | re.S)
_REF = re.compile(r"\]\[(acp_once(?:\.\w+)+)\]")
_LANG = {".py": "python", ".sh": "sh", ".toml": "toml", ".json": "json", ".yml": "yaml"}


def definition(path: str, qualname: str) -> str | None:
    """The source of `qualname` (a class, a function, `Class.method`) in file `path`."""
    file = ROOT / path
    if not file.is_file():
        return None
    source = file.read_text(encoding="utf-8")
    body: list[ast.stmt] = ast.parse(source).body
    node: Any = None
    for part in qualname.split("."):
        kinds = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        node = next((n for n in body if isinstance(n, kinds) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    lines = source.splitlines()
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    chunk = lines[first - 1 : node.end_lineno]
    indent = len(chunk[0]) - len(chunk[0].lstrip())
    return "\n".join(line[indent:] for line in chunk)


def _help(args: list[str]) -> str:
    """`acp-once ARGS --help` as typer prints it, 80 columns, no colour, `~` for home."""
    from typer.testing import CliRunner

    from acp_once.cli.app import app

    env = {"COLUMNS": "80", "TERMINAL_WIDTH": "80", "NO_COLOR": "1", "TERM": "dumb"}
    result = CliRunner().invoke(app, [*args, "--help"], env=env, prog_name="acp-once")
    if result.exit_code != 0:
        raise SystemExit(f"acp-once {' '.join(args)} --help failed: {result.output}")
    text = result.output.replace(str(Path.home()), "~")
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def cli_reference() -> str:
    """Markdown with the `--help` of `acp-once` and of each command and subcommand."""
    import typer.main

    from acp_once.cli.app import app

    out: list[str] = []

    def walk(cmd: Any, path: list[str], parent: Any) -> None:
        ctx = cmd.context_class(cmd, info_name=path[-1], parent=parent)
        title = " ".join(["acp-once", *path[1:]])
        out.append(f"## `{title}`\n\n```text\n{_help(path[1:])}\n```\n")
        for name in getattr(cmd, "list_commands", lambda _: [])(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not getattr(sub, "hidden", False):
                walk(sub, [*path, name], ctx)

    walk(typer.main.get_command(app), ["acp-once"], None)
    return "\n".join(out)


def api_table(module_name: str, page: Path) -> str:
    """A table of the names MODULE exports (`__all__`): each one's kind and the file that
    defines it, linked from `page`. Docstrings stay out: the site shows them, and a table that
    changed with every docstring would make every docstring edit a docs edit."""
    module = importlib.import_module(module_name)
    rows = [
        f"`{module_name}` exports (the site shows each one's documentation):",
        "",
        "| Name | Kind | Defined in |",
        "| - | - | - |",
    ]
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name, None)
        source = _source_of(obj) or _source_of(module)
        where = ""
        if source is not None:
            rel = os.path.relpath(source, page.parent).replace(os.sep, "/")
            where = f"[{Path(source).relative_to(ROOT / 'src').as_posix()}]({rel})"
        rows.append(f"| `{name}` | {_kind(obj)} | {where} |")
    return "\n".join(rows)


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "class"
    if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isbuiltin(obj):
        return "function"
    if inspect.ismodule(obj):
        return "module"
    return "value"


def _source_of(obj: object) -> str | None:
    """The repository file defining `obj` (a class, function or module), or None."""
    try:
        found = inspect.getsourcefile(obj)  # type: ignore[arg-type]
    except TypeError:
        return None
    if found is None or not Path(found).resolve().is_relative_to(ROOT / "src"):
        return None
    return str(Path(found).resolve())


def _api_pages() -> dict[str, str]:
    """Module -> the API page (relative to docs/) that documents it."""
    pages: dict[str, str] = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for module in re.findall(r"(?:^::: |<!-- api: )(acp_once(?:\.\w+)*)", text, re.M):
            pages.setdefault(module, page.relative_to(DOCS).as_posix())
    return pages


def _page_of(dotted: str, pages: dict[str, str]) -> str | None:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        found = pages.get(".".join(parts[:end]))
        if found is not None:
            return found
    return None


def _fence(body: str, lang: str) -> str:
    ticks = "````" if "```" in body else "```"
    return f"{ticks}{lang}\n{body.rstrip()}\n{ticks}\n"


def render(text: str, page: Path, pages: dict[str, str]) -> str:
    """`text` (the page `page`) with every generated part written afresh.

    Raises:
        SystemExit: a part names a file or a definition that does not exist.
    """
    text = _SNIPPET.sub(lambda m: f"<!-- file: {m.group(2)} -->\n<!-- /file -->", text)
    text = _LONE_CODE.sub(lambda m: f"{m.group(0)}\n<!-- /code -->", text)
    text = _LONE_CLI.sub(lambda m: f"{m.group(0)}\n<!-- /cli -->", text)
    text = _DIRECTIVE.sub(
        lambda m: f"<!-- api: {m.group(1)}\n{m.group(2)}-->\n<!-- /api -->\n", text
    )

    def file_part(m: re.Match[str]) -> str:
        path = m.group(1)
        if not (ROOT / path).is_file():
            raise SystemExit(f"{page}: no file {path}")
        body = (ROOT / path).read_text(encoding="utf-8")
        lang = _LANG.get(Path(path).suffix, "text")
        shown = f"# {path}\n{body}" if lang == "python" else body
        return f"<!-- file: {path} -->\n{_fence(shown, lang)}<!-- /file -->"

    def code_part(m: re.Match[str]) -> str:
        path, qualname = m.group(1), m.group(2)
        found = definition(path, qualname)
        if found is None:
            raise SystemExit(f"{page}: no `{qualname}` in {path}")
        block = _fence(f"# {path}\n" + found, "python")
        return f"<!-- code: {path} {qualname} -->\n{block}<!-- /code -->"

    def api_part(m: re.Match[str]) -> str:
        module, options = m.group(1), m.group(2)
        return f"<!-- api: {module}{options}\n-->\n{api_table(module, page)}\n<!-- /api -->"

    text = _FILE.sub(file_part, text)
    text = _CODE.sub(code_part, text)
    if _CLI.search(text):
        reference = cli_reference()
        text = _CLI.sub(lambda _: f"<!-- cli: acp-once -->\n{reference}<!-- /cli -->", text)
    text = _API.sub(api_part, text)

    text = _API_LINKS.sub("\n", text).rstrip("\n") + "\n"
    refs = sorted(set(_REF.findall(text)))
    if refs:
        here = page.parent
        lines = []
        for ref in refs:
            target = _page_of(ref, pages)
            if target is None:
                raise SystemExit(f"{page}: no API page documents {ref}")
            rel = os.path.relpath(DOCS / target, here).replace(os.sep, "/")
            lines.append(f"[{ref}]: {rel}")
        text += "\n<!-- api-links -->\n" + "\n".join(lines) + "\n<!-- /api-links -->\n"
    return text


def main(argv: list[str]) -> int:
    check = "--check" in argv
    pages = _api_pages()
    stale = []
    for page in sorted(DOCS.rglob("*.md")):
        old = page.read_text(encoding="utf-8")
        new = render(old, page, pages)
        if new != old:
            stale.append(page.relative_to(ROOT).as_posix())
            if not check:
                page.write_text(new, encoding="utf-8")
    if check and stale:
        print(
            "stale generated docs (run: python3 dev.py run python scripts/render_docs.py): "
            + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    for path in stale if not check else ():
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
