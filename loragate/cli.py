"""The ``gateway`` (alias ``loragate``) command line."""

from __future__ import annotations

import gc
import inspect
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from loragate.cli_options import given_values, serve_parameters

HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    help="loragate: serve your own fine-tuned LoRA adapters locally, hot-swapped, behind one "
    "OpenAI-compatible endpoint.",
    no_args_is_help=True,
    add_completion=False,
    context_settings=HELP_OPTIONS,
)
adapters_app = typer.Typer(
    help="Manage the adapters of a running gateway (admin API).",
    no_args_is_help=True,
    context_settings=HELP_OPTIONS,
)
app.add_typer(adapters_app, name="adapters")

DEFAULT_URL = "http://127.0.0.1:8000"
UrlOption = Annotated[
    str, typer.Option("--url", envvar="LORAGATE_URL", help="The running gateway.")
]
AdminKeyOption = Annotated[
    str | None,
    typer.Option(
        "--admin-key",
        envvar="LORAGATE_ADMIN_KEY",
        help="The gateway's admin key [default: a gateway on this machine's per-start token].",
    ),
]
CacheDirOption = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        envvar="LORAGATE_CACHE_DIR",
        help="The gateway's cache dir, where it keeps its per-start admin token.",
    ),
]


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


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


class _ServeCommand(TyperCommand):
    """``gateway serve``: its own options before ``--``, the engine's after it.

    An unknown option or a stray argument before ``--`` is an error (a typo such as
    ``--max-lora 4`` would otherwise reach vLLM silently); everything after ``--`` becomes the
    engine's arguments (``ctx.args``), checked by the settings for loragate-owned flags.
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:  # a click Context
        if "--" in args:
            split = args.index("--")
            before, after = args[:split], args[split + 1 :]
        else:
            before, after = args, []
        super().parse_args(ctx, before)
        ctx.args = after
        return after


def serve(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(help="Settings file (TOML or YAML).")] = None,
    **options: Any,
) -> None:
    """Start the engine and the gateway. Arguments after `--` go to the engine untouched
    (except the flags loragate sets itself, which are refused with the option to use)."""
    from loragate.settings import load_settings

    explicit = given_values(options)
    explicit["engine_args"] = list(ctx.args) or None
    from loragate.engine_flags import check_engine_args

    try:
        check_engine_args(ctx.args)
        settings = load_settings(config, **explicit)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
        return
    from loragate.logs import configure_logging

    configure_logging(settings.log_level, settings.log_json)
    if settings.upstream_url is None and settings.tool_call_parser not in (None, "none"):
        from loragate.supervisor.tool_parsers import ToolParserError, check_tool_parser

        try:
            check_tool_parser(settings.tool_call_parser, settings.engine_python)
        except ToolParserError as exc:
            _fail(str(exc))
    if settings.engine_command is None and settings.upstream_url is None:
        from loragate.supervisor.preflight import run_preflight

        local_model = (
            Path(settings.model) if settings.model and Path(settings.model).is_dir() else None
        )
        problems = run_preflight(
            engine_python=settings.engine_python,
            model_dir=local_model,
            dtype_bytes=2,
            host=settings.host,
            port=settings.port,
            cache_dir=settings.cache_dir.expanduser(),
            parallel=settings.parallel,
        )
        if problems:
            _fail("cannot start:\n  - " + "\n  - ".join(str(p) for p in problems))
    else:
        from loragate.supervisor.ports import port_is_free

        if not port_is_free(settings.host, settings.port):
            _fail(
                f"port {settings.port} on {settings.host} is already in use; pass --port to choose another"
            )
    from loragate.gateway.app import create_app
    from loragate.gateway.auth import KeyConfigError

    try:
        asgi = create_app(settings)
    except KeyConfigError as exc:
        _fail(str(exc))
        return
    import uvicorn

    from loragate.gateway.server_options import server_options

    # What is alive now (modules, the app) lives as long as the process: out of the
    # collector's sight, a collection walks only what requests allocate (a gen-1 pass takes
    # about 0.6 ms instead of 1 ms, and a full one no longer walks ~70k objects).
    gc.collect()
    gc.freeze()
    uvicorn.run(
        asgi,
        **server_options(asgi),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout) or None,
        access_log=False,
        log_config=None,
    )


# Every option but --config is a Settings field: declared there once (loragate/cli_options.py).
serve.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [*list(inspect.signature(serve).parameters.values())[:2], *serve_parameters()]
)
app.command(cls=_ServeCommand)(serve)


def _admin(
    url: str,
    admin_key: str | None,
    method: str,
    path: str,
    body: Any = None,
    cache_dir: Path | None = None,
) -> Any:
    import httpx

    if admin_key is None:
        admin_key = _local_admin_token(url, cache_dir)
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        # The admin key goes to the gateway itself, never to an HTTP(S)_PROXY from the env.
        with httpx.Client(timeout=None, trust_env=False) as client:
            response = client.request(method, url.rstrip("/") + path, json=body, headers=headers)
    except httpx.HTTPError as exc:
        _fail(f"cannot reach the gateway at {url}: {exc}")
    try:
        payload = response.json()
    except ValueError:
        payload = {"message": response.text}
    if response.status_code >= 400:
        error = payload.get("error", payload) if isinstance(payload, dict) else payload
        message = error.get("message", error) if isinstance(error, dict) else error
        _fail(f"{response.status_code}: {message}")
    return payload


def _local_admin_token(url: str, cache_dir: Path | None) -> str | None:
    """The per-start token of a gateway on this machine started without --admin-key.

    Only ever sent to a loopback URL: the token opens this machine's gateway, not another's.
    """
    import httpx

    from loragate.demo.layout import default_cache_dir
    from loragate.gateway.admin_token import read_admin_token
    from loragate.gateway.cross_site import is_loopback

    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL:
        return None
    if not is_loopback(host):
        return None
    return read_admin_token(cache_dir or default_cache_dir())


@adapters_app.command("add")
def adapters_add(
    name: str,
    source: str,
    revision: Annotated[
        str | None, typer.Option(help="Revision, branch or tag at the source.")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", help="Watch the source and swap new versions in.")
    ] = False,
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Add NAME from SOURCE, or swap in a new version; returns once it serves."""
    typer.echo(
        f"Adding {name} from {source} (download, conversion and validation happen on the gateway)..."
    )
    import time

    from loragate.cli_progress import run_showing_progress, stderr_echo

    if admin_key is None:
        admin_key = _local_admin_token(url, cache_dir)
    body = {"source": source, "revision": revision, "follow": follow}
    result = run_showing_progress(
        lambda: _admin(url, admin_key, "PUT", f"/admin/adapters/{name}", body, cache_dir),
        lambda: _progress_record(url, admin_key, name),
        time.time(),
        stderr_echo,
    )
    typer.echo(f"{result['name']} now serves version {result['version'][:12]} ({result['state']}).")


def _progress_record(url: str, admin_key: str | None, name: str) -> dict[str, Any] | None:
    """The gateway's progress record of the add of ``name`` running now, if any."""
    import httpx

    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    response = httpx.get(
        f"{url.rstrip('/')}/admin/adapters/{name}", headers=headers, timeout=5, trust_env=False
    )
    if response.status_code != 200:
        return None
    record = response.json().get("progress")
    return record if isinstance(record, dict) else None


@adapters_app.command("list")
def adapters_list(
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Adapters with their active version, size and state."""
    result = _admin(url, admin_key, "GET", "/admin/adapters", cache_dir=cache_dir)
    rows = result.get("data", [])
    if not rows:
        typer.echo("no adapters")
        return
    typer.echo(
        f"{'NAME':<20} {'VERSION':<13} {'PREVIOUS':<13} {'RANK':>4} {'SIZE':>10} {'STATE':<8} SOURCE"
    )
    for row in rows:
        size = row.get("size_bytes") or 0
        typer.echo(
            f"{row['name']:<20} {row['version'][:12]:<13} {(row.get('previous_version') or '-')[:12]:<13} "
            f"{row.get('rank') or '-':>4} {size / 1024:>8.1f}kB {row['state']:<8} {row['source']}"
        )


@adapters_app.command("remove")
def adapters_remove(
    name: str,
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Stop serving NAME (its cached versions stay for a later rollback)."""
    _admin(url, admin_key, "DELETE", f"/admin/adapters/{name}", cache_dir=cache_dir)
    typer.echo(f"{name} removed")


@adapters_app.command("rollback")
def adapters_rollback(
    name: str,
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Serve NAME's previous version again."""
    result = _admin(url, admin_key, "POST", f"/admin/adapters/{name}/rollback", cache_dir=cache_dir)
    typer.echo(f"{name} now serves version {result['version'][:12]}")


@adapters_app.command("convert")
def adapters_convert(
    source: str,
    out: Path,
    base: Annotated[
        str, typer.Option("--base", help="The base model dir (or HF id) the adapter is for.")
    ],
    cache_dir: Annotated[
        Path | None,
        typer.Option(help="Cache dir for a base model id [default: ~/.cache/loragate]."),
    ] = None,
) -> None:
    """Offline: convert any supported adapter format to the PEFT layout vLLM loads."""
    from loragate.adapters.convert_command import convert_command
    from loragate.demo.layout import default_cache_dir

    try:
        convert_command(source, out, base, cache_dir or default_cache_dir())
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    typer.echo(f"wrote a PEFT adapter to {out}")


@app.command()
def pull(
    model: str,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Cache dir [default: ~/.cache/loragate].")
    ] = None,
    engine_python: Annotated[
        str | None,
        typer.Option(
            envvar="LORAGATE_ENGINE_PYTHON",
            help="Python with torch and transformers, to dequantize a GGUF [default: this one].",
        ),
    ] = None,
) -> None:
    """Download a base model into the cache (with progress), for offline serving later.

    MODEL is a Hugging Face id, or a GGUF file (path/model.gguf, hf://ORG/REPO/FILE.gguf,
    pkg://DIST/PATH), which is also dequantized once into the cache.
    """
    from loragate.adapters.models import resolve_base_model
    from loragate.demo.layout import default_cache_dir

    try:
        path = resolve_base_model(
            model,
            (cache_dir or default_cache_dir()).expanduser(),
            progress=True,
            python=engine_python,
        )
    except Exception as exc:
        _fail(str(exc))
        return
    typer.echo(f"{model} is cached at {path}")


@app.command()
def status(
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Engine state, pid, restarts and adapters of a running gateway."""
    engine = _admin(url, admin_key, "GET", "/admin/engine", cache_dir=cache_dir)
    adapters = _admin(url, admin_key, "GET", "/admin/adapters", cache_dir=cache_dir)
    engine.pop("log_tail", None)
    typer.echo(json.dumps({"engine": engine, "adapters": adapters.get("data", [])}, indent=2))


@app.command("systemd-unit")
def systemd_unit(
    user_mode: Annotated[
        bool, typer.Option("--user", help="A unit for `systemctl --user`.")
    ] = False,
    environment_file: Annotated[
        Path | None, typer.Option(help="EnvironmentFile= for LORAGATE_* settings.")
    ] = None,
) -> None:
    """Print a Type=notify systemd unit that runs `gateway serve` from this install."""
    from loragate.supervisor.systemd_unit import default_exec_start, render_unit

    env_file = environment_file or (
        Path("~/.config/loragate/env").expanduser() if user_mode else Path("/etc/loragate/env")
    )
    typer.echo(
        render_unit(
            exec_start=default_exec_start(),
            working_directory=Path.cwd(),
            user=None if user_mode else os.environ.get("SUDO_USER") or os.environ.get("USER"),
            environment_file=env_file,
            user_mode=user_mode,
        ),
        nl=False,
    )


def main() -> None:
    logging.captureWarnings(True)
    app(prog_name=Path(sys.argv[0]).name if sys.argv else "gateway")


if __name__ == "__main__":
    main()
