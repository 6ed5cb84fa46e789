"""vLLM's sleep mode made safe, and a catalog's room on GPUs: the hang probe spares an asleep
engine (and one that exits asleep is stopped, not restarted awake), an adapter change for an
asleep model waits for its wake and then serves, an asleep model counts what it still holds,
an adapter answers the same before the sleep and after the wake, and on GPUs each model gets
its part of the GPU plan, each GPU's room counts apart and a boot vLLM would refuse is a 503.

Real supervisors and catalogs over the stand-in engine (``tools.bench.fake_engine``), which
keeps vLLM's rules while asleep (its docstring cites them): /health answers, a generation
waits for the wake, and an adapter load fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from loragate.demo.layout import demo_adapter_dir, demo_base_dir
from loragate.engine_states import EngineState
from loragate.gateway.app import create_app
from loragate.plan.gpu.placement import GpuPlan, Placement
from loragate.plan.gpu.vllm_rules import FALLBACK_RULES
from loragate.serving.catalog import Catalog
from loragate.serving.errors import NotServing
from loragate.serving.sleep import ASLEEP_GPU_BYTES, put_to_sleep, wake
from loragate.settings.supervision import SupervisionFields
from loragate.supervisor.client import EngineClient
from loragate.supervisor.command import EngineSpec
from loragate.supervisor.engine import EngineSupervisor
from tests.backend_double import serving
from tests.unit.test_catalog import ADMIN, STAND_IN, catalog, catalog_settings, chat, residency
from tests.unit.test_catalog import wait_for as wait_until
from tests.unit.test_preflight import fake_nvidia_smi

GIB = 2**30
# Deep probes every 0.2 s, and a hang is two failures of 0.5 s: an engine whose generations
# wait (as an asleep vLLM's do) would be killed within about 1.5 s.
HANG_PROBE = SupervisionFields(
    startup_timeout=30,
    probe_interval=0.2,
    probe_timeout=0.5,
    probe_failures=2,
    deep_probe=True,
    restart_backoff=0.05,
    restart_backoff_max=0.2,
    stop_timeout=5,
)


async def until(predicate: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest_asyncio.fixture(loop_scope="function")
async def sleepy(tmp_path: Path) -> AsyncIterator[tuple[EngineSupervisor, EngineClient]]:
    """A supervised stand-in engine with vLLM's sleep mode on, deep-probed."""

    def spec(socket_path: Path, api_key: str) -> EngineSpec:
        return EngineSpec(
            model="fake", served_name="fake", socket_path=socket_path, api_key=api_key,
            max_loras=1, max_lora_rank=8, command=STAND_IN,
            extra_args=["--enable-sleep-mode"], env={"VLLM_SERVER_DEV_MODE": "1"},
        )  # fmt: skip

    supervisor = EngineSupervisor(spec, cache_dir=tmp_path, timings=HANG_PROBE)
    await supervisor.start()
    await supervisor.wait_until_serving(30)
    yield supervisor, EngineClient(supervisor)
    await supervisor.stop()


async def test_the_stand_in_holds_a_generation_while_asleep_so_a_deep_probe_would_kill_it(
    sleepy: tuple[EngineSupervisor, EngineClient],
) -> None:
    """What the probe must be spared: /sleep sent behind the supervisor's back, the deep
    probe's one-token completion waits for a wake that never comes, and the engine is killed
    and restarted (awake, outside any catalog's room check)."""
    supervisor, engine = sleepy
    await engine.sleep()
    await until(lambda: supervisor.restarts >= 1, timeout=15)
    log = supervisor.log_path.read_text()
    assert "asleep: holding a generation for fake until the wake" in log


async def test_the_hang_probe_never_kills_an_asleep_engine(
    sleepy: tuple[EngineSupervisor, EngineClient],
) -> None:
    supervisor, engine = sleepy
    pid = supervisor.engine_pid
    await put_to_sleep(supervisor, engine)
    await asyncio.sleep(2.5)  # a dozen probes: a hang would have been killed twice over
    assert supervisor.asleep and supervisor.state == EngineState.READY
    assert supervisor.restarts == 0 and supervisor.engine_pid == pid
    assert "holding a generation" not in supervisor.log_path.read_text()  # /health alone
    await wake(supervisor, engine)
    await asyncio.sleep(1)  # deep probes again, answered
    assert not supervisor.asleep and supervisor.state == EngineState.READY
    assert supervisor.restarts == 0 and supervisor.engine_pid == pid


async def test_an_asleep_engine_that_exits_is_stopped_not_restarted_awake(
    sleepy: tuple[EngineSupervisor, EngineClient],
) -> None:
    supervisor, engine = sleepy
    await put_to_sleep(supervisor, engine)
    pid = supervisor.engine_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await until(lambda: supervisor.state == EngineState.STOPPED, timeout=15)
    assert supervisor.restarts == 0 and not supervisor.asleep
    assert "while asleep" in supervisor.reason and "the next request boots it" in supervisor.reason


async def test_a_sleep_waits_for_an_adapter_call_under_way_and_none_starts_until_the_wake(
    tmp_path: Path,
) -> None:
    supervisor = EngineSupervisor(lambda *_: None, cache_dir=tmp_path)  # type: ignore[arg-type]
    order: list[str] = []

    async def load() -> None:
        async with supervisor.kept_awake() as awake:
            assert awake
            order.append("load starts")
            await asyncio.sleep(0.2)
            order.append("load ends")

    loading = asyncio.create_task(load())
    await asyncio.sleep(0.05)
    await supervisor.falling_asleep()
    order.append("asleep")
    await loading
    assert order == ["load starts", "load ends", "asleep"]
    async with supervisor.kept_awake() as awake:
        assert not awake  # nothing is loaded into an asleep engine
    waiting = asyncio.create_task(supervisor.until_awake())
    await asyncio.sleep(0.1)
    assert not waiting.done()
    supervisor.woke()
    await asyncio.wait_for(waiting, 1)


def engine_log(tmp_path: Path, model_id: str) -> str:
    path = tmp_path / "cache" / "models" / model_id / "logs" / "engine.log"
    return path.read_text() if path.exists() else ""


def test_an_adapter_change_while_asleep_waits_for_the_wake_then_serves(
    tmp_path: Path, demo_dir: Path
) -> None:
    """The adapters manifest adds ``owl`` to alpha while alpha sleeps: nothing is loaded into
    the asleep engine (the stand-in would refuse, as vLLM would crash), alpha is not woken for
    it, and once a request wakes alpha the change goes through and ``owl`` answers."""
    manifest = tmp_path / "fleet.json"

    def write(alpha: dict[str, Any]) -> None:
        beta = {"fox": {"source": str(demo_adapter_dir(demo_dir, "fox"))}}
        parts = {"alpha": {"adapters": alpha}, "beta": {"adapters": beta}}
        manifest.write_text(json.dumps({"models": parts}))

    pong = {"pong": {"source": str(demo_adapter_dir(demo_dir, "pong"))}}
    write(pong)
    base = str(demo_base_dir(demo_dir))
    models = {"alpha": {"model": base, "sleep": True}, "beta": {"model": base, "sleep": True}}
    settings = catalog_settings(
        tmp_path, demo_dir, models=models, max_loaded_models=1,
        adapters_manifest=str(manifest), follow_interval=0.2,
    )  # fmt: skip
    with serving(create_app(settings)) as url:
        wait_until(lambda: {"pong", "fox"} <= set(residency(url)))
        assert chat(url, "pong").status_code == 200
        assert chat(url, "fox").status_code == 200
        assert residency(url)["alpha"] == "asleep"
        write({**pong, "owl": {"source": str(demo_adapter_dir(demo_dir, "owl"))}})
        time.sleep(2)  # ten passes over the manifest
        assert residency(url)["alpha"] == "asleep"  # not woken for it
        assert "owl" not in residency(url)  # its change waits for the wake
        assert "refused a LoRA load" not in engine_log(tmp_path, "alpha")
        assert chat(url, "alpha").status_code == 200  # a request wakes alpha
        wait_until(lambda: "owl" in residency(url))
        answer = chat(url, "owl")
        assert answer.status_code == 200 and answer.json()["model"] == "owl"
        report = httpx.get(f"{url}/admin/adapters", headers=ADMIN, timeout=10).json()
        assert report["adapters_manifest"]["alpha"]["adapter_errors"] == {}
        assert "refused a LoRA load" not in engine_log(tmp_path, "alpha")
        assert catalog(url)["alpha"]["wakes"] == 1


def test_the_admin_api_wakes_an_asleep_model_before_changing_its_adapter(
    tmp_path: Path, demo_dir: Path
) -> None:
    """A PUT answers once the new version serves: for an asleep model it wakes the model
    first (as it boots a cold one), and then loads the version into the awake engine."""
    base = str(demo_base_dir(demo_dir))
    pong = f"pong={demo_adapter_dir(demo_dir, 'pong')}"
    models = {
        "alpha": {"model": base, "sleep": True, "lora": [pong]},
        "beta": {"model": base, "sleep": True},
    }
    settings = catalog_settings(
        tmp_path, demo_dir, models=models, max_loaded_models=1, adapter_source_roots=[demo_dir]
    )
    with serving(create_app(settings)) as url:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        assert chat(url, "pong").status_code == 200
        assert chat(url, "beta").status_code == 200
        assert residency(url)["alpha"] == "asleep"
        swapped = httpx.put(
            f"{url}/admin/adapters/pong",
            headers=ADMIN,
            json={"source": str(demo_adapter_dir(demo_dir, "owl"))},
            timeout=60,
        )
        assert swapped.status_code == 200, swapped.text
        assert swapped.json()["state"] == "ready"
        assert residency(url) == {"alpha": "resident", "pong": "resident", "beta": "asleep"}
        assert chat(url, "pong").status_code == 200
        assert catalog(url)["alpha"]["wakes"] == 1
        assert "refused a LoRA load" not in engine_log(tmp_path, "alpha")


def test_an_adapters_greedy_answer_is_the_same_before_the_sleep_and_after_the_wake(
    tmp_path: Path, demo_dir: Path
) -> None:
    base = str(demo_base_dir(demo_dir))
    pong = f"pong={demo_adapter_dir(demo_dir, 'pong')}"
    models = {
        "alpha": {"model": base, "sleep": True, "lora": [pong]},
        "beta": {"model": base, "sleep": True},
    }
    settings = catalog_settings(tmp_path, demo_dir, models=models, max_loaded_models=1)
    greedy = {"temperature": 0, "max_tokens": 8}
    with serving(create_app(settings)) as url:
        wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200)
        before = chat(url, "pong", **greedy)
        assert before.status_code == 200, before.text
        assert chat(url, "beta").status_code == 200
        assert residency(url)["alpha"] == "asleep"
        after = chat(url, "pong", **greedy)
        assert after.status_code == 200, after.text
        assert catalog(url)["alpha"]["wakes"] == 1
        said = [r.json()["choices"][0]["message"]["content"] for r in (before, after)]
        assert said[0] == said[1] and said[0]


async def test_an_asleep_model_counts_what_it_still_holds_in_the_memory_budget(
    tmp_path: Path, demo_dir: Path
) -> None:
    """Asleep, an engine keeps its CUDA context and graph pools (``ASLEEP_GPU_BYTES``, one
    GPU's worth when the plan cannot say where): with room for one model awake and that, the
    model giving way sleeps; with a byte less it is stopped instead, and ``/admin/models``
    says what an asleep one holds."""
    base = str(demo_base_dir(demo_dir))
    models = {"alpha": {"model": base, "sleep": True}, "beta": {"model": base, "sleep": True}}
    catalog_ = Catalog(catalog_settings(tmp_path, demo_dir, models=models))
    alpha, beta = catalog_.entries["alpha"], catalog_.entries["beta"]
    await catalog_.start()
    try:
        await until(lambda: alpha.prepared and beta.prepared)
        awake = alpha.memory_bytes
        assert awake is not None and awake == beta.memory_bytes
        catalog_.room.memory_budget = awake + ASLEEP_GPU_BYTES
        await catalog_.load_by_hand("alpha")
        await catalog_.load_by_hand("beta")
        await until(lambda: beta.residency == "resident")  # booted
        assert alpha.residency == "asleep"
        report = alpha.report()
        assert report["asleep_gpu_bytes"] == ASLEEP_GPU_BYTES
        assert beta.report()["asleep_gpu_bytes"] is None
        catalog_.room.memory_budget = awake + ASLEEP_GPU_BYTES - 1
        await catalog_.load_by_hand("alpha")  # a wake; beta asleep would leave too little
        assert (alpha.residency, beta.residency) == ("resident", "cold")
        assert alpha.wakes == 1 and beta.last_unload_reason == "making room for alpha"
    finally:
        await catalog_.stop()


async def test_on_gpus_each_model_gets_its_part_of_the_plan_and_each_gpus_room_counts(
    tmp_path: Path, demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two 24 GiB GPUs with 20 GiB free each: no summed budget, each GPU's own room instead;
    each model's engine gets its placement from the catalog's GPU plan; two models fit on GPU
    0, a third there unloads one of them and never the model on GPU 1; and a model whose share
    vLLM would refuse now (more than is free, with its CUDA context) is a 503 before any boot.
    The stand-in has no GPU plan of its own (an ``engine_command``), so what each engine
    holds is given here as a GPU plan would give it."""
    fake_nvidia_smi(
        tmp_path / "bin",
        monkeypatch,
        "echo '0, GPU-aaaa-1111, NVIDIA L4, 24576, 20480'\n"
        "echo '1, GPU-bbbb-2222, NVIDIA L4, 24576, 20480'\n",
    )
    shares = {"gamma": (1, 0.3), "alpha": (0, 0.3), "beta": (0, 0.3), "delta": (0, 0.3)}
    placements = {
        model_id: Placement(model_id, fits=True, devices=[gpu], share=share, weights_bytes=GIB)
        for model_id, (gpu, share) in {**shares, "big": (0, 0.9)}.items()
    }
    planned: list[list[str]] = []

    def plan(settings: Any, gpus: Any) -> GpuPlan:
        planned.append([gpu.index for gpu in gpus])
        return GpuPlan(list(gpus), list(placements.values()), [], FALLBACK_RULES)

    monkeypatch.setattr("loragate.serving.room.plan_settings", plan)
    base = str(demo_base_dir(demo_dir))
    models = {model_id: {"model": base} for model_id in placements}
    catalog_ = Catalog(catalog_settings(tmp_path, demo_dir, models=models))
    entries = catalog_.entries
    await catalog_.start()
    try:
        assert planned == [["0", "1"]]
        for model_id, entry in entries.items():
            assert entry.gpu_placement is placements[model_id]
        report = catalog_.catalog_report()
        assert report["memory_budget"] is None  # never the GPUs' sum
        assert report["gpu_room"] == {"0": 20 * GIB, "1": 20 * GIB} and report["host_room"] > 0
        await until(lambda: all(entry.prepared for entry in entries.values()))
        for model_id, (gpu, _) in shares.items():
            entries[model_id].gpu_held = {gpu: 8 * GIB}
        for model_id in ("gamma", "alpha", "beta"):
            await catalog_.load_by_hand(model_id)
            await until(lambda m=model_id: entries[m].residency == "resident")  # type: ignore[misc]
        await catalog_.load_by_hand("delta")  # GPU 0 holds 16 of 20 GiB: one there gives way
        await until(lambda: entries["delta"].residency == "resident")
        assert {m: entries[m].residency for m in shares} == {
            "gamma": "resident", "alpha": "cold", "beta": "resident", "delta": "resident",
        }  # fmt: skip
        assert catalog_.last_swap is not None and catalog_.last_swap["unloaded"] == ["alpha"]
        with pytest.raises(NotServing) as refused:
            await catalog_.load_by_hand("big")
        assert refused.value.code == "model_capacity"
        assert "vLLM would refuse to start" in refused.value.message
        assert entries["big"].residency == "cold"
    finally:
        await catalog_.stop()
