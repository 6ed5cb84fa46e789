"""``gateway plan``: what ``gateway serve`` would boot, and whether vLLM will agree, before
anything boots: each engine's GPUs, its ``--gpu-memory-utilization`` share, its weights, KV
cache and longest sequence, which models can be resident together, and for a model that does
not fit, why and the flag that would make it fit. It takes serve's options (and the engine's
arguments after ``--``) and reads the GPUs from ``nvidia-smi``, or from ``--gpu`` to plan for
a machine it is not on. The plan itself is ``loragate.plan.gpu``'s."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from loragate import cli_tables as table
from loragate.cli_errors import FAILURE, USAGE, fail, fail_each
from loragate.cli_options import given_values, serve_parameters


def plan(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH", help="Settings file (TOML or YAML); default: $LORAGATE_CONFIG when set."
        ),
    ] = None,
    model_argument: Annotated[
        str | None,
        typer.Argument(metavar="MODEL", show_default=False, help="The base model, as --model."),
    ] = None,
    gpu: Annotated[
        list[str] | None,
        typer.Option(
            "--gpu",
            metavar="TOTAL[:FREE]",
            help="Plan for this GPU instead of asking nvidia-smi, e.g. 24GiB or 8GiB:7GiB (total, "
            "then free; free defaults to total). Once per GPU, in CUDA's order.",
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the plan as JSON (engines, each with fits, reason, devices, "
            "gpu_memory_utilization, weights_bytes, kv_cache_bytes, max_model_len, argv; and "
            "resident_at_once), for scripts.",
        ),
    ] = False,
    **options: Any,
) -> None:
    """Show what `gateway serve` would boot, and whether vLLM will agree, without booting.

    With serve's options: each engine's GPUs and --gpu-memory-utilization share, its weights,
    KV cache and --max-model-len, and the models that can be resident together.

    A model that does not fit is refused with the flag and value that would make it fit
    (exit 1). Models are read from their config.json and safetensors headers alone; arguments
    after `--` go to the engine as for serve."""
    from loragate.settings import SettingsError, load_settings

    explicit = given_values(options)
    if model_argument is not None:
        explicit["model"] = model_argument
    explicit["engine_args"] = list(ctx.args) or None
    try:
        described = [parse_gpu(text) for text in gpu or []]
        settings = load_settings(config, from_flags=True, **explicit)
    except SettingsError as exc:
        fail_each(exc.problems, USAGE)
        return
    except ValueError as exc:
        fail(str(exc), USAGE)
        return
    report = plan_report(settings, described or None)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        width = table.terminal_width()
        typer.echo(plan_table(report, width), nl=False)
    if any(engine["fits"] is False for engine in report["engines"]):
        raise typer.Exit(FAILURE)


# --gpu, then serve's own options (each a Settings field).
plan.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [*list(inspect.signature(plan, eval_str=True).parameters.values())[:5], *serve_parameters()]
)


def parse_gpu(text: str) -> Any:
    """``--gpu TOTAL[:FREE]`` as the GPU it describes (sizes as the settings read them:
    ``24GiB``, ``80GB``, bytes)."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    from loragate.plan.preflight.machine import GpuInfo

    total_text, _, free_text = text.partition(":")
    try:
        total = int(TypeAdapter(ByteSize).validate_python(total_text.strip()))
        free = int(TypeAdapter(ByteSize).validate_python(free_text.strip())) if free_text else total
    except ValidationError:
        raise ValueError(
            f"--gpu {text}: give TOTAL[:FREE] sizes, e.g. 24GiB or 8GiB:7GiB"
        ) from None
    if not 0 < free <= total:
        raise ValueError(f"--gpu {text}: free must be more than 0 and at most the total")
    return GpuInfo("", "described by --gpu", total, free)


def plan_report(settings: Any, described: list[Any] | None) -> dict[str, Any]:
    """The plan as ``--json`` prints it: GPUs described, else nvidia-smi's, else the CPU
    build's plan of host memory."""
    from loragate.plan.gpu.serve_plan import plan_host, plan_settings
    from loragate.plan.preflight.machine import visible_gpus

    gpus = described if described is not None else visible_gpus()
    if not gpus:
        return plan_host(settings).as_dict()
    return plan_settings(settings, gpus).as_dict()


def plan_table(report: dict[str, Any], width: int = 80) -> str:
    """The plan for a person: the GPUs, then one row per engine with what it needs and gets,
    a refusal's reason (and a fitting engine's flags) wrapped beneath its row."""
    lines: list[str] = []
    engines = report["engines"]
    if report["gpus"]:
        held: dict[str, int] = {}
        for engine in engines:
            if engine["resident"]:
                for device, nbytes in engine["held_bytes"].items():
                    held[device] = held.get(device, 0) + nbytes
        rows = [
            [str(n), table.size(gpu["total_bytes"]), table.size(gpu["free_bytes"]),
             table.size(held.get(str(n))), gpu["name"]]
            for n, gpu in enumerate(report["gpus"])
        ]  # fmt: skip
        lines += [*table.columns(["GPU", "TOTAL", "FREE", "RESIDENT", "NAME"], rows), ""]
    else:
        lines += [f"no GPU: the CPU build's plan, in {table.size(report['host_bytes'])} free", ""]
    if not engines:
        lines.append("no engine to plan (an upstream server, or an engine_command of your own)")
        return "\n".join(lines) + "\n"
    rows = [
        [engine["model"], {True: "yes", False: "no"}.get(engine["fits"], "?"),
         ",".join(str(d) for d in engine["devices"]) or "-",
         f"{engine['gpu_memory_utilization']:g}" if engine["gpu_memory_utilization"] else "-",
         table.size(engine["weights_bytes"]), table.size(engine["kv_cache_bytes"]),
         str(engine["max_model_len"] or "-")]
        for engine in engines
    ]  # fmt: skip
    lines += table.columns(
        ["MODEL", "FITS", "GPUS", "SHARE", "WEIGHTS", "KV CACHE", "MAX LEN"], rows
    )
    for engine in engines:
        if engine["reason"]:
            lines += table.beneath(engine["reason"], width)
        elif engine["fits"] and (engine["args"] or engine["env"]):
            given = [*engine["args"], *(f"{k}={v}" for k, v in engine["env"].items())]
            lines += table.beneath(f"{engine['model']} boots with {' '.join(given)}", width)
        for warning in engine.get("warnings") or []:
            lines += table.beneath(f"{engine['model']}: {warning}", width)
    resident = report["resident_at_once"]
    lines += ["", f"resident at once: {', '.join(resident) if resident else 'none'}"]
    return "\n".join(lines) + "\n"
