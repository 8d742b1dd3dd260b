"""The `acp-once` console script and `python -m acp_once`.

`acp-once agent` is started by editors, which wait for its `initialize` answer: its common
forms run at once through `acp_once.cli.stdio_agent`, before typer and rich are imported.
Everything else (other commands, options before the command, help, anything that path does
not take) goes to the typer application in `acp_once.cli.app`, unchanged.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    """Run the `acp-once` command line (`sys.argv`).

    Exits as the command does: 0, a usage error's 2, the status a command chose; on the
    fast path, as typer's does, 130 after Ctrl-C and 1 when stdout is a closed pipe; 1 with
    one line naming the path and the cause when the store cannot be opened.
    """
    argv = sys.argv[1:]
    if argv[:1] == ["agent"]:
        from acp_once.cli.stdio_agent import try_fast_agent
        from acp_once.storage import StorageError

        try:
            if try_fast_agent(argv[1:]):
                return
        except StorageError as exc:
            from acp_once.cli.stdio_agent import report_store_failure

            sys.exit(report_store_failure(exc, "agent"))
        except KeyboardInterrupt:
            sys.exit(130)  # typer's status for Ctrl-C
        except BrokenPipeError:
            sys.exit(1)  # typer's, for a reader gone (EPIPE)
    from acp_once.cli.app import main as app_main

    app_main()
