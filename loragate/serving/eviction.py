"""Which loaded models give way to one more: a pure decision, from a catalog's models as they
are now to what to put to sleep, what to stop and what to wait for, or why it cannot fit.

The rules (docs/catalog.md's "Which engine is unloaded" has them as a table, and
tests/unit/test_eviction.py as one row each):

- **What takes room**: a model whose engine is up and awake (``resident``), or booting,
  restarting or stopping (``loading``). Each counts one against ``max_loaded_models`` and its
  plan's ``memory_bytes`` against ``memory_budget`` (unknown: nothing). An ``asleep`` model
  counts against neither (its weights wait in host memory), nor does a cold or failed one.
- **Fitting**: the newcomer fits when one more model stays within ``max_loaded_models`` and
  the memory taken plus its own stays within ``memory_budget`` (none set: no limit).
- **Who gives way**: only an idle ``resident`` model (nothing in flight, nothing waiting for
  it), never one marked ``keep``, the least recently used first (by when its last request
  ended), as many as it takes.
- **Sleep or stop**: a model with sleep mode is put to sleep, any other is stopped. An asleep
  model is never unloaded to make room: it holds nothing that counts.
- **Waiting**: when the idle ones are not enough, the decision is to unload them and wait for
  the others that are not ``keep`` (still loading, or answering); the caller decides again
  once they change.
- **Refusing**: when there would be too little room even with every model that is not
  ``keep`` gone, the newcomer cannot fit: the decision says why, and nothing is unloaded.
- **ttl** (``past_ttl``, apart from making room): an idle ``resident`` model whose last
  request ended ``ttl`` seconds ago or more is unloaded, ``keep`` or not; an asleep one stays.

The caller (``loragate.gateway.backends.catalog``) applies one unload at a time and asks
again, since a request may reach a model between two unloads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loragate.supervisor.states import LOADING, RESIDENT

# The residencies whose engine holds its memory: up and awake, or on its way up or down.
TAKES_ROOM = frozenset({RESIDENT, LOADING})


@dataclass(frozen=True)
class Occupant:
    """A model of the catalog other than the newcomer, as the room decision sees it.

    ``residency`` is the catalog's word for it (``loragate.supervisor.states``), except that a
    model still being prepared, with no engine yet, is ``cold`` here: it holds nothing.
    ``requests``: in flight, or waiting for its engine. ``last_used``: when its last request
    ended (monotonic seconds). ``sleeps``: unloading it is vLLM's sleep, not a stop. ``ttl``:
    how long it may stay idle (None: for ever)."""

    id: str
    residency: str
    last_used: float = 0.0
    requests: int = 0
    memory_bytes: int | None = None
    keep: bool = False
    sleeps: bool = False
    ttl: float | None = None

    @property
    def takes_room(self) -> bool:
        return self.residency in TAKES_ROOM

    @property
    def idle(self) -> bool:
        """Up, awake and without requests: it may be unloaded now."""
        return self.residency == RESIDENT and self.requests == 0


@dataclass(frozen=True)
class Eviction:
    model: str
    sleep: bool  # put to sleep (its engine stays, weights in host memory); else stopped


@dataclass(frozen=True)
class RoomDecision:
    """What to do so that the newcomer fits: ``unload`` these (in order), then, if
    ``wait_for`` names any, wait for them to become idle and decide again; or, with
    ``refused``, nothing: it cannot fit, and that is why."""

    unload: tuple[Eviction, ...] = ()
    wait_for: tuple[str, ...] = ()
    refused: str | None = None

    @property
    def to_sleep(self) -> tuple[str, ...]:
        return tuple(e.model for e in self.unload if e.sleep)

    @property
    def to_stop(self) -> tuple[str, ...]:
        return tuple(e.model for e in self.unload if not e.sleep)

    @property
    def fits(self) -> bool:
        """Whether the newcomer fits once ``unload`` is done."""
        return not self.wait_for and self.refused is None


def room_for(
    needs_bytes: int | None,
    others: Iterable[Occupant],
    *,
    memory_budget: int | None,
    max_loaded_models: int | None,
) -> RoomDecision:
    """What makes room for a model whose plan holds ``needs_bytes`` (None: unknown, counted
    as nothing) among ``others``, the catalog's other models (the rules: this module's
    docstring)."""
    needs = needs_bytes or 0

    def fits(taking: Sequence[Occupant]) -> bool:
        if max_loaded_models is not None and len(taking) + 1 > max_loaded_models:
            return False
        return memory_budget is None or _held(taking) + needs <= memory_budget

    taking = [model for model in others if model.takes_room]
    if fits(taking):
        return RoomDecision()
    kept = [model for model in taking if model.keep]
    if not fits(kept):
        return RoomDecision(refused=_why_not(needs, kept, memory_budget, max_loaded_models))
    unload: list[Occupant] = []
    for model in sorted(taking, key=lambda m: m.last_used):
        if model.keep or not model.idle:
            continue
        unload.append(model)
        if fits([m for m in taking if m not in unload]):
            break
    left = [m for m in taking if m not in unload]
    return RoomDecision(
        unload=tuple(Eviction(m.id, m.sleeps) for m in unload),
        wait_for=() if fits(left) else tuple(m.id for m in left if not m.keep),
    )


def past_ttl(models: Iterable[Occupant], now: float) -> list[str]:
    """The models idle for their ``ttl`` at ``now`` (monotonic seconds): to unload."""
    return [
        model.id
        for model in models
        if model.ttl is not None and model.idle and now - model.last_used >= model.ttl
    ]


def _held(models: Iterable[Occupant]) -> int:
    return sum(model.memory_bytes or 0 for model in models)


def _why_not(
    needs: int, kept: Sequence[Occupant], memory_budget: int | None, max_loaded_models: int | None
) -> str:
    """Why a model cannot fit even with every model that is not ``keep`` unloaded."""
    names = ", ".join(model.id for model in kept)
    if max_loaded_models is not None and len(kept) + 1 > max_loaded_models:
        return (
            f"the models marked keep ({names}) fill max_loaded_models ({max_loaded_models}): "
            "unload one (gateway models unload ID) or raise max_loaded_models"
        )
    assert memory_budget is not None  # without a cap or a budget everything fits
    if needs > memory_budget:
        return (
            f"it needs {_gib(needs)}, more than the whole memory_budget ({_gib(memory_budget)}): "
            "raise memory_budget, or give the model a smaller engine in its engine_args"
        )
    return (
        f"it needs {_gib(needs)} and the models marked keep ({names}) hold "
        f"{_gib(_held(kept))} of the memory_budget ({_gib(memory_budget)}): unload one "
        "(gateway models unload ID) or raise memory_budget"
    )


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
