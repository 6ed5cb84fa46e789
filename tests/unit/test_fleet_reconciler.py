"""Converging on the fleet manifest, through the manager's real swap path (engine answered by
a double): adds, swaps, rollbacks, removals, refusals that keep the old version serving, and
manifests or entries that go wrong without taking the others down."""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from loragate.adapters.errors import AdapterError
from loragate.adapters.fleet_manifest import FleetManifestError
from loragate.adapters.fleet_reconciler import FleetReconciler
from loragate.adapters.intake.pipeline import PreparedVersion
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import AdapterStore
from tests.unit.test_manager_event_loop import adapter_source, make_manager


class Fleet:
    """The manifest as the reconciler fetches it, and the sources as the manager prepares them."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = AdapterStore(tmp_path / "store")
        self.versions = {
            tag: self.store.put_dir(adapter_source(tmp_path / tag, 1024, tag))
            for tag in ("v1", "v2", "v3")
        }
        self.manager, self.engine = make_manager(tmp_path, self.store, self.versions)
        self.prepared: list[str] = []
        self.failing: dict[str, Exception] = {}
        self.manager._prepare = self._prepare  # type: ignore[method-assign]
        self.data: bytes | Exception = b'{"adapters": {}}'
        self.reconciler = FleetReconciler(
            self.manager, "https://config.example/a.json", 1.0, self._fetch
        )

    async def _prepare(self, source: str, revision: str | None) -> PreparedVersion:
        self.prepared.append(source)
        if source in self.failing:
            raise self.failing[source]
        return PreparedVersion(self.versions[source], Provenance(source, revision))

    def _fetch(self, source: str) -> bytes:
        if isinstance(self.data, Exception):
            raise self.data
        return self.data

    def declare(self, **adapters: Any) -> str:
        self.data = json.dumps({"adapters": adapters}).encode()
        return hashlib.sha256(self.data).hexdigest()

    def declare_none(self) -> str:
        """A manifest that serves no adapter, on purpose."""
        self.data = b'{"adapters": {}, "allow_empty": true}'
        return hashlib.sha256(self.data).hexdigest()

    def serving(self, name: str) -> str | None:
        if name not in self.manager.routes.public_names():
            return None
        return self.manager.routes.get(name)


@pytest.fixture
async def fleet(tmp_path: Path) -> Any:
    fleet = Fleet(tmp_path)
    yield fleet
    await fleet.manager.aclose()


def digest(fleet: Fleet, tag: str) -> str:
    return fleet.versions[tag].digest


async def test_adds_swaps_rolls_back_and_removes(fleet: Fleet) -> None:
    r1 = fleet.declare(fox={"source": "v1"})
    await fleet.reconciler.reconcile()
    assert fleet.serving("fox") == f"fox@{digest(fleet, 'v1')[:12]}"
    report = fleet.reconciler.report()
    assert report["serving_revision"] == report["latest_revision"] == r1 and report["converged"]

    r2 = fleet.declare(fox={"source": "v2"})
    await fleet.reconciler.reconcile()
    assert fleet.serving("fox") == f"fox@{digest(fleet, 'v2')[:12]}"
    assert fleet.manager.counters["swaps"] == 1
    assert fleet.reconciler.serving_revision == r2

    fleet.declare(fox={"source": "v1"})  # a rollback: the earlier version named again
    await fleet.reconciler.reconcile()
    assert fleet.serving("fox") == f"fox@{digest(fleet, 'v1')[:12]}"

    prepared = len(fleet.prepared)
    await fleet.reconciler.reconcile()  # nothing changed: nothing fetched or swapped
    assert len(fleet.prepared) == prepared

    r0 = fleet.declare_none()
    await fleet.reconciler.reconcile()
    assert "fox" not in fleet.manager.manifest.entries and fleet.serving("fox") is None
    assert fleet.reconciler.serving_revision == r0 and fleet.reconciler.converged


async def test_a_refused_version_keeps_the_old_one_serving_and_is_not_retried(fleet: Fleet) -> None:
    r1 = fleet.declare(fox={"source": "v1"})
    await fleet.reconciler.reconcile()
    fleet.failing["v2"] = AdapterError("adapter_config.json: rank 64 is above --max-lora-rank 16")
    r2 = fleet.declare(fox={"source": "v2"})
    await fleet.reconciler.reconcile()
    await fleet.reconciler.reconcile()
    assert fleet.prepared.count("v2") == 1  # refused once, not fetched again while unchanged
    assert fleet.serving("fox") == f"fox@{digest(fleet, 'v1')[:12]}"
    report = fleet.reconciler.report()
    assert report["latest_revision"] == r2 and report["serving_revision"] == r1
    assert not report["converged"]
    assert "rank 64" in report["adapter_errors"]["fox"]

    del fleet.failing["v2"]
    fleet.declare(fox={"source": "v2", "revision": "fixed"})  # a changed entry is tried again
    await fleet.reconciler.reconcile()
    assert fleet.serving("fox") == f"fox@{digest(fleet, 'v2')[:12]}"
    assert fleet.reconciler.converged and not fleet.reconciler.errors


async def test_a_failure_that_may_pass_is_retried_next_pass(fleet: Fleet) -> None:
    fleet.failing["v1"] = AdapterError("engine restarting", status=503, code="engine_unavailable")
    fleet.declare(fox={"source": "v1"})
    await fleet.reconciler.reconcile()
    assert fleet.reconciler.applied_once and not fleet.reconciler.converged
    del fleet.failing["v1"]
    await fleet.reconciler.reconcile()
    assert fleet.serving("fox") is not None and fleet.reconciler.converged


async def test_a_pinned_digest_must_match(fleet: Fleet) -> None:
    fleet.declare(fox={"source": "v1", "digest": digest(fleet, "v2")[:12]})
    await fleet.reconciler.reconcile()
    assert fleet.serving("fox") is None
    assert "not the pinned" in fleet.reconciler.errors["fox"]
    fleet.declare(fox={"source": "v1", "digest": digest(fleet, "v1")[:12]})
    await fleet.reconciler.reconcile()
    assert fleet.serving("fox") is not None and fleet.reconciler.converged


async def test_an_unreachable_or_broken_manifest_changes_nothing(fleet: Fleet) -> None:
    r1 = fleet.declare(fox={"source": "v1"})
    await fleet.reconciler.reconcile()
    for failure in (FleetManifestError("cannot fetch the adapters manifest: refused"), None):
        if failure is None:
            fleet.data = b'{"adapters": {"fox": {"sorce": "v2"}}}'
        else:
            fleet.data = failure
        await fleet.reconciler.reconcile()
        assert fleet.serving("fox") == f"fox@{digest(fleet, 'v1')[:12]}"
        report = fleet.reconciler.report()
        assert report["error"] and report["serving_revision"] == r1 and not report["converged"]


async def test_what_the_cache_already_serves_is_not_fetched_again_at_start(
    fleet: Fleet,
) -> None:
    fleet.declare(fox={"source": "v1"})
    await fleet.reconciler.reconcile()
    restarted = FleetReconciler(fleet.manager, "x", 1.0, fleet._fetch)
    prepared = len(fleet.prepared)
    await restarted.reconcile()
    assert len(fleet.prepared) == prepared and restarted.converged


@pytest.mark.parametrize(
    "data",
    [
        b"adapters:\n",  # the file cut short after its first line
        b"adapters: null\n",
        b"",
        b'{"adapters": {}}',  # empty, but not said to be on purpose
        b'{"adapters": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"adapters:\n" + b"".join(b"  " * i + b"a:\n" for i in range(1, 700)),
    ],
    ids=["truncated", "null", "empty-file", "empty-unasked", "deep-json", "deep-yaml"],
)
async def test_a_manifest_that_says_nothing_by_accident_keeps_the_last_good_set(
    fleet: Fleet, data: bytes
) -> None:
    r1 = fleet.declare(fox={"source": "v1"}, owl={"source": "v2"})
    await fleet.reconciler.reconcile()
    fleet.data = data
    await fleet.reconciler.reconcile()
    assert fleet.serving("fox") == f"fox@{digest(fleet, 'v1')[:12]}"
    assert fleet.serving("owl") == f"owl@{digest(fleet, 'v2')[:12]}"
    assert set(fleet.manager.manifest.entries) == {"fox", "owl"}
    report, health = fleet.reconciler.report(), fleet.reconciler.summary()
    assert report["serving_revision"] == r1 and not report["converged"]
    assert report["error"] and health["error"] == report["error"]  # /health shows it too


async def test_a_fresh_replica_shows_why_an_unreadable_manifest_is_not_served(
    fleet: Fleet,
) -> None:
    fleet.data = b'{"adapters": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    await fleet.reconciler.reconcile()  # no RecursionError out of the pass
    assert "nested too deeply" in (fleet.reconciler.summary()["error"] or "")
    fleet.declare(fox={"source": "v1"})
    await fleet.reconciler.reconcile()
    assert fleet.serving("fox") is not None and fleet.reconciler.converged
    assert fleet.reconciler.summary()["error"] is None


@pytest.mark.parametrize(
    "failure",
    [
        OverflowError("cannot convert float infinity to integer"),  # rank_pattern: Infinity
        FileExistsError(errno.EEXIST, "File exists", "adapter/weights"),  # file and directory
        OSError(errno.ENOSPC, "No space left on device"),
    ],
    ids=["overflow", "file-exists", "disk-full"],
)
async def test_an_entry_that_raises_anything_does_not_stop_the_others(
    fleet: Fleet, failure: Exception
) -> None:
    fleet.failing["v1"] = failure
    fleet.declare(ant={"source": "v1"}, bee={"source": "v2"}, cat={"source": "v3"})
    await fleet.reconciler.reconcile()
    assert fleet.serving("ant") is None
    assert fleet.serving("bee") == f"bee@{digest(fleet, 'v2')[:12]}"
    assert fleet.serving("cat") == f"cat@{digest(fleet, 'v3')[:12]}"
    # The pass went through the manifest: a fresh replica is ready, and says what is wrong.
    assert fleet.reconciler.applied_once and not fleet.reconciler.converged
    assert type(failure).__name__ in fleet.reconciler.report()["adapter_errors"]["ant"]
    del fleet.failing["v1"]
    await fleet.reconciler.reconcile()
    if isinstance(failure, OSError):  # may pass (disk freed): tried again on the next pass
        assert fleet.serving("ant") is not None and fleet.reconciler.converged
    else:  # the same input fails the same way: not tried again until its entry changes
        assert fleet.serving("ant") is None
        fleet.declare(
            ant={"source": "v1", "revision": "fixed"}, bee={"source": "v2"}, cat={"source": "v3"}
        )
        await fleet.reconciler.reconcile()
        assert fleet.serving("ant") is not None and fleet.reconciler.converged


async def test_a_pass_removes_no_more_than_the_cap(fleet: Fleet) -> None:
    fleet.reconciler.max_removals = 2
    names = ["ant", "bee", "cat", "dog"]
    fleet.declare(**{name: {"source": "v1"} for name in names})
    await fleet.reconciler.reconcile()
    fleet.declare(ant={"source": "v1"})  # three removals at once: over the cap
    await fleet.reconciler.reconcile()
    assert all(fleet.serving(name) is not None for name in names)
    report = fleet.reconciler.report()
    assert "would remove 3 adapters" in report["error"] and "fleet_max_removals" in report["error"]
    assert not report["converged"] and fleet.reconciler.summary()["error"] == report["error"]

    r2 = fleet.declare(ant={"source": "v1"}, bee={"source": "v1"})  # two: within the cap
    await fleet.reconciler.reconcile()
    assert [n for n in names if fleet.serving(n)] == ["ant", "bee"]
    assert fleet.reconciler.serving_revision == r2 and fleet.reconciler.converged
