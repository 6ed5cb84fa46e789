"""Stand-ins for the engine's LoRA API and the supervisor, for tests of the adapter manager.

They answer at once and remember what is loaded, so a test sees what the manager asked of
the engine without booting one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path


class QuietEngine:
    """The engine admin calls the manager makes, answered at once."""

    def __init__(self) -> None:
        self.loaded: dict[str, Path] = {}

    async def load_adapter(self, engine_id: str, path: Path) -> None:
        self.loaded[engine_id] = path

    async def unload_adapter(self, engine_id: str) -> None:
        self.loaded.pop(engine_id, None)

    async def served_ids(self) -> set[str]:
        return set()


class ServingSupervisor:
    """A supervisor whose engine is always serving, and awake."""

    async def wait_until_serving(self, timeout: float) -> None:
        return None

    @contextlib.asynccontextmanager
    async def kept_awake(self) -> AsyncIterator[bool]:
        yield True
