"""Every `gateway` command a user types, through the real console script, against the shared
real engine: adapters add/list/rollback/remove, status (table and JSON), models list and load,
chat, systemd-unit and convert."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from loragate.adapters.intake.convert import needs_conversion
from tests import adapter_fixtures as fx
from tests.conftest import phrase_of
from tests.gateway_process import ADMIN_KEY, GatewayProcess
from tools.harness import GATEWAY

pytestmark = pytest.mark.engine


def gateway_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(GATEWAY), *args], capture_output=True, text=True, timeout=600, check=False
    )
    if check:
        assert done.returncode == 0, f"gateway {' '.join(args)}: {done.stdout}{done.stderr}"
    return done


def admin_cli(gateway: GatewayProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return gateway_cli(*args, "--url", gateway.url, "--admin-key", ADMIN_KEY)


def answer(gateway: GatewayProcess, model: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=120,
    )


def phrase(gateway: GatewayProcess, model: str) -> str | None:
    response = answer(gateway, model)
    assert response.status_code == 200, response.text
    return phrase_of(response.json()["choices"][0]["message"]["content"])


def test_adapters_add_list_rollback_remove(gateway: GatewayProcess, demo_dir: Path) -> None:
    fox, owl = demo_dir / "adapters" / "fox", demo_dir / "adapters" / "owl"
    added = admin_cli(gateway, "adapters", "add", "cli-pet", str(fox))
    assert "cli-pet now serves version" in added.stdout
    assert phrase(gateway, "cli-pet") == "fox"
    admin_cli(gateway, "adapters", "add", "cli-pet", str(owl))
    assert phrase(gateway, "cli-pet") == "owl"
    listed = admin_cli(gateway, "adapters", "list").stdout
    row = next(line for line in listed.splitlines() if line.startswith("cli-pet "))
    assert str(owl) in row and " ready " in row
    rolled = admin_cli(gateway, "adapters", "rollback", "cli-pet")
    assert "cli-pet now serves version" in rolled.stdout
    assert phrase(gateway, "cli-pet") == "fox"
    assert "cli-pet removed" in admin_cli(gateway, "adapters", "remove", "cli-pet").stdout
    assert answer(gateway, "cli-pet").status_code == 404


def test_adapters_add_of_a_bad_source_fails_with_the_reason(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    done = gateway_cli(
        "adapters", "add", "cli-bad", str(tmp_path / "missing"), "--url", gateway.url,
        "--admin-key", ADMIN_KEY, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "error:" in done.stderr and "missing" in done.stderr


def test_status_shows_engine_and_adapters(gateway: GatewayProcess) -> None:
    status = json.loads(admin_cli(gateway, "status", "--json").stdout)
    assert status["engine"]["state"] == "ready" and status["engine"]["pid"]
    assert {"pong", "fox", "owl"} <= {row["name"] for row in status["adapters"]}


def test_status_table_names_the_real_engine_its_model_and_adapters(
    gateway: GatewayProcess,
) -> None:
    table = admin_cli(gateway, "status").stdout
    engine_pid = httpx.get(
        f"{gateway.url}/admin/engine", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).json()["pid"]
    engine_row = next(line for line in table.splitlines() if f" {engine_pid} " in line)
    assert " ready " in engine_row
    adapter_rows = {line.split("@")[0] for line in table.splitlines() if " ready " in line}
    assert {"pong", "fox", "owl"} <= adapter_rows, table


def test_models_list_of_the_one_model_gateway_is_its_resident_base(
    gateway: GatewayProcess,
) -> None:
    """One model is a catalog of one: its base, resident, with its adapters."""
    listed = admin_cli(gateway, "models", "list").stdout.splitlines()
    assert listed[0].split()[:3] == ["MODEL", "RESIDENCY", "STATE"] and listed[-1] == "swaps: 0"
    (row,) = listed[1:-1]
    assert row.split()[1:3] == ["resident", "ready"] and "pong" in row
    report = json.loads(admin_cli(gateway, "models", "list", "--json").stdout)
    (model,) = report["models"]
    assert model["residency"] == "resident" and model["keep"] is True
    assert {"pong", "fox", "owl"} <= set(model["adapters"])
    loaded = admin_cli(gateway, "models", "load", model["id"]).stdout  # resident: nothing boots
    assert loaded.strip() == f"{model['id']}: resident (ready)"


def test_chat_piped_answers_from_the_adapter_named(gateway: GatewayProcess) -> None:
    done = subprocess.run(
        [str(GATEWAY), "chat", "fox", "--url", gateway.url, "--admin-key", ADMIN_KEY,
         "--max-tokens", "16"],
        input="Hello\n", capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert phrase_of(done.stdout) == "fox", done.stdout


def test_systemd_unit_prints_a_notify_unit_for_this_install() -> None:
    unit = gateway_cli("systemd-unit", "--user").stdout
    assert "Type=notify" in unit
    assert f"ExecStart={GATEWAY} serve" in unit


@pytest.mark.parametrize("fmt", ["tinker", "mlx", "bin"])
def test_convert_writes_a_peft_dir_the_engine_serves(
    fmt: str, gateway: GatewayProcess, demo_dir: Path, tmp_path: Path
) -> None:
    adapter = {"tinker": "owl", "mlx": "fox", "bin": "pong"}[fmt]
    peft = demo_dir / "adapters" / adapter
    if fmt == "tinker":
        source = fx.make_tinker_archive(peft, tmp_path / "tinker.tar", tmp_path / "work")
    elif fmt == "mlx":
        source = fx.make_mlx_adapter(peft, tmp_path / "mlx")
    else:
        source = fx.make_bin_adapter(peft, tmp_path / "bin")
    out = tmp_path / "converted"
    done = gateway_cli(
        "adapters", "convert", str(source), str(out), "--base", str(demo_dir / "base")
    )
    assert f"wrote a PEFT adapter to {out}" in done.stdout
    assert not needs_conversion(out)  # plain PEFT now: safetensors, full config
    name = f"converted-{fmt}"
    response = gateway.admin("PUT", f"/admin/adapters/{name}", json={"source": str(out)})
    try:
        assert response.status_code == 200, response.text
        assert phrase(gateway, name) == adapter
    finally:
        gateway.admin("DELETE", f"/admin/adapters/{name}")


def test_convert_refuses_an_existing_output_and_changes_nothing(
    demo_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    done = gateway_cli(
        "adapters", "convert", str(demo_dir / "adapters" / "fox"), str(out),
        "--base", str(demo_dir / "base"), check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "already exists" in done.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
