"""vLLM's sleep mode as a catalog uses it: what an asleep engine still holds, and a sleep and a
wake in the order that keeps the engine whole.

What vLLM 0.32 keeps and drops (file:line in its installed package):

- **Level 1** (``POST /sleep?level=1``, what the catalog sends) copies the weights to pinned
  host memory and discards the KV cache: the cuMem backend offloads the ``weights`` tag
  (``device_allocator/sleep_mode_backend.py:127-137``) into ``pin_memory`` tensors
  (``device_allocator/cumem.py:265-276``). An asleep engine's weights take host RAM the
  kernel cannot swap out: the plan's ``weights_bytes``.
- **What stays on the GPU**: the CUDA context, and the CUDA graph pools unless the engine
  runs with ``--sleep-mode-offload-cudagraph`` (``config/model.py:380``, used only through
  ``config/vllm.py:688-700``), beside the workspaces outside torch. The plan allows
  ``CUDA_CONTEXT_BYTES`` and ``RUNTIME_BYTES`` for them on each GPU; an asleep engine is
  counted as holding both there, with the flag too (the workspaces stay): too much rather
  than too little.
- **While asleep** ``/health`` answers, a generation waits in the paused scheduler until the
  wake, and a LoRA load would write slots that sleep unmapped (``EngineSupervisor.asleep``
  gives the lines): the supervisor probes it with ``/health`` alone and holds adapter calls
  back (``kept_awake``) until the wake. ``/sleep`` aborts the requests in flight
  (``v1/engine/core.py:921-947``): the catalog puts only idle engines to sleep.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from loragate.plan.gpu.placement import Placement
from loragate.plan.gpu.vllm_rules import CUDA_CONTEXT_BYTES, RUNTIME_BYTES
from loragate.supervisor.client import EngineClient
from loragate.supervisor.engine import EngineSupervisor

# What an asleep engine is counted as holding on each of its GPUs.
ASLEEP_GPU_BYTES = CUDA_CONTEXT_BYTES + RUNTIME_BYTES


@dataclass(frozen=True)
class AsleepHold:
    """What an asleep engine still holds: ``gpus`` by GPU number, ``gpu_bytes`` on all of them
    together, and ``host_bytes`` of weights pinned in host memory (None: unknown)."""

    gpu_bytes: int
    gpus: dict[int, int] = field(default_factory=dict)
    host_bytes: int | None = None


def asleep_hold(placement: Placement | None, held: Mapping[int, int] | None) -> AsleepHold:
    """What the engine of ``placement`` (its GPU plan; None: none) holds asleep; ``held``:
    what it holds awake, by GPU, as its engine was planned. Without a plan it is counted as
    one GPU's worth, on no GPU in particular."""
    devices = list(held or ()) or (placement.devices if placement is not None else [])
    gpus = {n: min(ASLEEP_GPU_BYTES, (held or {}).get(n, ASLEEP_GPU_BYTES)) for n in devices}
    host = placement.weights_bytes if placement is not None else None
    return AsleepHold(sum(gpus.values()) if gpus else ASLEEP_GPU_BYTES, gpus, host)


async def put_to_sleep(supervisor: EngineSupervisor, engine: EngineClient) -> None:
    """Level 1, once no adapter call is under way, and none starts until the wake; raises
    ``EngineUnavailable`` when the engine did not go to sleep (the caller stops it)."""
    await supervisor.falling_asleep()
    await engine.sleep()


async def wake(supervisor: EngineSupervisor, engine: EngineClient) -> None:
    """``/wake_up``, then the adapter changes that waited for it go on; raises
    ``EngineUnavailable`` when the engine did not wake (the caller stops it)."""
    await engine.wake_up()
    supervisor.woke()
