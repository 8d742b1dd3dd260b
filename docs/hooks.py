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
- Code from the repository: a line `<!-- code: PATH QUALNAME -->` becomes a Python code block
  with the source of that class or function (`Class.method` for a method) as the file has it
  now, so a guide shows code that runs in the tests and never a stale copy; a name that is
  not there any more is a build warning. Whole files come in with the snippets extension
  (`--8<-- "examples/FILE.py"`).
- The command line: a line `<!-- cli: acp-once -->` becomes the `--help` of `acp-once` and of
  every command and subcommand of its typer app, as the app prints it at build time, so the
  page and `--help` never disagree.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.acp_once")

_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")
_CODE = re.compile(r"^<!-- code: (\S+) ([\w.]+) -->$", re.MULTILINE)
_CLI = re.compile(r"^<!-- cli: acp-once -->$", re.MULTILINE)
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


def definition(root: Path, path: str, qualname: str) -> str | None:
    """The source of `qualname` (a class, a function, `Class.method`) in file `path`."""
    file = root / path
    if not file.is_file():
        return None
    source = file.read_text(encoding="utf-8")
    body: list[ast.stmt] = ast.parse(source).body
    node: ast.stmt | None = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        body = node.body  # type: ignore[attr-defined]
    assert node is not None
    lines = source.splitlines()
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])  # type: ignore[attr-defined]
    chunk = lines[first - 1 : node.end_lineno]
    indent = len(chunk[0]) - len(chunk[0].lstrip())
    return "\n".join(line[indent:] for line in chunk)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _help(args: list[str]) -> str:
    """`acp-once ARGS --help` as typer prints it, 76 columns (the page's width), no colour."""
    from typer.testing import CliRunner

    from acp_once.cli.app import app

    env = {"COLUMNS": "76", "TERMINAL_WIDTH": "76", "NO_COLOR": "1", "TERM": "dumb"}
    result = CliRunner().invoke(app, [*args, "--help"], env=env, prog_name="acp-once")
    if result.exit_code != 0:
        log.warning("acp-once %s --help failed: %s", " ".join(args), result.output)
    text = result.output.replace(str(Path.home()), "~")  # defaults in the user's directory
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def cli_reference() -> str:
    """Markdown with the `--help` of `acp-once` and of each of its commands and subcommands."""
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


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    here = (docs / page.file.src_path).parent

    def code(match: re.Match[str]) -> str:
        path, qualname = match.group(1), match.group(2)
        found = definition(root, path, qualname)
        if found is None:
            log.warning("%s: no `%s` in %s", page.file.src_path, qualname, path)
            return match.group(0)
        return f"```python\n# {path}\n{found}\n```"

    markdown = _CODE.sub(code, markdown)
    if _CLI.search(markdown):
        markdown = _CLI.sub(lambda _: cli_reference(), markdown)

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
