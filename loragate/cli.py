"""The ``gateway`` (alias ``loragate``) command line."""

from __future__ import annotations

import enum
import gc
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

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


class LogLevel(enum.StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"
    critical = "critical"


class ExecutorBackendChoice(enum.StrEnum):
    mp = "mp"
    ray = "ray"
    uni = "uni"
    external_launcher = "external_launcher"


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


@app.command(cls=_ServeCommand)
def serve(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "--pretrained-model-name-or-path",
            help="Base model: a local dir or a Hugging Face id. Default: the bundled demo model.",
        ),
    ] = None,
    model_name: Annotated[
        str | None,
        typer.Option(
            "--model-name", "--served-model-name", help="The id clients use for the base model."
        ),
    ] = None,
    run_id: Annotated[str | None, typer.Option(help="Serve a Datature Vi training run.")] = None,
    secret_key: Annotated[str | None, typer.Option(envvar="DATATURE_VI_SECRET_KEY")] = None,
    organization_id: Annotated[
        str | None, typer.Option(envvar="DATATURE_VI_ORGANIZATION_ID")
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Address to listen on [default: 127.0.0.1].")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on [default: 8000].")] = None,
    lora: Annotated[
        list[str] | None,
        typer.Option(
            "--lora", "--lora-modules", help="NAME=SOURCE, served from boot on (repeatable)."
        ),
    ] = None,
    adapters_manifest: Annotated[
        str | None,
        typer.Option(
            help="The fleet's adapter manifest (file, http(s) URL or hf://ORG/REPO[@REV]/PATH): "
            "serve exactly its adapters, checked every follow interval.",
        ),
    ] = None,
    max_loras: Annotated[
        int | None, typer.Option(help="Adapters in one batch [default: 2].")
    ] = None,
    max_lora_rank: Annotated[
        int | None, typer.Option(help="Largest adapter rank [default: 16].")
    ] = None,
    max_cpu_loras: Annotated[int | None, typer.Option(help="Engine-side adapter LRU size.")] = None,
    tensor_parallel_size: Annotated[
        int | None,
        typer.Option(
            "--tensor-parallel-size",
            "-tp",
            help="Split the model over this many GPUs (vLLM's; also accepted after `--`).",
        ),
    ] = None,
    pipeline_parallel_size: Annotated[
        int | None,
        typer.Option(
            "--pipeline-parallel-size",
            "-pp",
            help="Pipeline stages, one GPU group each (vLLM's; also accepted after `--`).",
        ),
    ] = None,
    data_parallel_size: Annotated[
        int | None,
        typer.Option(
            "--data-parallel-size",
            "-dp",
            help="Model replicas (vLLM's; also accepted after `--`).",
        ),
    ] = None,
    distributed_executor_backend: Annotated[
        ExecutorBackendChoice | None,
        typer.Option(
            "--distributed-executor-backend",
            help="How vLLM runs its workers: mp (this machine) or ray (needs ray in the engine's "
            "Python) [default: vLLM's choice].",
        ),
    ] = None,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(
            help="vLLM's tool-call parser (e.g. hermes, llama3_json); 'none' for no tool calls "
            "[default: the model family's, else pythonic].",
        ),
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option(help="Adapters, models, manifest, logs.")
    ] = None,
    api_key: Annotated[
        list[str] | None, typer.Option(help="Inference API key (repeatable).")
    ] = None,
    api_key_file: Annotated[
        Path | None,
        typer.Option(help="File of inference API keys, one a line (# comments); kept out of `ps`."),
    ] = None,
    admin_key: Annotated[str | None, typer.Option(help="Key for the admin routes.")] = None,
    allowed_media_dir: Annotated[
        Path | None,
        typer.Option(
            "--allowed-media-dir",
            "--allowed-local-media-path",
            help="Requests may read local images from this dir only.",
        ),
    ] = None,
    upstream_url: Annotated[
        str | None,
        typer.Option(
            help="Serve this OpenAI-compatible server (e.g. http://host:8000/v1); no engine is started."
        ),
    ] = None,
    max_body_bytes: Annotated[
        int | None, typer.Option(help="Largest request body in bytes, 413 above (default: 32 MiB).")
    ] = None,
    limit_concurrency: Annotated[
        int | None,
        typer.Option(help="Most connections and requests at once, 503 above (default: 512)."),
    ] = None,
    max_messages: Annotated[
        int | None, typer.Option(help="Most messages in one chat request (default: 1024).")
    ] = None,
    max_tokens_cap: Annotated[
        int | None, typer.Option(help="Largest max_tokens a request may ask for (default: no cap).")
    ] = None,
    max_image_bytes: Annotated[
        int | None, typer.Option(help="Largest image in a request, in bytes (default: 20 MiB).")
    ] = None,
    max_image_pixels: Annotated[
        int | None, typer.Option(help="Most pixels in an image in a request (default: 40 million).")
    ] = None,
    private_image_urls: Annotated[
        bool | None,
        typer.Option(
            "--private-image-urls",
            help="Let image URLs point at loopback/private addresses (default: refused).",
        ),
    ] = None,
    cors_origin: Annotated[
        list[str] | None,
        typer.Option(
            "--cors-origin",
            "--allowed-origins",
            help="Allow browser requests from this origin (repeatable; CORS is off by default).",
        ),
    ] = None,
    allowed_hosts: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-hosts",
            help="Host names admin requests may name besides loopback and --host "
            "(comma-separated or repeated; '*.example.com', '*').",
        ),
    ] = None,
    open_admin: Annotated[
        bool | None,
        typer.Option(
            "--open-admin",
            help="Admin routes without any key, to this machine's clients only "
            "(default: without --admin-key, a per-start token in CACHE_DIR/admin-token).",
        ),
    ] = None,
    docs: Annotated[
        bool | None,
        typer.Option(
            "--docs/--no-docs", help="Serve /docs, /redoc and /openapi.json (default: on)."
        ),
    ] = None,
    config: Annotated[Path | None, typer.Option(help="Settings file (TOML or YAML).")] = None,
    log_level: Annotated[
        LogLevel | None,
        typer.Option("--log-level", case_sensitive=False, help="Log level [default: info]."),
    ] = None,
    log_json: Annotated[bool | None, typer.Option("--log-json", help="Log as JSON lines.")] = None,
    access_log: Annotated[
        bool | None,
        typer.Option(
            "--access-log", help="Log each inference request: id, model, status, duration."
        ),
    ] = None,
) -> None:
    """Start the engine and the gateway. Arguments after `--` go to the engine untouched
    (except the flags loragate sets itself, which are refused with the option to use)."""
    from loragate.settings import load_settings

    explicit: dict[str, Any] = {
        "model": model,
        "model_name": model_name,
        "run_id": run_id,
        "secret_key": secret_key,
        "organization_id": organization_id,
        "host": host,
        "port": port,
        "lora": lora or None,
        "adapters_manifest": adapters_manifest,
        "max_loras": max_loras,
        "max_lora_rank": max_lora_rank,
        "max_cpu_loras": max_cpu_loras,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "data_parallel_size": data_parallel_size,
        "distributed_executor_backend": (
            distributed_executor_backend.value if distributed_executor_backend else None
        ),
        "tool_call_parser": tool_call_parser,
        "cache_dir": cache_dir,
        "api_key": api_key or None,
        "api_key_file": api_key_file,
        "admin_key": admin_key,
        "max_body_bytes": max_body_bytes,
        "limit_concurrency": limit_concurrency,
        "max_messages": max_messages,
        "max_tokens_cap": max_tokens_cap,
        "max_image_bytes": max_image_bytes,
        "max_image_pixels": max_image_pixels,
        "private_image_urls": private_image_urls,
        "cors_origins": cors_origin or None,
        "allowed_hosts": allowed_hosts or None,
        "open_admin": open_admin,
        "docs": docs,
        "allowed_media_dir": allowed_media_dir,
        "upstream_url": upstream_url,
        "engine_args": list(ctx.args) or None,
        "log_level": log_level.value if log_level else None,
        "log_json": log_json,
        "access_log": access_log,
    }
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
