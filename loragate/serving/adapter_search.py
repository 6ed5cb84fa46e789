"""Where a catalog looks for an adapter name that no model has registered: only in the places
its operator configured, in order, and never twice at once for one name.

The places: each model's ``adapter_dir`` sub-folder of that name, when it exists, then each
model's ``resolvers`` (an ``hf://ORG/`` prefix the name completes, or a URL template with
``{name}``), in the models' order. The first place whose model can add it from there (through
the same pipeline and store as the admin API: the caller's ``add``) gets it. Requests for a
name under search wait on the same search; a name found nowhere is not looked for again for
``MISSING_FOR_SECONDS``, so a client that repeats a wrong name sends nothing anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import quote

from loragate.adapters.names import InvalidAdapterName, validate_adapter_name
from loragate.logs import redact_urls
from loragate.settings.catalog import CatalogModel

log = logging.getLogger("loragate.gateway")

# How long a name no place had stays unknown, without asking the places again.
MISSING_FOR_SECONDS = 60.0

# Adds adapter ``name`` to model ``model_id`` from ``source``: None once it serves, else why
# that place could not give it.
AddAdapter = Callable[[str, str, str], Awaitable[str | None]]


class AdapterNotFound(Exception):
    """No configured place had the name; ``tried`` says what each place answered."""

    def __init__(self, name: str, tried: list[str]) -> None:
        super().__init__(f"adapter {name} found nowhere: " + "; ".join(tried))
        self.name = name
        self.tried = tried


class AdapterSearch:
    """The places of ``models`` (model id to its catalog entry), searched with ``add``."""

    def __init__(self, models: Mapping[str, CatalogModel], add: AddAdapter) -> None:
        self._models = models
        self._add = add
        self._searches: dict[str, asyncio.Task[str]] = {}
        self._missing: dict[str, float] = {}  # name -> until when no place is asked for it

    def may_find(self, name: str) -> bool:
        """Whether ``name`` is an adapter name some place may hold and that was not found
        nowhere a moment ago."""
        if not _is_adapter_name(name) or self._missing.get(name, 0) > time.monotonic():
            return False
        return bool(self.places_for(name))

    def places_for(self, name: str) -> list[tuple[str, str]]:
        """``(model id, source)`` where ``name`` may be, in order: each model's ``adapter_dir``
        folder that exists, then each model's resolvers."""
        folders, remote = [], []
        for model_id, spec in self._models.items():
            folder = spec.adapter_dir
            if folder is not None and (folder.expanduser() / name).is_dir():
                folders.append((model_id, str(folder.expanduser() / name)))
            for place in spec.resolvers:
                source = place + name if place.startswith("hf://") else place
                remote.append((model_id, source.replace("{name}", quote(name, safe=""))))
        return folders + remote

    async def find(self, name: str) -> str:
        """The id of the model that now serves ``name``, added from the first place that had
        it; ``AdapterNotFound`` when none had. Concurrent calls for one name share a search."""
        task = self._searches.get(name)
        if task is None:
            task = asyncio.create_task(self._search(name), name=f"resolve-{name}")
            self._searches[name] = task
            task.add_done_callback(lambda _: self._searches.pop(name, None))
        return await asyncio.shield(task)

    def searches(self) -> list[asyncio.Task[str]]:
        """The searches under way (what stopping the catalog cancels)."""
        return list(self._searches.values())

    async def _search(self, name: str) -> str:
        tried = []
        for model_id, source in self.places_for(name):
            log.info("model %s: looking for adapter %s at %s", model_id, name, redact_urls(source))
            refused = await self._add(model_id, name, source)
            if refused is None:
                return model_id
            tried.append(f"{redact_urls(source)}: {refused}")
        self._missing[name] = time.monotonic() + MISSING_FOR_SECONDS
        log.info("adapter %s found nowhere: %s", name, "; ".join(tried))
        raise AdapterNotFound(name, tried)


def _is_adapter_name(name: str) -> bool:
    try:
        validate_adapter_name(name)
    except InvalidAdapterName:
        return False
    return True
