"""Engine flags after ``--`` that loragate sets itself: refused, with the loragate flag to use.

Everything after ``--`` goes to vLLM untouched, except the flags through which loragate
drives the engine: passing them there would silently fight the gateway (a second port the
gateway never uses, a served name it does not route to, adapters outside its manager, a key
it does not know). Flags that loragate only reads (the parallelism sizes, ``--dtype``) stay
accepted there.
"""

from __future__ import annotations

from collections.abc import Iterable

# vLLM flag -> what to do instead: the `gateway serve` option to pass (before `--`), if any.
OWNED_FLAGS: dict[str, str] = {
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
}


def owned_flags_in(args: Iterable[str]) -> list[str]:
    """The loragate-owned flags among ``args`` (``--flag`` and ``--flag=value`` forms)."""
    found = []
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in OWNED_FLAGS and name not in found:
            found.append(name)
    return found


def check_engine_args(args: Iterable[str]) -> None:
    """Raise ``ValueError`` naming each loragate-owned flag in ``args`` and what to use."""
    owned = owned_flags_in(args)
    if owned:
        lines = [f"{flag}: {OWNED_FLAGS[flag]}" for flag in owned]
        raise ValueError(
            "engine arguments after `--` may not set what loragate sets itself:\n    "
            + "\n    ".join(lines)
        )
