"""How every `gateway` command fails: one red ``error:`` line on stderr, then exit code 2."""

from __future__ import annotations

import typer


def fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)
