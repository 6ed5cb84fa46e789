"""`gateway cache list|remove|prune` on a real cache dir of real files: each item sized, what
uses it named, and only what nothing uses removed: never a version an adapter manifest names
(live or rollback), a model its adapters were recorded for, what a running gateway says it
serves, what a process names, or anything while a gateway on the cache dir cannot be asked."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from loragate.adapters.manifest import Manifest, ManifestEntry, manifest_key
from loragate.adapters.preset import Preset
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import AdapterStore
from loragate.cli import app
from loragate.supervisor.process import GatewayLock
from tests.gateway_process import free_port

runner = CliRunner()
KIB = 1024
NOBODY = "http://127.0.0.1:9"  # no gateway is asked unless one holds the cache dir


@dataclass
class Cache:
    """A cache dir as gateways leave it (``cache_dir``), with its Hugging Face cache (``hub``)
    and, by name, the paths of what it holds."""

    root: Path
    hub: Path
    paths: dict[str, Path]
    versions: dict[str, str]  # name -> sha256

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    def args(self, *more: str) -> list[str]:
        """A command line on this cache dir (no gateway asked unless ``more`` has a --url)."""
        return [
            *more,
            "--cache-dir",
            str(self.cache_dir),
            *(() if "--url" in more else ("--url", NOBODY)),
        ]


def _adapter(where: Path, weights: int, tag: str) -> Path:
    where.mkdir(parents=True)
    (where / "adapter_config.json").write_text(json.dumps({"r": 8, "tag": tag}))
    (where / "adapter_model.safetensors").write_bytes(os.urandom(weights))
    return where


def _write(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    return path


def _repo(root: Path, repo: str, files: dict[str, int]) -> Path:
    """A Hugging Face cache repo: blobs, and a snapshot of links to them."""
    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for number, (name, size) in enumerate(files.items()):
        blob = _write(folder / "blobs" / f"blob{number}", size)
        (snapshot / name).symlink_to(blob)
    return folder


def _conversion(gguf_root: Path, digest_char: str, source: str, size: int) -> Path:
    out = gguf_root / f"{digest_char * 64}-bfloat16"
    _write(out / "model.safetensors", size)
    (out / "config.json").write_text("{}")
    (out / "gguf-source.json").write_text(json.dumps({"source": source}))
    return out


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cache:
    """Adapter versions (``pirate`` live and its rollback, ``signed`` live, ``old`` and a
    preset of ``signed``'s weights named by nothing), two GGUF conversions (one the base of
    those adapters), an old download, the logs, leftovers, a demo, and a base model in the
    Hugging Face cache."""
    root, cache_dir = tmp_path, tmp_path / "cache"
    hub = root / "hub"
    hub.mkdir()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    monkeypatch.delenv("LORAGATE_STATE_DIR", raising=False)
    store = AdapterStore(cache_dir / "adapters")
    stored = {
        name: store.put_dir(_adapter(root / "src" / name, size, name), {"source": f"/srv/{name}"})
        for name, size in (("pirate-v1", 10 * KIB), ("pirate-v2", 20 * KIB),
                           ("signed", 30 * KIB), ("old", 40 * KIB))
    }  # fmt: skip
    preset = Preset.from_dict({"system_prompt": "Be brief."})
    stored["signed-brief"] = store.put_dir(root / "src" / "signed", {"source": "/srv/s"}, preset)
    gguf = cache_dir / "models" / "gguf"
    served = _conversion(gguf, "a", "/models/served.Q4_K_M.gguf", 50 * KIB)
    unused = _conversion(gguf, "b", "/models/unused.Q8_0.gguf", 60 * KIB)
    manifest = Manifest(cache_dir / "adapters" / "manifests" / f"{manifest_key(served)}.json")
    manifest.entries = {
        "pirate": ManifestEntry(
            "pirate",
            stored["pirate-v2"].digest,
            Provenance("/srv/pirate-v2"),
            previous=stored["pirate-v1"].digest,
        ),
        "signed": ManifestEntry("signed", stored["signed"].digest, Provenance("/srv/signed")),
    }
    manifest.save()
    paths = {
        "served conversion": served,
        "unused conversion": unused,
        "old download": _repo(cache_dir / "models", "acme/old-base", {"config.json": 2 * KIB}),
        "logs": _write(cache_dir / "logs" / "engine.log", 3 * KIB).parent,
        "work dir": _write(cache_dir / "adapters" / "tmp" / "work-1" / "partial", 4 * KIB).parent,
        "cut conversion": _write(gguf / f".{'c' * 16}-bfloat16-x1y2" / "part", 5 * KIB).parent,
        "demo": _write(cache_dir / "demo" / "base" / "model.safetensors", 6 * KIB).parents[1],
        "hub model": _repo(hub, "acme/base", {"config.json": 7 * KIB, "model.bin": 8 * KIB}),
    }
    (paths["demo"] / "RECIPE").write_text("r1")
    paths |= {name: version.path for name, version in stored.items()}
    versions = {name: version.digest for name, version in stored.items()}
    return Cache(root, hub, paths, versions)


def listing(cache: Cache, *more: str) -> dict[str, Any]:
    done = runner.invoke(app, cache.args("cache", "list", "--json", *more))
    assert done.exit_code == 0, done.output
    return dict(json.loads(done.stdout))


def by_path(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["path"]: item for item in report["items"]}


def present(cache: Cache) -> set[str]:
    return {name for name, path in cache.paths.items() if path.exists()}


def test_list_sizes_each_item_and_says_what_uses_it(cache: Cache) -> None:
    items = by_path(listing(cache))
    item = {name: items[str(path)] for name, path in cache.paths.items()}
    assert {name: i["kind"] for name, i in item.items()} == {
        "pirate-v1": "adapter_version", "pirate-v2": "adapter_version",
        "signed": "adapter_version", "old": "adapter_version", "signed-brief": "adapter_version",
        "served conversion": "gguf_conversion", "unused conversion": "gguf_conversion",
        "old download": "base_model", "logs": "logs", "work dir": "leftover",
        "cut conversion": "leftover", "demo": "demo", "hub model": "base_model",
    }  # fmt: skip
    assert item["pirate-v2"]["used_by"] == ["pirate (live)"]
    assert item["pirate-v1"]["used_by"] == ["pirate (rollback)"]
    assert item["signed"]["used_by"] == ["signed (live)"]
    assert item["served conversion"]["used_by"] == ["base of pirate, signed"]
    unused = {"old", "signed-brief", "unused conversion", "old download", "work dir",
              "cut conversion", "demo"}  # fmt: skip
    assert {name for name, i in item.items() if i["prunable"]} == unused
    assert not item["logs"]["prunable"] and not item["hub model"]["prunable"]
    assert item["hub model"]["shared"] and item["hub model"]["name"] == "acme/base"
    # Sizes are the files' lengths; a version's weights and config, with its metadata.
    weights_and_meta = item["old"]["size_bytes"] - 40 * KIB
    assert 0 < weights_and_meta < 2 * KIB
    assert item["unused conversion"]["size_bytes"] == 60 * KIB + len("{}") + len(
        json.dumps({"source": "/models/unused.Q8_0.gguf"})
    )
    assert item["hub model"]["size_bytes"] == 15 * KIB  # the blobs, not the links to them
    assert item["logs"]["size_bytes"] == 3 * KIB
    assert item["old"]["origin"] == "/srv/old"


def test_hard_linked_weights_count_once_in_the_totals(cache: Cache) -> None:
    report = listing(cache)
    items = by_path(report)
    brief = items[str(cache.paths["signed-brief"])]
    assert brief["size_bytes"] > 30 * KIB  # its own view of the weights it shares
    every_size = sum(item["size_bytes"] for item in report["items"])
    assert report["total_bytes"] == every_size - 30 * KIB - len('{"r": 8, "tag": "signed"}')
    # Pruning ``signed-brief`` frees its metadata only: ``signed`` keeps the weights.
    unused_whole = sum(
        item["size_bytes"] for item in report["items"] if item["prunable"] and item is not brief
    )
    assert unused_whole < report["prunable_bytes"] < unused_whole + 2 * KIB


def test_prune_removes_exactly_what_nothing_uses(cache: Cache) -> None:
    expected_freed = listing(cache)["prunable_bytes"]
    done = runner.invoke(app, cache.args("cache", "prune"))
    assert done.exit_code == 0, done.output
    assert present(cache) == {"pirate-v1", "pirate-v2", "signed", "served conversion", "logs",
                              "hub model"}  # fmt: skip
    assert (cache.cache_dir / "adapters" / "tmp").is_dir()  # the store's work dir, emptied
    store = AdapterStore(cache.cache_dir / "adapters")
    for name in ("pirate-v1", "pirate-v2", "signed"):  # whole, hard links and all
        version = store.get(cache.versions[name])
        assert version is not None
        store.verify(version)
    assert "removed adapter version " + cache.versions["old"][:12] in done.stdout
    from loragate.cli_cache import human_size

    assert f"freed {human_size(expected_freed)}" in done.stdout
    again = runner.invoke(app, cache.args("cache", "prune"))
    assert again.exit_code == 0 and "nothing to prune" in again.stdout


def test_prune_dry_run_says_what_it_would_remove_and_removes_nothing(cache: Cache) -> None:
    before = present(cache)
    done = runner.invoke(app, cache.args("cache", "prune", "--dry-run"))
    assert done.exit_code == 0, done.output
    assert present(cache) == before
    assert f"would remove adapter version {cache.versions['old'][:12]}" in done.stdout
    assert "would remove GGUF conversion bbbbbbbbbbbb-bfloat16" in done.stdout
    assert "pirate" not in done.stdout and "hub" not in done.stdout


def test_remove_refuses_what_a_manifest_names_and_takes_the_rest_by_name(cache: Cache) -> None:
    rollback = cache.versions["pirate-v1"]
    refused = runner.invoke(app, cache.args("cache", "remove", cache.versions["old"][:8],
                                            rollback[:8]))  # fmt: skip
    assert refused.exit_code == 1
    assert f"{rollback[:12]} is in use by pirate (rollback)" in refused.output
    assert "nothing was removed" in refused.output
    assert {"old", "pirate-v1"} <= present(cache)
    done = runner.invoke(app, cache.args("cache", "remove", cache.versions["old"][:8],
                                         "acme/base", "logs"))  # fmt: skip
    assert done.exit_code == 0, done.output
    assert not {"old", "hub model", "logs"} & present(cache)
    unknown = runner.invoke(app, cache.args("cache", "remove", "nothing-of-the-kind"))
    assert unknown.exit_code == 1 and "holds no item 'nothing-of-the-kind'" in unknown.output


def test_a_process_naming_an_item_keeps_it(cache: Cache) -> None:
    unused = cache.paths["unused conversion"]
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", f"--model={unused}"]
    )
    try:
        (used,) = by_path(listing(cache))[str(unused)]["used_by"]
        assert used.startswith(f"process {sleeper.pid} (")
        done = runner.invoke(app, cache.args("cache", "prune"))
        assert done.exit_code == 0, done.output
        assert unused.exists() and not cache.paths["old"].exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_conversion_being_written_is_kept(cache: Cache) -> None:
    unused = cache.paths["unused conversion"]
    with (unused.parent / f".{unused.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert by_path(listing(cache))[str(unused)]["used_by"] == ["being written now"]
        assert runner.invoke(app, cache.args("cache", "prune")).exit_code == 0
        assert unused.exists()


def test_an_unreadable_manifest_stops_every_removal(cache: Cache) -> None:
    (cache.cache_dir / "adapters" / "manifests" / "0123456789abcdef.json").write_text("{trunc")
    before = present(cache)
    done = runner.invoke(app, cache.args("cache", "prune"))
    assert done.exit_code == 1
    assert "cannot be read" in done.output and "nothing was removed" in done.output
    assert present(cache) == before


def test_a_store_whose_manifest_is_elsewhere_needs_the_state_dir(cache: Cache) -> None:
    manifests = cache.cache_dir / "adapters" / "manifests"
    state = cache.root / "state"
    (state / "adapters").mkdir(parents=True)
    manifests.rename(state / "adapters" / "manifests")
    before = present(cache)
    done = runner.invoke(app, cache.args("cache", "prune"))
    assert done.exit_code == 1 and "pass the same --state-dir" in done.output
    assert present(cache) == before
    done = runner.invoke(app, cache.args("cache", "prune", "--state-dir", str(state)))
    assert done.exit_code == 0, done.output
    assert {"pirate-v1", "pirate-v2", "signed"} <= present(cache)
    assert "old" not in present(cache)


def test_a_damaged_version_no_manifest_names_is_pruned(cache: Cache) -> None:
    meta = cache.paths["old"] / ".loragate.json"
    meta.chmod(0o600)
    meta.write_text("{garbled")
    item = by_path(listing(cache))[str(cache.paths["old"])]
    assert item["damaged"] and item["prunable"]
    assert runner.invoke(app, cache.args("cache", "prune")).exit_code == 0
    assert not cache.paths["old"].exists()


def test_a_catalog_models_store_is_read_with_that_models_manifest(
    cache: Cache, tmp_path: Path
) -> None:
    """A catalog's model keeps its store under ``models/ID`` and its manifest under the state
    dir's ``models/ID``: its versions are named ``ID/...`` and kept by its own manifest."""
    scope = cache.cache_dir / "models" / "qwen"
    store = AdapterStore(scope / "adapters")
    live = store.put_dir(_adapter(tmp_path / "q-live", 11 * KIB, "q1"), {"source": "/srv/q1"})
    spare = store.put_dir(_adapter(tmp_path / "q-spare", 12 * KIB, "q2"), {"source": "/srv/q2"})
    state = tmp_path / "state"
    manifest = Manifest(state / "models" / "qwen" / "adapters" / "manifests" / f"{'0' * 16}.json")
    manifest.entries = {"helper": ManifestEntry("helper", live.digest, Provenance("/srv/q1"))}
    manifest.save()
    items = by_path(listing(cache, "--state-dir", str(state)))
    assert items[str(live.path)]["name"] == f"qwen/{live.short}"
    assert items[str(live.path)]["used_by"] == ["qwen/helper (live)"]
    assert items[str(spare.path)]["prunable"]
    done = runner.invoke(app, cache.args("cache", "prune", "--state-dir", str(state)))
    assert done.exit_code == 0, done.output
    assert live.path.exists() and not spare.path.exists()


# ----- with a gateway on the cache dir ------------------------------------------------------


@contextlib.contextmanager
def admin_api(answers: dict[str, Any]) -> Iterator[str]:
    """This process as a gateway's admin API: the URL of a server answering ``answers``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != "Bearer sesame":
                self.send_response(401)
                self.end_headers()
                return
            body = json.dumps(answers[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def gateway_lock(cache: Cache) -> Iterator[GatewayLock]:
    """The cache dir's gateway lock, held with this process's pid, as a running gateway's."""
    lock = GatewayLock(cache.cache_dir)
    lock.acquire()
    yield lock
    lock.release()


def _answers(cache: Cache, *, adding: bool = False) -> dict[str, Any]:
    old = cache.versions["old"]
    return {
        "/admin/adapters": {
            "base_model": "served",
            "data": [{"name": "extra", "version": old, "previous_version": None}],
            "progress": [{"name": "late", "finished": not adding}],
        },
        "/admin/models": {
            "models": [
                {"id": "served", "model": "/models/unused.Q8_0.gguf", "residency": "resident"}
            ]
        },
    }


def test_a_running_gateway_is_asked_and_what_it_serves_is_kept(
    cache: Cache, gateway_lock: GatewayLock
) -> None:
    with admin_api(_answers(cache)) as url:
        report = listing(cache, "--url", url, "--admin-key", "sesame")
        items = by_path(report)
        assert items[str(cache.paths["old"])]["used_by"] == ["extra (live)"]
        conversion = items[str(cache.paths["unused conversion"])]
        assert conversion["used_by"] == [f"gateway {os.getpid()} (served)"]
        assert items[str(cache.paths["logs"])]["used_by"] == [f"gateway {os.getpid()}"]
        assert items[str(cache.paths["work dir"])]["used_by"] == [f"gateway {os.getpid()}"]
        assert report["gateways"] == [
            {"pid": os.getpid(), "cache_dirs": [str(cache.cache_dir)], "asked": True,
             "reason": None, "busy": []}
        ]  # fmt: skip
        done = runner.invoke(
            app, cache.args("cache", "prune", "--url", url, "--admin-key", "sesame")
        )
    assert done.exit_code == 0, done.output
    assert present(cache) == {"pirate-v1", "pirate-v2", "signed", "old", "served conversion",
                              "unused conversion", "logs", "work dir", "cut conversion", "hub model"}  # fmt: skip


def test_nothing_is_removed_while_the_gateway_adds_an_adapter(
    cache: Cache, gateway_lock: GatewayLock
) -> None:
    before = present(cache)
    with admin_api(_answers(cache, adding=True)) as url:
        done = runner.invoke(
            app, cache.args("cache", "prune", "--url", url, "--admin-key", "sesame")
        )
    assert done.exit_code == 1
    assert "an add of late is under way; try again once it is done" in done.output
    assert present(cache) == before


def test_a_gateway_that_cannot_be_asked_stops_every_removal(
    cache: Cache, gateway_lock: GatewayLock
) -> None:
    before = present(cache)
    done = runner.invoke(app, cache.args("cache", "prune"))  # --url: not this gateway
    assert done.exit_code == 1
    assert f"gateway {os.getpid()} runs on {cache.cache_dir}" in done.output
    assert f"it is not the gateway at {NOBODY}: pass its address with --url" in done.output
    removed = runner.invoke(app, cache.args("cache", "remove", "demo"))
    assert removed.exit_code == 1
    with admin_api(_answers(cache)) as url:  # the right address, the wrong key
        done = runner.invoke(app, cache.args("cache", "prune", "--url", url))
    assert done.exit_code == 1 and "answered 401" in done.output
    assert present(cache) == before
    table = runner.invoke(app, cache.args("cache", "list"), env={"COLUMNS": "80"})
    assert table.exit_code == 0
    assert "could not be asked what it serves" in " ".join(table.stdout.split())


def test_the_table_fits_80_columns_with_a_total(cache: Cache) -> None:
    from loragate.cli_cache import human_size

    done = runner.invoke(app, cache.args("cache", "list"), env={"COLUMNS": "80"})
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["KIND", "NAME", "SIZE", "USED", "BY"]
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    rollback = next(line for line in lines if cache.versions["pirate-v1"][:12] in line)
    assert rollback.split()[:2] == ["adapter", "version"] and "pirate (rollback)" in rollback
    assert any(line.strip() == "from /srv/old" for line in lines)  # what an unused one was
    report = listing(cache)
    total = f"{len(report['items'])} items, {human_size(report['total_bytes'])}; 7 unused"
    assert lines[-1].startswith(total) and "`gateway cache prune` removes them" in lines[-1]


def test_cache_alone_lists(cache: Cache) -> None:
    done = runner.invoke(app, ["cache"], env={"LORAGATE_CACHE_DIR": str(cache.cache_dir)})
    assert done.exit_code == 0, done.output
    assert done.stdout.split()[:4] == ["KIND", "NAME", "SIZE", "USED"]
    assert cache.versions["old"][:12] in done.stdout


def test_human_sizes() -> None:
    from loragate.cli_cache import human_size

    assert [human_size(n) for n in (0, 1023, 1024, 5 * 1024**2 + 1, 3 * 1024**3, 2 * 1024**4)] == [
        "0 B", "1023 B", "1.0 KiB", "5.0 MiB", "3.0 GiB", "2.0 TiB"
    ]  # fmt: skip
