"""``gateway adapters ...``: add, list, remove and roll back a running gateway's adapters
through its admin API, and convert an adapter offline; ``gateway models ...``: a gateway's
base models (a catalog's, or the one it serves), listed, loaded and unloaded."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from loragate.cli_admin import (
    DEFAULT_URL,
    AdminKeyOption,
    CacheDirOption,
    UrlOption,
    admin_request,
    local_admin_token,
)
from loragate.cli_errors import FAILURE, fail
from loragate.cli_help import PlainCommand, plain_typer

_SOURCE_HELP = (
    "A local dir or archive, hf://ORG/REPO[@REV], an archive URL, a Tinker checkpoint or a "
    "Vi run (docs/adapters.md)."
)
# The largest rank vLLM accepts at all: the engine's own --max-lora-rank is checked at load.
_ANY_ENGINE_RANK = 512


def convert_command(source: str, out: Path, base: str, cache_dir: Path) -> Path:
    """`gateway adapters convert SOURCE OUT --base MODEL`: fetch ``source``, convert it to PEFT
    when needed, validate it against ``base`` the way a running gateway would, and write it to
    ``out`` (which must not exist or be empty). Raises ``ValueError`` subclasses with a message
    the user can act on; ``out`` is left as it was on failure. The conversion runs in a child
    Python, and the intake is imported here, so torch and the intake stay out of the CLI's
    start."""
    from loragate.adapters.intake.convert import convert_in_subprocess, needs_conversion
    from loragate.adapters.intake.sources import fetch_source
    from loragate.adapters.intake.validate import validate_adapter
    from loragate.base_model.resolve import read_base_config, resolve_base_model

    out = out.expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty directory; pick a new OUT")
    base_dir = resolve_base_model(base, cache_dir.expanduser())
    base_config = read_base_config(base_dir)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=out.parent.resolve()) as tmp:
        work = Path(tmp)
        fetched = fetch_source(source, work / "fetched", download_dir=work)
        peft_dir = fetched.path
        if needs_conversion(peft_dir):
            peft_dir = convert_in_subprocess(
                fetched.path, work / "converted", base_dir, base_model_name=base
            )
        validate_adapter(peft_dir, base_config, _ANY_ENGINE_RANK)
        staged = work / "out"
        shutil.copytree(peft_dir, staged)
        if out.exists():
            out.rmdir()
        staged.rename(out)
    return out


adapters_app = plain_typer(
    help="Manage the adapters of a running gateway (admin API).", no_args_is_help=True
)


@adapters_app.command("add", cls=PlainCommand)
def adapters_add(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The adapter's name.")],
    source: Annotated[str, typer.Argument(metavar="SOURCE", help=_SOURCE_HELP)],
    revision: Annotated[
        str | None,
        typer.Option(metavar="REV", help="Revision, branch or tag at the source."),
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
        admin_key = local_admin_token(url, cache_dir)
    body = {"source": source, "revision": revision, "follow": follow}
    result = run_showing_progress(
        lambda: admin_request(url, admin_key, "PUT", f"/admin/adapters/{name}", body, cache_dir),
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


@adapters_app.command("list", cls=PlainCommand)
def adapters_list(
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Adapters with their active version, size and state."""
    result = admin_request(url, admin_key, "GET", "/admin/adapters", cache_dir=cache_dir)
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


@adapters_app.command("remove", cls=PlainCommand)
def adapters_remove(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The adapter's name.")],
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Stop serving NAME (its cached versions stay for a later rollback)."""
    admin_request(url, admin_key, "DELETE", f"/admin/adapters/{name}", cache_dir=cache_dir)
    typer.echo(f"{name} removed")


@adapters_app.command("rollback", cls=PlainCommand)
def adapters_rollback(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The adapter's name.")],
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Serve NAME's previous version again."""
    result = admin_request(
        url, admin_key, "POST", f"/admin/adapters/{name}/rollback", cache_dir=cache_dir
    )
    typer.echo(f"{name} now serves version {result['version'][:12]}")


@adapters_app.command("convert", cls=PlainCommand)
def adapters_convert(
    source: Annotated[str, typer.Argument(metavar="SOURCE", help=_SOURCE_HELP)],
    out: Annotated[
        Path, typer.Argument(metavar="OUT", help="A new (or empty) directory to write.")
    ],
    base: Annotated[
        str,
        typer.Option(
            "--base", metavar="MODEL", help="The base model dir (or HF id) the adapter is for."
        ),
    ],
    cache_dir: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH", help="Cache dir for a base model id (default: ~/.cache/loragate)."
        ),
    ] = None,
) -> None:
    """Offline: convert any supported adapter format to the PEFT layout vLLM loads."""
    from loragate.demo.layout import default_cache_dir

    try:
        convert_command(source, out, base, cache_dir or default_cache_dir())
    except (ValueError, OSError) as exc:
        fail(str(exc), FAILURE)
    typer.echo(f"wrote a PEFT adapter to {out}")


models_app = plain_typer(
    help="List, load and unload a running gateway's base models (admin API).",
    no_args_is_help=True,
)


@models_app.command("list", cls=PlainCommand)
def models_list(
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the admin API's report as JSON, for scripts.")
    ] = False,
) -> None:
    """Every base model with its residency, engine state, memory, idle time and adapters.

    A gateway serving one base model lists that one (a catalog of one)."""
    result = admin_request(url, admin_key, "GET", "/admin/models", cache_dir=cache_dir)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(f"{'MODEL':<20} {'RESIDENCY':<10} {'STATE':<11} {'MEMORY':>9} {'IDLE':>8} ADAPTERS")
    for row in result.get("models", []):
        memory = row.get("memory_bytes")
        shown = f"{memory / (1 << 30):.2f}GiB" if memory else "-"
        typer.echo(
            f"{row['id']:<20} {row['residency']:<10} {row['state']:<11} {shown:>9} "
            f"{row['idle_seconds']:>7.0f}s {', '.join(row['adapters']) or '-'}"
        )
    typer.echo(f"swaps: {result.get('swaps', 0)}")


@models_app.command("load", cls=PlainCommand)
def models_load(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The base model's id.")],
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Boot NAME's engine now (unloading idle ones if it needs the room)."""
    row = admin_request(url, admin_key, "POST", f"/admin/models/{name}/load", cache_dir=cache_dir)
    typer.echo(f"{row['id']}: {row['residency']} ({row['state']})")


@models_app.command("unload", cls=PlainCommand)
def models_unload(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The base model's id.")],
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
) -> None:
    """Stop NAME's engine; its adapters stay, and its next request boots it again."""
    path = f"/admin/models/{name}/unload"
    row = admin_request(url, admin_key, "POST", path, cache_dir=cache_dir)
    typer.echo(f"{row['id']}: {row['residency']} ({row['state']})")
