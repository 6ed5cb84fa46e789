"""Which loaded models give way to one more (``loragate.serving.eviction``), one row per rule of
docs/catalog.md's "Which engine is unloaded" table: least recently used among the idle first,
never one with requests, never ``keep``, sleep before stop where sleep mode is on, an asleep
model counting only what it still holds, ``max_loaded_models`` and ``memory_budget`` both
counted, each GPU's room counted apart, the host memory the weights of asleep models take, and
a load that cannot fit refused without unloading anything."""

from __future__ import annotations

from typing import Any

import pytest

from loragate.engine_states import ASLEEP, COLD, FAILED, LOADING, RESIDENT
from loragate.serving.eviction import (
    Eviction,
    Occupant,
    RoomDecision,
    may_sleep,
    past_ttl,
    room_for,
)

GIB = 2**30


def up(model_id: str, last_used: float, **fields: Any) -> Occupant:
    """An idle resident model whose last request ended at ``last_used``."""
    return Occupant(model_id, RESIDENT, last_used=last_used, **fields)


def stop(*ids: str) -> tuple[Eviction, ...]:
    return tuple(Eviction(model_id, sleep=False) for model_id in ids)


ROOM_TABLE = [
    pytest.param(
        [up("a", 2), up("b", 1), up("c", 3)], None, None, 3, RoomDecision(unload=stop("b")),
        id="lru-among-idle-goes-first",
    ),
    pytest.param(
        [up("a", 1), up("b", 2)], None, None, 3, RoomDecision(),
        id="room-left-nothing-unloaded",
    ),
    pytest.param(
        [up("a", 1, requests=1), up("b", 2)], None, None, 2, RoomDecision(unload=stop("b")),
        id="never-one-with-requests-in-flight-or-waiting",
    ),
    pytest.param(
        [up("a", 1, requests=2), up("b", 2, requests=1)], None, None, 2,
        RoomDecision(wait_for=("a", "b")),
        id="all-busy-wait-for-them",
    ),
    pytest.param(
        [Occupant("a", LOADING, last_used=1), up("b", 2, requests=1)], None, None, 2,
        RoomDecision(wait_for=("a", "b")),
        id="a-loading-model-counts-and-is-waited-for",
    ),
    pytest.param(
        [up("a", 1, keep=True), up("b", 2)], None, None, 2, RoomDecision(unload=stop("b")),
        id="keep-never-even-when-least-recently-used",
    ),
    pytest.param(
        [up("a", 1, keep=True), up("b", 2, requests=1)], None, None, 2,
        RoomDecision(wait_for=("b",)),
        id="keep-never-the-busy-other-is-waited-for",
    ),
    pytest.param(
        [up("a", 1, sleeps=True), up("b", 2)], None, None, 2,
        RoomDecision(unload=(Eviction("a", sleep=True),)),
        id="sleep-mode-puts-to-sleep-instead-of-stopping",
    ),
    pytest.param(
        [Occupant("a", ASLEEP, last_used=0, memory_bytes=8 * GIB), up("b", 2, sleeps=True)],
        4 * GIB, 10 * GIB, 1, RoomDecision(unload=(Eviction("b", sleep=True),)),
        id="an-asleep-model-counts-only-what-it-still-holds",
    ),
    pytest.param(
        [Occupant("a", COLD), Occupant("b", FAILED), up("c", 1)], None, None, 2,
        RoomDecision(),
        id="cold-and-failed-models-count-nothing",
    ),
    pytest.param(
        [up("a", 1), up("b", 2), up("c", 3)], None, None, 2, RoomDecision(unload=stop("a", "b")),
        id="max-loaded-models-counted-as-many-unloaded-as-it-takes",
    ),
    pytest.param(
        [up("a", 1, memory_bytes=6 * GIB), up("b", 2, memory_bytes=3 * GIB)],
        4 * GIB, 10 * GIB, None, RoomDecision(unload=stop("a")),
        id="budget-counted-lru-first",
    ),
    pytest.param(
        [up("a", 1, memory_bytes=3 * GIB), up("b", 2, memory_bytes=3 * GIB),
         up("c", 3, memory_bytes=3 * GIB)],
        4 * GIB, 10 * GIB, None, RoomDecision(unload=stop("a")),
        id="budget-counted-stops-once-it-fits",
    ),
    pytest.param(
        [up("a", 1, memory_bytes=6 * GIB)], 4 * GIB, 10 * GIB, None, RoomDecision(),
        id="budget-exactly-full-fits",
    ),
    pytest.param(
        [up("a", 1, memory_bytes=None), up("b", 2, memory_bytes=9 * GIB)],
        None, 10 * GIB, None, RoomDecision(),
        id="unknown-memory-counts-nothing",
    ),
    pytest.param(
        [up("a", 1, memory_bytes=2 * GIB), up("b", 2, memory_bytes=7 * GIB, requests=1)],
        4 * GIB, 10 * GIB, None, RoomDecision(unload=stop("a"), wait_for=("b",)),
        id="idle-ones-not-enough-unload-them-and-wait-for-the-busy",
    ),
    pytest.param(
        [up("a", i) for i in range(5)], 10**15, None, None, RoomDecision(),
        id="no-cap-no-budget-always-fits",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("others", "needs", "budget", "cap", "decision"), ROOM_TABLE)
def test_room_for_a_newcomer(
    others: list[Occupant],
    needs: int | None,
    budget: int | None,
    cap: int | None,
    decision: RoomDecision,
) -> None:
    assert room_for(needs, others, memory_budget=budget, max_loaded_models=cap) == decision


REFUSALS = [
    pytest.param(
        [up("a", 1, keep=True), up("b", 2, keep=True)], None, None, 2,
        "the models marked keep (a, b) fill max_loaded_models (2)",
        id="kept-models-fill-the-cap",
    ),
    pytest.param(
        [up("a", 1)], 12 * GIB, 10 * GIB, None,
        "it needs 12.00 GiB, more than the whole memory_budget (10.00 GiB)",
        id="bigger-than-the-whole-budget",
    ),
    pytest.param(
        [up("a", 1, keep=True, memory_bytes=7 * GIB), up("b", 2, memory_bytes=1 * GIB)],
        4 * GIB, 10 * GIB, None,
        "the models marked keep (a) hold 7.00 GiB of the memory_budget (10.00 GiB)",
        id="kept-models-hold-too-much-of-the-budget",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("others", "needs", "budget", "cap", "why"), REFUSALS)
def test_a_newcomer_that_cannot_fit_is_refused_with_why_and_nothing_is_unloaded(
    others: list[Occupant], needs: int | None, budget: int | None, cap: int | None, why: str
) -> None:
    decision = room_for(needs, others, memory_budget=budget, max_loaded_models=cap)
    assert decision.unload == () and decision.wait_for == () and not decision.fits
    assert decision.refused is not None and why in decision.refused
    assert "gateway models unload" in decision.refused or "raise memory_budget" in decision.refused


ROOM = {0: 24 * GIB, 1: 24 * GIB}  # two GPUs, each its own room
ASLEEP_HOLDS = 5 * GIB // 4  # a CUDA context and the CUDA graphs' allowance


def on(gpu: int, nbytes: float) -> dict[int, int]:
    return {gpu: int(nbytes * GIB)}


def asleep(model_id: str, last_used: float, gpu: int = 0, **fields: Any) -> Occupant:
    """A model asleep on ``gpu``, holding its CUDA context and graphs there."""
    return Occupant(
        model_id, ASLEEP, last_used=last_used, asleep_held={gpu: ASLEEP_HOLDS}, **fields
    )


def sleeper(model_id: str, last_used: float, gpu: int, nbytes: float, **fields: Any) -> Occupant:
    """An idle resident model with sleep mode, holding ``nbytes`` GiB of ``gpu`` awake."""
    return up(
        model_id, last_used, held_bytes=on(gpu, nbytes), asleep_held={gpu: ASLEEP_HOLDS},
        sleeps=True, **fields,
    )  # fmt: skip


GPU_TABLE = [
    pytest.param(
        [up("a", 1, held_bytes=on(0, 10))], on(0, 10), RoomDecision(),
        id="two-models-on-one-gpu-both-fit",
    ),
    pytest.param(
        [up("a", 2, held_bytes=on(0, 10)), up("b", 3, held_bytes=on(0, 10)),
         up("c", 1, held_bytes=on(1, 10))],
        on(0, 10), RoomDecision(unload=stop("a")),
        id="a-third-on-that-gpu-evicts-one-there-only",
    ),
    pytest.param(
        [up("a", 1, held_bytes=on(0, 20)), up("b", 2, held_bytes=on(1, 20), requests=1)],
        on(1, 10), RoomDecision(wait_for=("b",)),
        id="a-model-for-gpu-1-never-evicts-one-on-gpu-0",
    ),
    pytest.param(
        [up("a", 1, held_bytes=on(0, 20)), up("b", 2, held_bytes=on(1, 20))],
        {0: 5 * GIB, 1: 5 * GIB}, RoomDecision(unload=stop("a", "b")),
        id="a-model-on-two-gpus-needs-room-on-each",
    ),
    pytest.param(
        [asleep("a", 1)], on(0, 20), RoomDecision(),
        id="an-asleep-model-on-the-gpu-fits-beside",
    ),
    pytest.param(
        [asleep("a", 1)], on(0, 23), RoomDecision(unload=stop("a")),
        id="an-asleep-model-counts-what-it-still-holds-on-its-gpu",
    ),
    pytest.param(
        [asleep("a", 1, gpu=1)], on(0, 23.5), RoomDecision(),
        id="an-asleep-model-on-another-gpu-is-not-in-the-way",
    ),
    pytest.param(
        [sleeper("a", 5, 0, 10), asleep("b", 1)], on(0, 13), RoomDecision(unload=(Eviction("a", sleep=True),)),
        id="awake-ones-sleep-first-the-asleep-one-stays",
    ),
    pytest.param(
        [sleeper("a", 1, 0, 20)], on(0, 23), RoomDecision(unload=stop("a")),
        id="a-sleeper-whose-leftovers-are-in-the-way-is-stopped",
    ),
    pytest.param(
        [sleeper("a", 1, 0, 20, keep=True), up("b", 2, held_bytes=on(1, 20))],
        on(1, 10), RoomDecision(unload=stop("b")),
        id="keep-on-one-gpu-does-not-refuse-another",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("others", "needs_held", "decision"), GPU_TABLE)
def test_room_on_gpus_is_counted_per_gpu(
    others: list[Occupant], needs_held: dict[int, int], decision: RoomDecision
) -> None:
    got = room_for(
        None, others, memory_budget=None, max_loaded_models=None, gpu_room=ROOM,
        needs_held=needs_held,
    )  # fmt: skip
    assert got == decision


@pytest.mark.parametrize(
    ("needs_held", "why"),
    [
        (on(0, 30), "it needs 30.00 GiB of GPU 0, more than its room (24.00 GiB free"),
        (on(0, 10), "the models marked keep there (a) hold 20.00 GiB of its 24.00 GiB"),
    ],
)
def test_a_newcomer_that_cannot_fit_on_its_gpu_is_refused_naming_it(
    needs_held: dict[int, int], why: str
) -> None:
    others = [up("a", 1, keep=True, held_bytes=on(0, 20)), up("b", 2, held_bytes=on(0, 2))]
    decision = room_for(
        None, others, memory_budget=None, max_loaded_models=None, gpu_room=ROOM,
        needs_held=needs_held,
    )  # fmt: skip
    assert decision.unload == () and decision.refused is not None and why in decision.refused


def test_an_asleep_model_counts_what_it_still_holds_in_the_memory_budget() -> None:
    others = [Occupant("a", ASLEEP, asleep_bytes=2 * GIB), up("b", 2, memory_bytes=4 * GIB)]
    fits = room_for(4 * GIB, others, memory_budget=10 * GIB, max_loaded_models=None)
    assert fits == RoomDecision()
    tight = room_for(6 * GIB, others, memory_budget=10 * GIB, max_loaded_models=None)
    assert tight == RoomDecision(unload=stop("b"))  # b goes; a's 2 GiB stay counted
    tighter = room_for(9 * GIB, others, memory_budget=10 * GIB, max_loaded_models=None)
    assert tighter == RoomDecision(unload=stop("b", "a"))


def test_a_sleeper_is_stopped_when_its_weights_would_pass_the_host_memory() -> None:
    """vLLM pins an asleep engine's weights in host memory: the weights of the models asleep
    and its own must fit in ``host_room``, or it is stopped instead."""
    pinned = Occupant("a", ASLEEP, asleep_host_bytes=20 * GIB)
    weighty = up("b", 2, sleeps=True, asleep_host_bytes=16 * GIB)
    decide = room_for(
        None, [pinned, weighty], memory_budget=None, max_loaded_models=1, host_room=32 * GIB
    )
    assert decide == RoomDecision(unload=stop("b"))
    roomy = room_for(
        None, [pinned, weighty], memory_budget=None, max_loaded_models=1, host_room=40 * GIB
    )
    assert roomy == RoomDecision(unload=(Eviction("b", sleep=True),))
    assert not may_sleep(weighty, [pinned, weighty], 32 * GIB)
    assert may_sleep(weighty, [pinned, weighty], None)  # not counted off GPUs


def test_the_decision_names_what_to_sleep_and_what_to_stop() -> None:
    others = [up("a", 1, sleeps=True), up("b", 2), up("c", 3, sleeps=True)]
    decision = room_for(None, others, memory_budget=None, max_loaded_models=1)
    assert decision.to_sleep == ("a", "c") and decision.to_stop == ("b",) and decision.fits


TTL_TABLE = [
    pytest.param(up("a", 0, ttl=60), 60, ["a"], id="idle-for-its-ttl"),
    pytest.param(up("a", 0, ttl=60), 59, [], id="not-yet"),
    pytest.param(up("a", 0), 10**6, [], id="no-ttl-never"),
    pytest.param(up("a", 0, ttl=60, keep=True), 60, ["a"], id="keep-does-not-hold-back-ttl"),
    pytest.param(up("a", 0, ttl=60, requests=1), 60, [], id="requests-in-flight-hold-it"),
    pytest.param(Occupant("a", ASLEEP, ttl=60), 60, [], id="asleep-stays-asleep"),
    pytest.param(Occupant("a", LOADING, ttl=60), 60, [], id="loading-is-not-idle"),
]


@pytest.mark.parametrize(("model", "now", "due"), TTL_TABLE)
def test_which_models_are_past_their_ttl(model: Occupant, now: float, due: list[str]) -> None:
    assert past_ttl([model], now) == due
