"""``gateway status``: a running gateway at a glance, in plain aligned columns as ``ollama ps``
and ``docker ps`` print them (the gateway, its engines, its models, its adapters), or with
``--json`` the admin API's report as it always was, for scripts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from loragate import cli_tables as table
from loragate.cli_admin import (
    DEFAULT_URL,
    AdminKeyOption,
    CacheDirOption,
    UrlOption,
    admin_request,
    local_admin_token,
    read_quietly,
)


@dataclass
class StatusAnswers:
    """What the admin API answered: ``/admin/engine``, ``/admin/adapters`` and, for a catalog
    of base models, ``/admin/models``."""

    engine: dict[str, Any]
    adapters: dict[str, Any]
    catalog: dict[str, Any] | None

    def report(self) -> dict[str, Any]:
        """``gateway status --json``: the engine(s) without the log tail, the adapters and the
        catalog. Scripts read this shape: it stays as it is."""
        if self.catalog is None:
            engine = {k: v for k, v in self.engine.items() if k != "log_tail"}
        else:
            engine = {
                model: {k: v for k, v in each.items() if k != "log_tail"}
                for model, each in self.engine.items()
            }
        report: dict[str, Any] = {"engine": engine, "adapters": self.adapters.get("data", [])}
        if self.catalog is not None:
            report["catalog"] = {k: v for k, v in self.catalog.items() if k != "object"}
        return report


def status(
    url: UrlOption = DEFAULT_URL,
    admin_key: AdminKeyOption = None,
    cache_dir: CacheDirOption = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the admin API's report (engine, adapters, catalog) as JSON, for scripts.",
        ),
    ] = False,
) -> None:
    """The gateway, its engines, models and adapters at a glance, as a table.

    Each engine's state, pid, restarts, uptime and memory; the requests in flight; each
    adapter's version, state and source; for a catalog of base models, each model's
    residency, idle time and the swaps. --json prints the admin API's report, for scripts."""
    if admin_key is None:
        admin_key = local_admin_token(url, cache_dir)
    engine = admin_request(url, admin_key, "GET", "/admin/engine", cache_dir=cache_dir)
    adapters = admin_request(url, admin_key, "GET", "/admin/adapters", cache_dir=cache_dir)
    catalog = None
    if "base_models" in adapters:  # a catalog: /admin/engine has one engine per model
        catalog = admin_request(url, admin_key, "GET", "/admin/models", cache_dir=cache_dir)
    answers = StatusAnswers(engine, adapters, catalog)
    if as_json:
        typer.echo(json.dumps(answers.report(), indent=2))
        return
    health = read_quietly(url, "/health")
    traffic = read_quietly(url, "/metrics/recent?window=10&step=10", admin_key)
    width = table.terminal_width()
    typer.echo(status_table(url, answers, health, traffic, width), nl=False)


def status_table(
    url: str,
    answers: StatusAnswers,
    health: dict[str, Any] | None,
    traffic: dict[str, Any] | None,
    width: int = 80,
) -> str:
    """The sections of ``gateway status``, each a header and aligned rows, with a reason
    wrapped beneath whatever is not well."""
    traffic = traffic or {}
    health = health or {}
    base = answers.adapters.get("base_model") or next(iter(health.get("models") or []), "engine")
    lines = table.columns(
        ["GATEWAY", "STATUS", "UPTIME", "IN FLIGHT", "WAITING"],
        [[url, health.get("status", "-"), table.duration(health.get("uptime_s")),
          table.count(traffic.get("in_flight")), table.count(traffic.get("queued"))]],
    )  # fmt: skip
    if health.get("status") not in (None, "healthy") and health.get("reason"):
        lines += table.beneath(str(health["reason"]), width)
    progress = health.get("progress")  # a start that downloads, dequantizes or boots
    if isinstance(progress, dict) and progress.get("description"):
        lines += table.beneath(str(progress["description"]), width)
    engines = answers.engine if answers.catalog is not None else {base: answers.engine}
    lines += ["", *_engines(engines, width)]
    if answers.catalog is not None:
        lines += ["", *_catalog_models(answers.catalog, width)]
    else:
        adapters = answers.adapters.get("data", [])
        row = [base, answers.engine.get("state", "-"), table.count(traffic.get("in_flight")),
               str(len(adapters))]  # fmt: skip
        lines += ["", *table.columns(["MODEL", "STATE", "IN FLIGHT", "ADAPTERS"], [row])]
    lines += ["", *_adapters(answers.adapters, base, width)]
    return "\n".join(lines) + "\n"


def _engines(engines: dict[str, dict[str, Any]], width: int) -> list[str]:
    rows = [
        [name, engine.get("state", "-"), table.count(engine.get("pid")), table.count(engine.get("restarts")),
         table.duration(engine.get("uptime_s")), table.size(engine.get("rss_bytes"))]
        for name, engine in engines.items()
    ]  # fmt: skip
    lines = table.columns(["ENGINE", "STATE", "PID", "RESTARTS", "UPTIME", "MEMORY"], rows)
    for name, engine in engines.items():
        if engine.get("state") not in ("ready", "stopped") and engine.get("reason"):
            lines += table.beneath(f"{name}: {engine['reason']}", width)
        if engine.get("last_exit"):
            lines += table.beneath(f"{name}'s last exit: {engine['last_exit']}", width)
    return lines


def _catalog_models(catalog: dict[str, Any], width: int) -> list[str]:
    models = catalog.get("models", [])
    rows = [
        [model["id"], model.get("residency", "-"), model.get("state", "-"),
         table.count(model.get("in_flight")), table.duration(model.get("idle_seconds")),
         table.size(model.get("memory_bytes")), str(len(model.get("adapters") or []))]
        for model in models
    ]  # fmt: skip
    header = ["MODEL", "RESIDENCY", "STATE", "IN FLIGHT", "IDLE", "MEMORY", "ADAPTERS"]
    lines = table.columns(header, rows)
    for model in models:
        if model.get("residency") == "failed" and model.get("reason"):
            lines += table.beneath(f"{model['id']}: {model['reason']}", width)
    lines.append(f"swaps: {catalog.get('swaps', 0)}")
    return lines


def _adapters(adapters: dict[str, Any], base: str, width: int) -> list[str]:
    data = adapters.get("data", [])
    adding = [
        r for r in adapters.get("progress", []) if isinstance(r, dict) and not r.get("finished")
    ]
    if not data and not adding:
        return ["no adapters"]
    rows = [
        [f"{row['name']}@{(row.get('version') or '-')[:12]}", row.get("base_model") or base,
         row.get("state", "-"), row.get("source") or "-"]
        for row in data
    ]  # fmt: skip
    lines = table.columns(["ADAPTER", "MODEL", "STATE", "SOURCE"], rows) if rows else []
    for row in data:
        if row.get("error"):
            lines += table.beneath(f"{row['name']}: {row['error']}", width)
    from loragate.cli_progress import progress_line

    for record in adding:
        lines.append(f"adding {record['name']}: {(progress_line(record) or '').strip()}")
    return lines
