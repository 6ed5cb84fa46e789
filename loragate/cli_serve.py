"""``gateway serve``: check what can be checked before the engine starts (the settings, the
engine arguments after ``--``, the tool-call parser, the machine, the port), then run the
gateway on its own server (``loragate.gateway.server``). Every option but --config is a ``Settings`` field (``cli_options``)."""

from __future__ import annotations

import gc
import inspect
from pathlib import Path
from typing import Annotated, Any

import typer

from loragate.cli_errors import FAILURE, USAGE, fail, fail_each, warn
from loragate.cli_help import PlainCommand
from loragate.cli_options import PANELS, given_values, serve_parameters, setting_envvars

NO_MODEL = "no model: pass --model DIR|ORG/NAME|FILE.gguf, or run `gateway demo` for the demo"
# What `gateway demo` leaves out of serve's parameters: what chooses the model, and its keys.
DEMO_LEAVES_OUT = (
    "model_argument", "model", "upstream_url", "run_id", "secret_key", "organization_id",
    "as_demo",
)  # fmt: skip


class ServeCommand(PlainCommand):
    """``gateway serve``: its own options before ``--``, the engine's after it.

    An unknown option or a stray argument before ``--`` is an error (a typo such as
    ``--max-lora 4`` would otherwise reach vLLM silently); everything after ``--`` becomes the
    engine's arguments (``ctx.args``), checked by the settings for loragate-owned flags. Its
    help groups the options in ``PANELS`` and names each setting's variable.
    """

    usage_tail = " [-- ENGINE_ARGS...]"
    panels = PANELS

    def more_envvars(self, option: Any) -> list[str]:
        return setting_envvars(option)

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
    config: Annotated[
        Path | None,
        typer.Option(
            metavar="PATH", help="Settings file (TOML or YAML); default: $LORAGATE_CONFIG when set."
        ),
    ] = None,
    model_argument: Annotated[
        str | None,
        typer.Argument(
            metavar="MODEL",
            show_default=False,
            help="The base model, as --model (`gateway serve MODEL`, like `vllm serve MODEL`).",
        ),
    ] = None,
    *,
    as_demo: bool = False,  # `gateway demo`: not an option (the signature below leaves it out)
    **options: Any,
) -> None:
    """Start the engine and the gateway. Arguments after `--` go to the engine untouched
    (except the flags loragate sets itself, which are refused with the option to use)."""
    from loragate.settings import SettingsError, load_settings, settings_warnings

    explicit = given_values(options)
    if model_argument is not None:
        if explicit.get("model") not in (None, model_argument):
            fail(
                f"the model is given twice: {model_argument!r} and --model "
                f"{explicit['model']!r}; give it once",
                USAGE,
            )
        explicit["model"] = model_argument
    explicit["engine_args"] = list(ctx.args) or None
    from loragate.engine_flags import check_engine_args

    for warning in settings_warnings():
        warn(warning)
    try:
        check_engine_args(ctx.args)
        settings = load_settings(config, from_flags=True, **explicit)
    except SettingsError as exc:  # one line per problem, each naming its source
        fail_each(exc.problems, USAGE)
        return
    except ValueError as exc:
        fail(str(exc), USAGE)
        return
    if as_demo:
        settings = _demo_settings(settings)
    else:
        from loragate.plan.engine_plan import names_a_model

        if not names_a_model(settings):
            # Never the demo as a fallback: a unit whose environment file went missing fails.
            fail(NO_MODEL, USAGE)
    from loragate.logs import configure_logging

    configure_logging(settings.log_level, settings.log_json)
    from loragate.plan.engine_plan import check_before_start
    from loragate.plan.preflight.problem import PreflightError
    from loragate.plan.tool_parsers import ToolParserError

    try:
        check_before_start(settings)
    except ToolParserError as exc:
        fail(str(exc), USAGE)
    except PreflightError as exc:
        fail(str(exc), FAILURE)
    from loragate.gateway.access.auth import KeyConfigError
    from loragate.gateway.app import create_app

    try:
        asgi = create_app(settings)
    except KeyConfigError as exc:
        fail(str(exc), USAGE)
        return
    from loragate.gateway.server.serve import StartupFailed, serve_app

    # What is alive now (modules, the app) lives as long as the process: out of the
    # collector's sight, a collection walks only what requests allocate (a gen-1 pass takes
    # about 0.6 ms instead of 1 ms, and a full one no longer walks ~70k objects).
    gc.collect()
    gc.freeze()
    try:
        serve_app(asgi, settings)
    except StartupFailed as exc:
        fail(f"the gateway could not start: {exc}", FAILURE)
    except OSError as exc:
        fail(f"cannot listen on {settings.host}:{settings.port}: {exc}", FAILURE)


# Every option but --config (and the MODEL argument, --model's twin) is a Settings field:
# declared there once (loragate/cli_options.py).
serve.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    # eval_str: typer reads a __signature__ as it is, and this module's annotations are
    # strings (a string annotation was why --config showed no help).
    [*list(inspect.signature(serve, eval_str=True).parameters.values())[:3], *serve_parameters()]
)


def demo(ctx: typer.Context, config: Path | None = None, **options: Any) -> None:
    """Serve the bundled demo model and its adapters (built the first time, then cached).

    SmolLM2-135M-Instruct with its pirate and signed adapters, or with LORAGATE_DEMO=tiny
    the test suite's tiny model. It takes `gateway serve`'s options but those that choose
    the model; arguments after `--` go to the engine."""
    serve(ctx, config, as_demo=True, **options)


# serve's options (their declarations, --config's included) minus those that choose the model.
demo.__signature__ = inspect.signature(serve).replace(  # type: ignore[attr-defined]
    parameters=[
        p for p in inspect.signature(serve).parameters.values() if p.name not in DEMO_LEAVES_OUT
    ]
)


def _demo_settings(settings: Any) -> Any:
    """``settings`` serving the demo (smollm2 unless LORAGATE_DEMO or the config file picks
    one); a model, upstream or Vi run named by the environment or the file is refused."""
    for name in ("model", "upstream_url", "run_id"):
        if getattr(settings, name) is not None:
            fail(
                f"`gateway demo` serves the bundled demo, but {name} is set (LORAGATE_"
                f"{name.upper()} or the config file): run `gateway serve` to serve it",
                USAGE,
            )
    return settings.model_copy(update={"demo": settings.demo or "smollm2"})
