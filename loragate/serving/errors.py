"""What the serving core refuses, in its own words: no HTTP status here.

Each refusal names what went wrong (a model nobody serves, an engine that does not serve now,
an adapter nobody has, a change a manifest owns, an adapter that fits no single model) and a
``code`` a client may match on; the gateway's managed backend turns each into the answer a
client sees (``loragate.gateway.backends.managed``). An adapter operation's own failure stays
an ``AdapterError`` (``loragate.adapters.errors``), which carries its status already.
"""

from __future__ import annotations

from collections.abc import Sequence


class ServingError(Exception):
    """A refusal of the serving core; ``code`` names it for clients."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class ModelNotFound(ServingError):
    """No model, base or adapter, of that name: ``known`` lists those that are served, and
    ``looked_at`` the places searched for it (a catalog's ``adapter_dir`` and resolvers)."""

    def __init__(self, name: str, known: Sequence[str], looked_at: Sequence[str] = ()) -> None:
        message = f"The model `{name}` does not exist. Valid models: {', '.join(known)}"
        if looked_at:
            message += " Looked for it at: " + "; ".join(looked_at)
        super().__init__(message, "model_not_found")
        self.name = name
        self.known = list(known)


class NotServing(ServingError):
    """The model exists but cannot take the request now: still preparing
    (``engine_starting``), could not be prepared (``engine_failed``), its engine down or
    restarting (``engine_unavailable``), every adapter slot busy (``adapter_slots_busy``), no
    room to load it (``model_capacity``). ``retry_after``: seconds worth waiting, if any."""

    def __init__(self, message: str, code: str, retry_after: int | None = None) -> None:
        super().__init__(message, code)
        self.retry_after = retry_after


class UnknownAdapter(ServingError):
    """No adapter of that name (nor an add of it under way)."""

    def __init__(self, name: str, where: str = "") -> None:
        super().__init__(f"no adapter named {name!r}{where}", "adapter_not_found")


class OwnedByManifest(ServingError):
    """A change to adapters that a fleet manifest owns: change the manifest instead."""

    def __init__(self, source: str) -> None:
        super().__init__(
            f"this gateway serves the adapters of the manifest {source}; change the manifest "
            "instead (every replica following it converges on the change)",
            "managed_by_manifest",
        )


class AmbiguousBase(ServingError):
    """A new adapter whose base model cannot be told: a catalog has several."""

    def __init__(self, name: str, models: int) -> None:
        super().__init__(
            f"this catalog has {models} base models: add {name!r} in a model's lora or "
            "adapter_dir in the config file",
            "ambiguous_base_model",
        )
