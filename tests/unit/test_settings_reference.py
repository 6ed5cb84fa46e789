"""docs/settings.md is the settings reference, generated from ``Settings``: kept current, and
naming every setting with its flag, environment variable and config key."""

from __future__ import annotations

import re

from loragate.settings import Settings
from tools import settings_reference
from tools.settings_reference import COMMAND, PAGE, render


def test_the_settings_reference_is_current() -> None:
    committed = PAGE.read_text(encoding="utf-8")
    assert committed == render(), f"docs/settings.md is out of date: run {COMMAND}"


def test_every_setting_is_documented_with_its_flag_variable_and_config_key() -> None:
    page = PAGE.read_text(encoding="utf-8")
    rows = {
        match.group(1): line
        for line in page.splitlines()
        if (match := re.match(r"\| `([a-z-]+)` \|", line))
    }
    assert set(rows) == {name.replace("_", "-") for name in Settings.model_fields}
    assert "`--max-loras`" in rows["max-loras"] and "`LORAGATE_MAX_LORAS`" in rows["max-loras"]
    assert "`-tp`" in rows["tensor-parallel-size"]
    assert "`--no-docs`" in rows["docs"]
    assert "`DATATURE_VI_SECRET_KEY`" in rows["secret-key"]
    assert "| `900` s |" in rows["startup-timeout"]
    assert "| 32 MiB |" in rows["max-body-bytes"]
    assert "| `~/.cache/loragate` |" in rows["cache-dir"]
    # Every setting says what it does.
    assert all(not line.rstrip().endswith("|  |") for line in rows.values())


def test_the_check_mode_names_the_command_when_the_page_is_stale(
    tmp_path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    stale = tmp_path / "settings.md"
    stale.write_text("# an old page\n", encoding="utf-8")
    monkeypatch.setattr(settings_reference, "PAGE", stale)
    monkeypatch.setattr(settings_reference, "ROOT", tmp_path)
    assert settings_reference.main(["--check"]) == 1
    assert COMMAND in capsys.readouterr().err
    assert settings_reference.main([]) == 0
    assert settings_reference.main(["--check"]) == 0
    assert stale.read_text(encoding="utf-8") == render()
