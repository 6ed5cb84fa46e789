"""Which loaded models give way to one more: a pure decision, from a catalog's models as they
are now to what to put to sleep, what to stop and what to wait for, or why it cannot fit.

The rules (docs/catalog.md's "Which engine is unloaded" has them as a table, and
tests/unit/test_eviction.py as one row each):

- **What takes room**: a model whose engine is up and awake (``resident``), or booting,
  restarting or stopping (``loading``). Each counts one against ``max_loaded_models``, its
  plan's ``memory_bytes`` against ``memory_budget`` (unknown: nothing) and, on GPUs, its
  plan's ``held_bytes`` against each of its GPUs' room (``gpu_room``: never summed across
  GPUs). An ``asleep`` model counts only what it still holds (``asleep_bytes``, and
  ``asleep_held`` on its GPUs: vLLM keeps its CUDA context and graph pools there), and not
  against ``max_loaded_models``; a cold or failed one holds nothing.
- **Fitting**: the newcomer fits when one more model stays within ``max_loaded_models``, the
  memory held plus its own stays within ``memory_budget`` (none set: no limit), and on each
  GPU it uses what is held there plus its own stays within that GPU's room.
- **Who gives way**: only a model whose leaving makes up some of what is short (one on another
  GPU never does when that GPU is what is short); first the idle ``resident`` ones (nothing in
  flight, nothing waiting for it), never one marked ``keep``, the least recently used first;
  then, if that is not enough, the asleep ones (not ``keep``), stopped, the least recently
  used first.
- **Sleep or stop**: a model with sleep mode is put to sleep, unless the weights of the asleep
  models and its own would pass the host memory there is for them (``host_room``: vLLM pins
  them in host RAM): then it is stopped, as any other is.
- **Waiting**: when those are not enough, the decision is to unload them and wait for the
  others that are not ``keep`` and whose leaving would help (still loading, or answering); the
  caller decides again once they change.
- **Refusing**: when there would be too little room even with every model that is not
  ``keep`` gone, the newcomer cannot fit: the decision says why, and nothing is unloaded.
- **ttl** (``past_ttl``, apart from making room): an idle ``resident`` model whose last
  request ended ``ttl`` seconds ago or more is unloaded, ``keep`` or not; an asleep one stays.

The caller (``loragate.serving.catalog``) applies one unload at a time and asks
again, since a request may reach a model between two unloads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from loragate.engine_states import ASLEEP, COLD, LOADING, RESIDENT
from loragate.plan.gpu.placement import fits_on_gpus

# The residencies whose engine holds its memory: up and awake, or on its way up or down.
TAKES_ROOM = frozenset({RESIDENT, LOADING})
# What may be short: a model too many, the memory budget, or a GPU's room (its number).
_COUNT, _BUDGET = "max_loaded_models", "memory_budget"


@dataclass(frozen=True)
class Occupant:
    """A model of the catalog other than the newcomer, as the room decision sees it.

    ``residency`` is the catalog's word for it (``loragate.engine_states``), except that a
    model still being prepared, with no engine yet, is ``cold`` here: it holds nothing.
    ``requests``: in flight, or waiting for its engine. ``last_used``: when its last request
    ended (monotonic seconds). ``memory_bytes`` and ``held_bytes`` (by GPU number): what its
    engine holds awake; ``asleep_bytes`` and ``asleep_held``: asleep; ``asleep_host_bytes``:
    the host memory its weights take asleep (None: unknown, nothing). ``sleeps``: unloading it
    is vLLM's sleep, not a stop. ``ttl``: how long it may stay idle (None: for ever)."""

    id: str
    residency: str
    last_used: float = 0.0
    requests: int = 0
    memory_bytes: int | None = None
    held_bytes: Mapping[int, int] | None = None
    asleep_bytes: int | None = None
    asleep_held: Mapping[int, int] | None = None
    asleep_host_bytes: int | None = None
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

    def holds(self, residency: str) -> tuple[int, Mapping[int, int]]:
        """What it holds in ``residency``: bytes in all, and bytes by GPU number."""
        if residency in TAKES_ROOM:
            return self.memory_bytes or 0, self.held_bytes or {}
        if residency == ASLEEP:
            return self.asleep_bytes or 0, self.asleep_held or {}
        return 0, {}


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
    gpu_room: Mapping[int, int] | None = None,
    needs_held: Mapping[int, int] | None = None,
    host_room: int | None = None,
) -> RoomDecision:
    """What makes room for a model whose plan holds ``needs_bytes`` (None: unknown, counted
    as nothing), and ``needs_held`` on its GPUs (by number; None: no GPU is checked), among
    ``others``, the catalog's other models (the rules: this module's docstring)."""
    models = list(others)
    needs = needs_bytes or 0

    def short(unloads: Mapping[str, bool]) -> set[str | int]:
        """What would be short once ``unloads`` (model id -> put to sleep) are done."""
        after = [(model, _after(model, unloads)) for model in models]
        over: set[str | int] = set()
        loaded = sum(residency in TAKES_ROOM for _, residency in after)
        if max_loaded_models is not None and loaded + 1 > max_loaded_models:
            over.add(_COUNT)
        held = [model.holds(residency) for model, residency in after]
        if memory_budget is not None and sum(b for b, _ in held) + needs > memory_budget:
            over.add(_BUDGET)
        if gpu_room and needs_held:
            taken = [by_gpu for _, by_gpu in held if by_gpu]
            over |= {n for n, b in needs_held.items() if not fits_on_gpus({n: b}, taken, gpu_room)}
        return over

    def helps(
        model: Occupant, sleep: bool, unloads: Mapping[str, bool], over: set[str | int]
    ) -> bool:
        """Whether unloading ``model`` (to sleep, or stopped) makes up some of ``over``."""
        now = _after(model, unloads)
        bytes_now, gpus_now = model.holds(now)
        bytes_then, gpus_then = model.holds(ASLEEP if sleep else COLD)
        gpus = [n for n in over if isinstance(n, int)]
        return (
            (_COUNT in over and now in TAKES_ROOM)
            or (_BUDGET in over and bytes_then < bytes_now)
            or any(gpus_then.get(n, 0) < gpus_now.get(n, 0) for n in gpus)
        )

    unloads: dict[str, bool] = {}
    over = short(unloads)
    if not over:
        return RoomDecision()
    kept = [model for model in models if model.keep]
    if short({m.id: False for m in models if not m.keep}):
        why = _why_not(needs, needs_held, kept, memory_budget, max_loaded_models, gpu_room)
        return RoomDecision(refused=why)
    awake = sorted((m for m in models if m.idle and not m.keep), key=lambda m: m.last_used)
    for model in awake:
        sleep = model.sleeps and may_sleep(model, models, host_room, unloads)
        if helps(model, sleep, unloads, over):
            unloads[model.id] = sleep
            over = short(unloads)
            if not over:
                return RoomDecision(unload=_evictions(unloads))
    # An asleep engine keeps its CUDA context and graph pools: stopped when they are in the way.
    asleep = sorted(
        (m for m in models if not m.keep and _after(m, unloads) == ASLEEP),
        key=lambda m: (m.id in unloads, m.last_used),  # those asleep already first
    )
    for model in asleep:
        if helps(model, False, unloads, over):
            unloads[model.id] = False
            over = short(unloads)
            if not over:
                return RoomDecision(unload=_evictions(unloads))
    busy = [m for m in models if not m.keep and m.takes_room and m.id not in unloads]
    return RoomDecision(
        unload=_evictions(unloads),
        wait_for=tuple(m.id for m in busy if helps(m, False, unloads, over)),
    )


def may_sleep(
    model: Occupant,
    models: Iterable[Occupant],
    host_room: int | None,
    unloads: Mapping[str, bool] | None = None,
) -> bool:
    """Whether ``model`` may be put to sleep: the weights of the models asleep (once
    ``unloads`` are done) and its own, pinned in host memory by vLLM, within ``host_room``
    (None: not counted)."""
    if host_room is None or model.asleep_host_bytes is None:
        return True
    pinned = sum(
        other.asleep_host_bytes or 0
        for other in models
        if other.id != model.id and _after(other, unloads or {}) == ASLEEP
    )
    return pinned + model.asleep_host_bytes <= host_room


def past_ttl(models: Iterable[Occupant], now: float) -> list[str]:
    """The models idle for their ``ttl`` at ``now`` (monotonic seconds): to unload."""
    return [
        model.id
        for model in models
        if model.ttl is not None and model.idle and now - model.last_used >= model.ttl
    ]


def _after(model: Occupant, unloads: Mapping[str, bool]) -> str:
    """``model``'s residency once ``unloads`` are done."""
    if model.id not in unloads:
        return model.residency
    return ASLEEP if unloads[model.id] else COLD


def _evictions(unloads: Mapping[str, bool]) -> tuple[Eviction, ...]:
    return tuple(Eviction(model_id, sleep) for model_id, sleep in unloads.items())


def _why_not(
    needs: int,
    needs_held: Mapping[int, int] | None,
    kept: Sequence[Occupant],
    memory_budget: int | None,
    max_loaded_models: int | None,
    gpu_room: Mapping[int, int] | None,
) -> str:
    """Why a model cannot fit even with every model that is not ``keep`` unloaded."""
    taking = [model for model in kept if model.takes_room]
    names = ", ".join(model.id for model in taking)
    if max_loaded_models is not None and len(taking) + 1 > max_loaded_models:
        return (
            f"the models marked keep ({names}) fill max_loaded_models ({max_loaded_models}): "
            "unload one (gateway models unload ID) or raise max_loaded_models"
        )
    held = {model.id: model.holds(model.residency) for model in kept}
    if memory_budget is not None and sum(b for b, _ in held.values()) + needs > memory_budget:
        if needs > memory_budget:
            return (
                f"it needs {_gib(needs)}, more than the whole memory_budget "
                f"({_gib(memory_budget)}): raise memory_budget, or give the model a smaller "
                "engine in its engine_args"
            )
        holders = ", ".join(model_id for model_id, (b, _) in held.items() if b)
        return (
            f"it needs {_gib(needs)} and the models marked keep ({holders}) hold "
            f"{_gib(sum(b for b, _ in held.values()))} of the memory_budget "
            f"({_gib(memory_budget)}): unload one (gateway models unload ID) or raise "
            "memory_budget"
        )
    for number, nbytes in sorted((needs_held or {}).items()):
        assert gpu_room  # a GPU is checked only with its room
        if number not in gpu_room:  # its memory unknown: nothing is refused for room there
            continue
        room = gpu_room[number]
        on_it = {i: by_gpu[number] for i, (_, by_gpu) in held.items() if by_gpu.get(number)}
        if nbytes > room:
            return (
                f"it needs {_gib(nbytes)} of GPU {number}, more than its room ({_gib(room)} "
                "free when the gateway started): plan it elsewhere (models.ID.devices, gateway "
                "plan --config) or give the model a smaller engine in its engine_args"
            )
        if nbytes + sum(on_it.values()) > room:
            return (
                f"it needs {_gib(nbytes)} of GPU {number} and the models marked keep there "
                f"({', '.join(on_it)}) hold {_gib(sum(on_it.values()))} of its "
                f"{_gib(room)}: unload one (gateway models unload ID), or place the model on "
                "another GPU (models.ID.devices)"
            )
    return "there is too little room even with every model not marked keep unloaded"


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
