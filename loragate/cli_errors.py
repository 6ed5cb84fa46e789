"""How every `gateway` command fails: one red ``error:`` line on stderr per problem, then an
exit code a script can tell apart: 2 for a usage error (a bad flag, setting value, config key
or config file; click's own usage errors exit 2 too), 1 for a failure at run time (the engine
or the machine cannot serve, the port is taken, the gateway is unreachable or refuses)."""

from __future__ import annotations

import typer

USAGE = 2
FAILURE = 1


def fail(message: str, code: int = USAGE) -> None:
    show_error(message)
    raise typer.Exit(code)


def show_error(message: str) -> None:
    """The ``error:`` line alone, for a command that goes on (`gateway chat` at its prompt)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)


def fail_each(problems: list[str], code: int = USAGE) -> None:
    """Several problems found at once (the settings' errors): an ``error:`` line each."""
    for problem in problems[:-1]:
        show_error(problem)
    fail(problems[-1] if problems else "invalid settings", code)


def warn(message: str) -> None:
    typer.secho(f"warning: {message}", fg=typer.colors.YELLOW, err=True)
