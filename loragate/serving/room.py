"""The room a catalog's models share, measured once when the gateway starts, and the room
decisions taken in it (``loragate.serving.eviction``).

- **On GPUs** (``nvidia-smi`` lists some): each GPU's free memory is its room, counted apart,
  never summed across GPUs; each model has its part of the catalog's GPU plan
  (``loragate.plan.gpu.serve_plan.plan_settings``: its GPUs and share, beside the models that
  fit with it), and holds that plan's ``held_bytes`` on its GPUs when it runs. The host memory
  available then is the room for the weights of the models asleep (vLLM pins them there).
  ``memory_budget``, when given, caps what the engines hold of all GPUs together.
- **Without GPUs** (the CPU build): ``memory_budget``, or else the RAM available at start.

A boot is also checked against the GPUs as they are when it starts (``boot_refusal``): another
program may have taken the memory the plan counted on, and vLLM would refuse the share.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil

from loragate.plan.gpu.placement import Placement, boot_refusal, gpu_room
from loragate.plan.gpu.serve_plan import plan_settings
from loragate.plan.preflight.machine import GpuInfo, visible_gpus
from loragate.serving.eviction import Occupant, RoomDecision, may_sleep, room_for
from loragate.settings import Settings

log = logging.getLogger("loragate.gateway")


@dataclass
class CatalogRoom:
    """The limits a catalog's room decisions keep to: ``gpu_room`` (bytes by GPU number) and
    ``host_room`` only on GPUs; ``placements``: each model's part of the GPU plan, by id."""

    max_loaded_models: int | None = None
    memory_budget: int | None = None
    gpu_room: dict[int, int] | None = None
    host_room: int | None = None
    placements: dict[str, Placement | None] = field(default_factory=dict)

    @classmethod
    def given(cls, settings: Settings) -> CatalogRoom:
        """What the settings say, before anything is measured."""
        budget = settings.memory_budget
        return cls(settings.max_loaded_models, int(budget) if budget is not None else None)

    @classmethod
    async def measure(cls, settings: Settings) -> CatalogRoom:
        """The room now: the GPUs' (and the GPU plan of the settings' models on them), or
        without GPUs the available RAM unless a ``memory_budget`` is given."""
        room = cls.given(settings)
        gpus = await asyncio.to_thread(visible_gpus)
        if not gpus:
            if room.memory_budget is None:
                from loragate.plan.cpu import node_available_bytes

                room.memory_budget = await asyncio.to_thread(node_available_bytes)
            return room
        room.gpu_room = gpu_room(gpus)
        room.host_room = psutil.virtual_memory().available
        room.placements = await _placements(settings, gpus)
        return room

    def decide(
        self, needs_bytes: int | None, needs_held: Mapping[int, int] | None, others: list[Occupant]
    ) -> RoomDecision:
        """What gives way to a model holding ``needs_bytes`` (``needs_held`` on its GPUs)."""
        return room_for(
            needs_bytes,
            others,
            memory_budget=self.memory_budget,
            max_loaded_models=self.max_loaded_models,
            gpu_room=self.gpu_room,
            needs_held=needs_held,
            host_room=self.host_room,
        )

    def may_sleep(self, model: Occupant, models: Iterable[Occupant]) -> bool:
        """Whether ``model``'s weights fit in host memory beside those of the models asleep."""
        return may_sleep(model, models, self.host_room)

    async def boot_refusal(self, placement: Placement | None) -> str | None:
        """Why vLLM would refuse to boot the engine of ``placement`` on the GPUs as they are
        now (its share is more than is free there); None when it would boot, or off GPUs."""
        if placement is None or self.gpu_room is None:
            return None
        gpus = await asyncio.to_thread(visible_gpus)
        return boot_refusal(placement, gpus or [])

    def report(self) -> dict[str, Any]:
        """The limits as ``/admin/models`` shows them."""
        rooms = self.gpu_room
        return {
            "max_loaded_models": self.max_loaded_models,
            "memory_budget": self.memory_budget,
            "gpu_room": {str(n): free for n, free in rooms.items()} if rooms is not None else None,
            "host_room": self.host_room,
        }


async def _placements(settings: Settings, gpus: list[GpuInfo]) -> dict[str, Placement | None]:
    """Each model's part of the catalog's GPU plan; none when the plan fails (each model is
    then planned alone as it boots)."""
    try:
        plan = await asyncio.to_thread(plan_settings, settings, gpus)
    except Exception:
        log.exception("the catalog's GPU plan failed: each model is planned alone as it boots")
        return {}
    return {model_id: plan.engine(model_id) for model_id in settings.models}
