"""Write the retry-class table (`acp_once.protocol.retry`) into README.md.

    python3 dev.py run python scripts/render_retry_table.py           # rewrite README.md
    python3 dev.py run python scripts/render_retry_table.py --check   # exit 1 if out of date

The table goes between the lines `<!-- retry-table:start -->` and `<!-- retry-table:end -->`;
everything outside them is left as it is. Exit codes: 0 done or up to date, 1 out of date
(`--check`), 2 the markers are missing, duplicated or out of order.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from acp_once.protocol.retry import render_markdown_table

__all__ = ["END_MARKER", "START_MARKER", "MarkerError", "main", "splice"]

START_MARKER = "<!-- retry-table:start -->"
END_MARKER = "<!-- retry-table:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"


class MarkerError(ValueError):
    """The text does not hold exactly one start marker line followed by one end marker line."""


def splice(text: str, table: str) -> str:
    """Return `text` with the lines between the markers replaced by `table`.

    The table is set off by blank lines so Markdown reads it as a table, not as part of the
    marker comments.

    Raises:
        MarkerError: a marker line is missing or repeated, or the end comes before the start.
    """
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == START_MARKER]
    ends = [i for i, line in enumerate(lines) if line.strip() == END_MARKER]
    if len(starts) != 1 or len(ends) != 1:
        raise MarkerError(
            f"expected exactly one line {START_MARKER!r} and one line {END_MARKER!r}; "
            f"found {len(starts)} and {len(ends)}"
        )
    start, end = starts[0], ends[0]
    if end < start:
        raise MarkerError(f"{END_MARKER!r} comes before {START_MARKER!r}")
    # The start line always ends in a newline: the end marker follows it.
    head = "".join(lines[: start + 1])
    return head + "\n" + table.rstrip("\n") + "\n\n" + "".join(lines[end:])


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Write the retry-class table into README.md.")
    parser.add_argument(
        "--check", action="store_true", help="only report whether the file is up to date"
    )
    parser.add_argument("--readme", type=Path, default=README, help="the file to update")
    args = parser.parse_args(argv)
    path: Path = args.readme
    text = path.read_text(encoding="utf-8")
    try:
        updated = splice(text, render_markdown_table())
    except MarkerError as exc:
        print(f"{path}: {exc}; add the marker lines around where the table goes", file=sys.stderr)
        return 2
    if updated == text:
        print(f"{path}: retry table is up to date")
        return 0
    if args.check:
        print(
            f"{path}: retry table is out of date; run python scripts/render_retry_table.py",
            file=sys.stderr,
        )
        return 1
    path.write_text(updated, encoding="utf-8")
    print(f"{path}: retry table updated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
