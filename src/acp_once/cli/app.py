"""The `acp-once` command line."""

import typer

app = typer.Typer(no_args_is_help=True)


@app.command()
def demo() -> None:
    """Show what idempotency keys buy, under injected faults."""
    typer.echo("demo: not built yet")


def main() -> None:
    app()
