"""The ``gateway`` (alias ``loragate``) command line: the root command and the small
subcommands; ``serve``, ``chat``, ``status`` and the ``adapters`` group have their own
modules, and ``cli_help`` the plain help they all print."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from loragate.cli_adapters import adapters_app, models_app
from loragate.cli_cache import cache_app
from loragate.cli_chat import chat
from loragate.cli_errors import FAILURE, fail
from loragate.cli_help import PlainCommand, plain_typer
from loragate.cli_plan import plan
from loragate.cli_serve import ServeCommand, demo, serve
from loragate.cli_status import status

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
app = plain_typer(
    help="loragate: serve your own fine-tuned LoRA adapters locally, hot-swapped, behind one "
    "OpenAI-compatible endpoint.",
    no_args_is_help=True,
    add_completion=True,
    context_settings=HELP_OPTIONS,
)
app.add_typer(adapters_app, name="adapters", context_settings=HELP_OPTIONS)
app.add_typer(models_app, name="models", context_settings=HELP_OPTIONS)
app.add_typer(cache_app, name="cache", context_settings=HELP_OPTIONS)


def _version(value: bool) -> None:
    if value:
        from loragate import __version__

        typer.echo(f"loragate {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """loragate: serve your own fine-tuned LoRA adapters locally, hot-swapped, behind one
    OpenAI-compatible endpoint."""


app.command(cls=ServeCommand)(serve)
app.command(cls=ServeCommand)(demo)
app.command(cls=ServeCommand)(plan)
app.command(cls=PlainCommand)(chat)
app.command(cls=PlainCommand)(status)


@app.command(cls=PlainCommand)
def pull(
    model: Annotated[
        str, typer.Argument(metavar="MODEL", help="A Hugging Face id or a GGUF file.")
    ],
    cache_dir: Annotated[
        Path | None,
        typer.Option(metavar="PATH", help="Cache dir (default: ~/.cache/loragate)."),
    ] = None,
    engine_python: Annotated[
        str | None,
        typer.Option(
            envvar="LORAGATE_ENGINE_PYTHON",
            metavar="PATH",
            help="Python with torch and transformers, to dequantize a GGUF (default: this one).",
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            metavar="DTYPE",
            help="The engine's --dtype a GGUF is dequantized for (default: bfloat16).",
        ),
    ] = None,
) -> None:
    """Download a base model into the cache (with progress), for offline serving later.

    MODEL is a Hugging Face id, or a GGUF file (path/model.gguf, hf://ORG/REPO/FILE.gguf,
    pkg://DIST/PATH), which is also dequantized once into the cache.
    """
    from loragate.base_model.resolve import resolve_base_model
    from loragate.cli_progress import run_showing_progress, stderr_echo
    from loragate.demo.layout import default_cache_dir
    from loragate.fetching.progress import WaitProgress, current_progress

    # The download's bytes and a dequantization's tensors, as one line on stderr.
    record = WaitProgress(name=model, source=model, stage="prepare")

    def fetch() -> Path:
        current_progress.set(record)  # this thread's own context
        return resolve_base_model(
            model,
            (cache_dir or default_cache_dir()).expanduser(),
            progress=True,
            python=engine_python,
            dtype=dtype,
        )

    try:
        path = run_showing_progress(fetch, record.as_dict, record.started_at, stderr_echo)
    except Exception as exc:
        fail(str(exc), FAILURE)
        return
    typer.echo(f"{model} is cached at {path}")


@app.command("systemd-unit", cls=PlainCommand)
def systemd_unit(
    user_mode: Annotated[
        bool, typer.Option("--user", help="A unit for `systemctl --user`.")
    ] = False,
    environment_file: Annotated[
        Path | None,
        typer.Option(metavar="PATH", help="EnvironmentFile= for LORAGATE_* settings."),
    ] = None,
    run_as: Annotated[
        str,
        typer.Option(
            metavar="USER",
            help="User= and Group= of a system unit: a dedicated account (docs/operations.md: "
            "`useradd --system`), never root.",
        ),
    ] = "loragate",
) -> None:
    """Print a sandboxed Type=notify systemd unit that runs `gateway serve` from this install,
    with its state in /var/lib/loragate and its cache in /var/cache/loragate."""
    from loragate.systemd import default_exec_start, render_unit

    env_file = environment_file or (
        Path("~/.config/loragate/env").expanduser() if user_mode else Path("/etc/loragate/env")
    )
    try:
        unit = render_unit(
            exec_start=default_exec_start(),
            user=None if user_mode else run_as,
            environment_file=env_file,
            user_mode=user_mode,
        )
    except ValueError as exc:
        fail(str(exc))
        return
    typer.echo(unit, nl=False)


@app.command("config-schema", cls=PlainCommand)
def config_schema() -> None:
    """Print the JSON schema of `gateway serve`'s config file (TOML or YAML), for editors
    and CI: every setting, its type, limits and default; unknown keys refused."""
    from loragate.settings import config_schema as schema

    typer.echo(json.dumps(schema(), indent=2))


def main() -> None:
    logging.captureWarnings(True)
    app(prog_name=Path(sys.argv[0]).name if sys.argv else "gateway")


if __name__ == "__main__":
    main()
