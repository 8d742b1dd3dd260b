"""`python -m acp_once` is the `acp-once` command."""

from acp_once.cli.entry import main

main()
