"""Engine flags after ``--`` that loragate sets itself: refused, with the loragate flag to use.

Everything after ``--`` goes to vLLM untouched, except the flags through which loragate
drives the engine: passing them there would silently fight the gateway (a second port the
gateway never uses, a served name it does not route to, adapters outside its manager, a key
it does not know). Flags that loragate only reads (the parallelism sizes, ``--dtype``) stay
accepted there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# vLLM flag -> what to do instead: the `gateway serve` option to pass (before `--`), if any.
OWNED_FLAGS: dict[str, str] = {
    "--model": "use --model (before `--`; a catalog model's own `model`): the gateway prepares and checks it",
    "--port": "use --port (the gateway's port; the engine listens on a private socket)",
    "--host": "use --host (the gateway's address; the engine listens on a private socket)",
    "--uds": "not needed: the gateway puts the engine on a private socket of its own",
    "--served-model-name": "use --model-name (or --served-model-name before `--`)",
    "--api-key": "use --api-key (the gateway's inference key; the engine gets a per-boot key)",
    "--lora-modules": "use --lora NAME=SOURCE (or --lora-modules before `--`)",
    "--enable-lora": "not needed: the gateway always enables LoRA",
    "--max-loras": "use --max-loras",
    "--max-lora-rank": "use --max-lora-rank",
    "--max-cpu-loras": "use --max-cpu-loras",
    "--allowed-local-media-path": "use --allowed-media-dir (or --allowed-local-media-path before `--`)",
    "--allowed-media-domains": "not needed: the gateway fetches image URLs itself, after its checks",
    "--allowed-origins": "use --cors-origin (or --allowed-origins before `--`)",
    "--tool-call-parser": "use --tool-call-parser (before `--`): the gateway checks the name",
    "--enable-auto-tool-choice": "not needed: the gateway passes it with the tool-call parser",
}


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


# Parallelism: `gateway serve` options that are also accepted after `--`, under vLLM's names and
# short aliases (vllm/engine/arg_utils.py, ParallelConfig group). The preflight reads them
# wherever they were given.
PARALLEL_OPTIONS: dict[str, tuple[str, ...]] = {
    "--tensor-parallel-size": ("-tp",),
    "--pipeline-parallel-size": ("-pp",),
    "--data-parallel-size": ("-dp",),
    "--distributed-executor-backend": (),
}
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
