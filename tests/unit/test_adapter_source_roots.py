"""A local path an admin client sends is read only under the adapter source roots
(``adapter_source_roots``), and what lies outside them is never told: every path there gets
the same answer, whether it exists, what it is, or what a link inside a root points to. Numbers
in an adapter's files that no float holds are a 400, not a 500.

Through the admin API of a gateway whose adapter manager and pipeline are the real ones (no
engine), with real files: as a client with the admin key meets it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from loragate.adapters.intake.pipeline import AdapterPipeline
from loragate.adapters.intake.sources import admit_client_source
from loragate.adapters.store import AdapterStore
from loragate.gateway.app import create_app
from tests.backend_double import ManagedBackendDouble, settings_for
from tests.unit.test_provenance import TINY_LLAMA, make_manager, tiny_adapter

ADMIN_KEY = "the-admin"
SECRET = "top-secret-value-7f3a"


@asynccontextmanager
async def admin_api(tmp_path: Path, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the admin API of a gateway with ``settings``, its manager and pipeline real."""
    store = AdapterStore(tmp_path / "store")
    backend = ManagedBackendDouble()
    backend.adapters = make_manager(  # type: ignore[assignment]
        tmp_path, store, AdapterPipeline(store, tmp_path / "base", TINY_LLAMA, 16)
    )
    app = create_app(settings_for(tmp_path / "cache", **settings), backend=backend)
    token = app.state.gateway.admin_token  # the per-start token, when no admin key is set
    key = settings.get("admin_key") or token
    transport = httpx.ASGITransport(app, raise_app_exceptions=False)  # a 500 as a client sees it
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=transport,
            base_url="http://127.0.0.1:8000",
            headers={"Authorization": f"Bearer {key}"},
        ) as client,
    ):
        yield client
    await backend.adapters.aclose()  # type: ignore[attr-defined]


async def put(client: httpx.AsyncClient, source: str | Path, name: str = "fox") -> httpx.Response:
    return await client.put(f"/admin/adapters/{name}", json={"source": str(source)})


async def load(client: httpx.AsyncClient, source: str | Path) -> httpx.Response:
    """vLLM's route, which takes the same sources."""
    return await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "fox", "lora_path": str(source)}
    )


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert isinstance(body.get("error"), dict), response.text
    return dict(body["error"])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The one adapter source root; ``tmp_path`` itself, beside it, is outside."""
    path = tmp_path / "adapters"
    path.mkdir()
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A real adapter outside the root, whose config holds a value no client may read."""
    adapter = tiny_adapter(tmp_path / "elsewhere" / "private")
    # A PEFT config but for its r: validation would quote r back in its refusal.
    config = {"peft_type": "LORA", "r": SECRET, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (tmp_path / "elsewhere" / "secret.json").write_text(json.dumps(config))
    return adapter


# ----- what lies outside the roots is never told ------------------------------------------------


async def test_every_path_outside_the_roots_gets_the_same_answer(
    tmp_path: Path, root: Path, outside: Path
) -> None:
    (root / "link-out").symlink_to(outside)  # a link inside the root to an adapter outside
    sources = [
        "/etc/passwd",  # a file
        "/root",  # a directory, no adapter
        "/nonexistent/adapter",  # nothing
        str(outside),  # a real adapter, outside
        f"{root}/../elsewhere/private",  # `..` out of the root to that adapter
        str(root / "link-out"),  # a link out of the root to it
        f"file://{outside}",
        "~/.ssh",
        "~nobody-such-user/x",
    ]
    async with admin_api(tmp_path, admin_key=ADMIN_KEY, adapter_source_roots=[root]) as client:
        answers = [await put(client, source) for source in sources]
        answers.append(await load(client, "/etc/passwd"))
        listed = (await client.get("/admin/adapters")).json()["data"]

    assert {answer.status_code for answer in answers} == {403}, [a.text for a in answers]
    errors = [error_of(answer) for answer in answers]
    assert {error["code"] for error in errors} == {"adapter_source_not_allowed"}
    messages = {error["message"] for error in errors}
    assert len(messages) == 1, messages  # one text: nothing about which path is what
    (message,) = messages
    assert str(root) in message and "--adapter-source-root" in message
    for leak in ("not a directory", "does not look like", "does not exist", "passwd", "private"):
        assert leak not in message
    assert listed == []


async def test_with_no_root_set_every_local_path_is_refused_naming_the_setting(
    tmp_path: Path, root: Path, outside: Path
) -> None:
    async with admin_api(tmp_path, admin_key=ADMIN_KEY) as client:
        answers = [await put(client, source) for source in ("/etc/passwd", "/nope", outside)]

    assert {answer.status_code for answer in answers} == {403}
    messages = {error_of(answer)["message"] for answer in answers}
    assert len(messages) == 1
    assert "no adapter source root is set" in messages.pop()


@pytest.mark.parametrize("link", ["adapter_config.json", "adapter_model.safetensors"])
async def test_a_file_linked_out_of_the_root_is_refused_without_its_contents(
    tmp_path: Path, root: Path, outside: Path, link: str
) -> None:
    adapter = tiny_adapter(root / "fox")
    target = outside.parent / "secret.json" if link == "adapter_config.json" else outside / link
    (adapter / link).unlink()
    (adapter / link).symlink_to(target)
    async with admin_api(tmp_path, admin_key=ADMIN_KEY, adapter_source_roots=[root]) as client:
        answer = await put(client, adapter)

    assert SECRET not in answer.text
    assert str(target) not in answer.text  # nor where the link leads
    assert answer.status_code == 403, answer.text
    assert error_of(answer)["code"] == "adapter_source_not_allowed"
    assert link in error_of(answer)["message"]  # which file of the adapter to fix


async def test_a_folder_linked_out_of_the_root_is_refused(
    tmp_path: Path, root: Path, outside: Path
) -> None:
    run = root / "vi-run"
    run.mkdir()
    (run / "model_adapter").symlink_to(outside)  # a Vi run whose adapter folder lies outside
    async with admin_api(tmp_path, admin_key=ADMIN_KEY, adapter_source_roots=[root]) as client:
        answer = await put(client, run)

    assert answer.status_code == 403, answer.text
    assert str(outside) not in answer.text


# ----- what lies inside them still loads --------------------------------------------------------


async def test_an_adapter_under_a_root_loads(tmp_path: Path, root: Path) -> None:
    tiny_adapter(root / "team" / "fox")
    (root / "latest").symlink_to(root / "team" / "fox")  # a link that stays inside: fine
    (tmp_path / "via-link").symlink_to(root)  # a root named through a link resolves the same
    async with admin_api(
        tmp_path, admin_key=ADMIN_KEY, adapter_source_roots=[tmp_path / "via-link"]
    ) as client:
        added = await put(client, root / "team" / "fox")
        swapped = await put(client, f"{root}/team/../latest", name="owl")
        loaded = await load(client, root / "latest")

    assert added.status_code == 200, added.text
    assert added.json()["state"] == "ready"
    assert swapped.status_code == 200, swapped.text
    assert loaded.status_code == 200, loaded.text


async def test_the_per_start_token_may_name_any_local_path(tmp_path: Path, outside: Path) -> None:
    """Without --admin-key, the key is the token in the cache dir, which only the gateway's
    own user reads: the CLI on its machine, who has those files already."""
    async with admin_api(tmp_path) as client:
        answer = await put(client, outside)

    assert answer.status_code == 200, answer.text


# ----- which sources are local --------------------------------------------------------------


def test_a_bare_hub_id_is_the_hubs_unless_it_names_a_path_under_a_root(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_adapter(tmp_path / "org" / "exists")
    tiny_adapter(root / "org" / "local")
    monkeypatch.chdir(tmp_path)  # `org/exists` names a real adapter, outside the root
    assert admit_client_source("org/exists", [root]) == "hf://org/exists"
    assert admit_client_source("org/missing", [root]) == "hf://org/missing"
    monkeypatch.chdir(root)
    assert admit_client_source("org/local", [root]) == str((root / "org" / "local").resolve())


def test_remote_sources_pass_and_other_schemes_are_not_paths(root: Path) -> None:
    for source in ("hf://org/repo", "https://example.com/a.tar.gz", "tinker://run/weights/x"):
        assert admit_client_source(source, [root]) == source
    with pytest.raises(ValueError, match="hf://, https:// or tinker://"):
        admit_client_source("ftp://example.com/adapter.tar", [root])


# ----- numbers no float holds ---------------------------------------------------------------


HUGE = "1" + "0" * 400  # 1e400 written as an integer: Python reads it, no float holds it


@pytest.mark.parametrize(
    ("file", "field", "written"),
    [
        ("adapter_config.json", "lora_alpha", "1e400"),
        ("adapter_config.json", "lora_alpha", HUGE),
        ("adapter_config.json", "alpha_pattern", '{"q_proj": ' + HUGE + "}"),
        ("adapter_config.json", "rank_pattern", '{"q_proj": ' + HUGE + "}"),
        ("loragate.json", "preset", '{"clamps": {"max_tokens": ' + HUGE + "}}"),
    ],
)
async def test_a_number_no_float_holds_is_a_400_naming_the_field(
    tmp_path: Path, root: Path, file: str, field: str, written: str
) -> None:
    adapter = tiny_adapter(root / "fox")
    path = adapter / file
    record = json.loads(path.read_text()) if path.exists() else {}
    record[field] = "@number@"
    path.write_text(json.dumps(record).replace('"@number@"', written))
    async with admin_api(tmp_path, admin_key=ADMIN_KEY, adapter_source_roots=[root]) as client:
        answer = await put(client, adapter)

    assert answer.status_code == 400, answer.text
    message = error_of(answer)["message"]
    assert field in message or "clamps" in message, message
    assert len(message) < 1000  # the 401 digits are not echoed whole


def test_json_numbers_past_the_digit_limit_are_invalid_json_not_a_crash(
    tmp_path: Path,
) -> None:
    from loragate.adapters.intake.validate import AdapterRejected, validate_adapter

    adapter = tiny_adapter(tmp_path / "fox")
    (adapter / "adapter_config.json").write_text('{"r": ' + "9" * 5000 + "}")
    with pytest.raises(AdapterRejected, match="not valid JSON"):
        validate_adapter(adapter, TINY_LLAMA, 16)
