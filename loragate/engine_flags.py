"""The vLLM flags loragate's engine command sets, and what a user may give after ``--``.

``ENGINE_FLAGS`` is the one table of them: ``loragate.supervisor.command`` spells the engine's
command line from an engine spec through it (a flag missing here cannot be set), and
``OWNED_FLAGS``, the flags refused after ``--``, are its owned rows. Everything after ``--``
goes to vLLM untouched, but passing an owned flag there would silently fight the gateway (a
second port the gateway never uses, a served name it does not route to, adapters outside its
manager, a key it does not know). A default row is loragate's choice until the user's own
arguments after ``--`` make theirs (``--dtype``, the memory flags); flags that loragate only
reads (``--max-model-len``) are not rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Parallelism: `gateway serve` options that are also accepted after `--`, under vLLM's names and
# short aliases (vllm/engine/arg_utils.py, ParallelConfig group). The preflight reads them
# wherever they were given.
PARALLEL_OPTIONS: dict[str, tuple[str, ...]] = {
    "--tensor-parallel-size": ("-tp",),
    "--pipeline-parallel-size": ("-pp",),
    "--data-parallel-size": ("-dp",),
    "--distributed-executor-backend": (),
}


@dataclass(frozen=True)
class EngineFlag:
    """How loragate treats one vLLM flag of its engine command."""

    # Owned: what to use instead, said when the flag is refused after `--`; None: a default,
    # left off the command line when the arguments after `--` give it or one of ``yields_to``.
    instead: str | None = None
    yields_to: tuple[str, ...] = ()
    # False: loragate never passes it (it does that flag's work its own way); owned all the same.
    passed: bool = True


def _owned(instead: str, *, passed: bool = True) -> EngineFlag:
    return EngineFlag(instead=instead, passed=passed)


ENGINE_FLAGS: dict[str, EngineFlag] = {
    # Owned: always loragate's.
    "--model": _owned(
        "use --model (before `--`; a catalog model's own `model`): the gateway prepares and checks it"
    ),
    "--served-model-name": _owned("use --model-name (or --served-model-name before `--`)"),
    "--uds": _owned("not needed: the gateway puts the engine on a private socket of its own"),
    "--enable-lora": _owned("not needed: the gateway always enables LoRA"),
    "--max-loras": _owned("use --max-loras"),
    "--max-lora-rank": _owned("use --max-lora-rank"),
    "--max-cpu-loras": _owned("use --max-cpu-loras"),
    "--lora-modules": _owned("use --lora NAME=SOURCE (or --lora-modules before `--`)"),
    "--enable-auto-tool-choice": _owned(
        "not needed: the gateway passes it with the tool-call parser"
    ),
    "--tool-call-parser": _owned(
        "use --tool-call-parser (before `--`): the gateway checks the name"
    ),
    "--allowed-media-domains": _owned(
        "not needed: the gateway fetches image URLs itself, after its checks"
    ),
    # Owned and never passed: the gateway does their work.
    "--port": _owned(
        "use --port (the gateway's port; the engine listens on a private socket)", passed=False
    ),
    "--host": _owned(
        "use --host (the gateway's address; the engine listens on a private socket)",
        passed=False,
    ),
    "--api-key": _owned(
        "use --api-key (the gateway's inference key; the engine gets a per-boot key)",
        passed=False,
    ),
    "--allowed-local-media-path": _owned(
        "use --allowed-media-dir (or --allowed-local-media-path before `--`)", passed=False
    ),
    "--allowed-origins": _owned(
        "use --cors-origin (or --allowed-origins before `--`)", passed=False
    ),
    # Defaults: the gateway logs requests itself (--access-log).
    "--disable-access-log-for-endpoints": EngineFlag(),
    "--disable-uvicorn-access-log": EngineFlag(
        yields_to=("--no-disable-uvicorn-access-log", "--disable-access-log-for-endpoints")
    ),
    # Defaults: the `gateway serve` options of the same name (the settings refuse a layout
    # given both ways, differently), and the executor of the 'single-process' boot mode.
    **{flag: EngineFlag(yields_to=aliases) for flag, aliases in PARALLEL_OPTIONS.items()},
    "--otlp-traces-endpoint": EngineFlag(),
    # Defaults the plan chooses: the model's (the demo's dtype, a Vi run's structured outputs),
    # the engine's memory (the CPU build's KV cache, a GPU's share), a catalog model's sleep.
    "--dtype": EngineFlag(),
    "--structured-outputs-config": EngineFlag(),
    "--kv-cache-memory-bytes": EngineFlag(),
    "--gpu-memory-utilization": EngineFlag(),
    "--enable-sleep-mode": EngineFlag(),
}

# vLLM flag -> what to do instead: the `gateway serve` option to pass (before `--`), if any.
OWNED_FLAGS: dict[str, str] = {
    flag: rule.instead for flag, rule in ENGINE_FLAGS.items() if rule.instead is not None
}


def loragate_passes(flag: str, user_args: Iterable[str]) -> bool:
    """Whether the engine command carries loragate's ``flag`` beside ``user_args`` (those
    after ``--``): an owned flag always, a default unless they give it (any spelling).
    ``KeyError`` for a flag that is no row of ``ENGINE_FLAGS``, or one loragate never passes."""
    rule = ENGINE_FLAGS[flag]
    if not rule.passed:
        raise KeyError(f"loragate never passes {flag} to the engine")
    if rule.instead is not None:
        return True
    # ``--flag.key V`` sets one key of a config flag (vLLM's dotted form): it gives the flag too.
    given = {flag_name(arg).split(".", 1)[0] for arg in user_args}
    return not given & {flag, *rule.yields_to}


def flag_name(arg: str) -> str:
    """The flag ``arg`` names as vLLM's argparse reads it: ``--max_loras=4`` is
    ``--max-loras`` (vLLM's ``FlexibleArgumentParser`` turns ``_`` into ``-`` in a long
    flag's name, and production-stack's chart spells them so). Short flags stay as they are."""
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def owned_flags_in(args: Iterable[str]) -> list[tuple[str, str]]:
    """The loragate-owned flags among ``args``, each as (spelled, flag): ``--flag``,
    ``--flag=value`` and the underscore spellings alike."""
    found: list[tuple[str, str]] = []
    for arg in args:
        flag = flag_name(arg)
        if flag in OWNED_FLAGS and flag not in [known for _, known in found]:
            found.append((arg.split("=", 1)[0], flag))
    return found


def check_engine_args(args: Iterable[str], where: str = "engine arguments after `--`") -> None:
    """Raise ``ValueError`` naming each loragate-owned flag in ``args`` (``where`` says which
    arguments those are) and what to use."""
    owned = owned_flags_in(args)
    if owned:
        lines = [f"{spelled}: {OWNED_FLAGS[flag]}" for spelled, flag in owned]
        raise ValueError(
            f"{where} may not set what loragate sets itself:\n    " + "\n    ".join(lines)
        )


# Read, never set, by loragate: they say how much of the world runs on this node.
_LOCAL_OPTIONS: dict[str, tuple[str, ...]] = {
    "--data-parallel-size-local": ("-dpl",),
    "--nnodes": ("-n",),
    "--data-parallel-backend": ("-dpb",),
}
# vllm/config/parallel.py: DistributedExecutorBackend.
EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")


def engine_arg_value(args: list[str], flag: str, aliases: tuple[str, ...] = ()) -> str | None:
    """The value ``args`` give ``flag`` (or an alias), as argparse reads it: ``--flag V``,
    ``--flag=V``, ``--flag_name V``, ``-tp V``, ``-tp=V``; the last one wins. None when not
    given."""
    names = (flag, *aliases)
    value = None
    for index, arg in enumerate(args):
        _, sep, inline = arg.partition("=")
        if flag_name(arg) not in names:
            continue
        if sep:
            value = inline
        elif index + 1 < len(args):
            value = args[index + 1]
    return value


@dataclass(frozen=True)
class ParallelLayout:
    """How the engine spreads one model: vLLM's parallel sizes and executor backend."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    backend: str | None = None
    data_local: int | None = None  # --data-parallel-size-local
    nnodes: int = 1
    data_backend: str = "mp"  # --data-parallel-backend

    @property
    def model_split(self) -> int:
        """Into how many parts each replica's weights are cut (one GPU each)."""
        return self.tensor * self.pipeline

    @property
    def local_workers(self) -> int:
        """Workers (one GPU, or one NUMA node on the CPU build, each) on this node. As in
        vLLM's ``EngineArgs.create_engine_config``: ``--data-parallel-size-local`` replicas
        when given, else the world split evenly over ``--nnodes``."""
        if self.data_local is not None:
            return self.model_split * self.data_local
        return max(self.model_split * self.data // max(self.nnodes, 1), self.model_split)

    @property
    def spread(self) -> bool:
        return self.model_split * self.data > 1

    def describe(self) -> str:
        """The options that make up ``local_workers``, e.g. ``--tensor-parallel-size 4``."""
        parts = [
            f"{flag} {size}"
            for flag, size in (
                ("--tensor-parallel-size", self.tensor),
                ("--pipeline-parallel-size", self.pipeline),
                ("--data-parallel-size-local", self.data_local),
            )
            if size is not None and size > 1
        ]
        if self.data_local is None and self.data > 1:
            nodes = f" over --nnodes {self.nnodes}" if self.nnodes > 1 else ""
            parts.append(f"--data-parallel-size {self.data}{nodes}")
        return " x ".join(parts) or "one worker"


def _size(flag: str, raw: str | None, least: int = 1) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{flag} takes a whole number, not {raw!r}") from None
    if value < least:
        raise ValueError(f"{flag} must be at least {least}, not {value}")
    return value


def parallel_layout(args: list[str], options: dict[str, int | str | None]) -> ParallelLayout:
    """The layout from the `gateway serve` options (``options``, by vLLM flag name) and the
    engine arguments after `--`; ``ValueError`` when one is given both ways, differently."""
    chosen: dict[str, str | None] = {}
    for flag, aliases in PARALLEL_OPTIONS.items():
        given = options.get(flag)
        raw = engine_arg_value(args, flag, aliases)
        if given is not None and raw is not None and str(given) != raw:
            spelled = next(
                (arg.partition("=")[0] for arg in args if flag_name(arg) in (flag, *aliases)),
                flag,
            )
            raise ValueError(
                f"{flag} is {given} but the engine arguments after `--` say {spelled} {raw}: "
                "give it once (before `--` is enough)"
            )
        chosen[flag] = str(given) if given is not None else raw
    backend = chosen["--distributed-executor-backend"]
    if backend is not None and backend not in EXECUTOR_BACKENDS:
        raise ValueError(
            f"--distributed-executor-backend takes one of {', '.join(EXECUTOR_BACKENDS)}, "
            f"not {backend!r}"
        )
    local = {
        flag: engine_arg_value(args, flag, aliases) for flag, aliases in _LOCAL_OPTIONS.items()
    }
    return ParallelLayout(
        tensor=_size("--tensor-parallel-size", chosen["--tensor-parallel-size"]) or 1,
        pipeline=_size("--pipeline-parallel-size", chosen["--pipeline-parallel-size"]) or 1,
        data=_size("--data-parallel-size", chosen["--data-parallel-size"]) or 1,
        backend=backend,
        # 0: a node that runs only the API server (vLLM allows it).
        data_local=_size("--data-parallel-size-local", local["--data-parallel-size-local"], 0),
        nnodes=_size("--nnodes", local["--nnodes"]) or 1,
        data_backend=local["--data-parallel-backend"] or "mp",
    )
