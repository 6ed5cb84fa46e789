from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loragate.supervisor.systemd_unit import default_exec_start, quote_exec_arg, render_unit


def unit_lines(text: str) -> list[str]:
    return text.splitlines()


def system_unit(
    tmp_path: Path,
    *,
    exec_start: list[str] | None = None,
    working_directory: Path | None = None,
    user: str | None = "loragate",
    environment_file: Path | None = Path("/etc/loragate/loragate.env"),
    user_mode: bool = False,
) -> str:
    return render_unit(
        exec_start=exec_start or ["/opt/loragate/bin/gateway", "serve"],
        working_directory=working_directory or tmp_path,
        user=user,
        environment_file=environment_file,
        user_mode=user_mode,
    )


def test_system_unit_is_type_notify_with_watchdog_and_mixed_kill(tmp_path: Path) -> None:
    lines = unit_lines(system_unit(tmp_path))
    for expected in [
        "[Unit]",
        "After=network-online.target",
        "Wants=network-online.target",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=/opt/loragate/bin/gateway serve",
        f"WorkingDirectory={tmp_path}",
        "EnvironmentFile=-/etc/loragate/loragate.env",
        "User=loragate",
        "Restart=on-failure",
        "RestartSec=5",
        "TimeoutStartSec=900",
        "TimeoutStopSec=60",
        "WatchdogSec=60",
        "KillMode=mixed",
        "KillSignal=SIGTERM",
        "LimitNOFILE=65536",
        "[Install]",
        "WantedBy=multi-user.target",
    ]:
        assert expected in lines
    assert lines.index("[Unit]") < lines.index("[Service]") < lines.index("[Install]")


def test_user_unit_has_no_user_no_network_target_and_wants_default_target(tmp_path: Path) -> None:
    lines = unit_lines(system_unit(tmp_path, user=None, user_mode=True))
    assert "WantedBy=default.target" in lines
    assert not any(line.startswith("User=") for line in lines)
    assert not any("network-online.target" in line for line in lines)
    assert "Type=notify" in lines


def test_user_mode_with_a_user_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="User="):
        system_unit(tmp_path, user="someone", user_mode=True)


def test_environment_file_line_is_left_out_when_none(tmp_path: Path) -> None:
    assert "EnvironmentFile" not in system_unit(tmp_path, environment_file=None)


def test_exec_start_quotes_arguments_with_spaces_and_escapes_specials(tmp_path: Path) -> None:
    exec_start = [
        "/opt/lora gate/bin/gateway",
        "serve",
        "--model",
        "/models/my model",
        "--lora",
        "a=$HOME/x%y",
        'say "hi"',
        "back\\slash",
        ";",
        "",
    ]
    lines = unit_lines(system_unit(tmp_path, exec_start=exec_start))
    expected = (
        'ExecStart="/opt/lora gate/bin/gateway" serve --model "/models/my model" --lora '
        'a=$$HOME/x%%y "say \\"hi\\"" "back\\\\slash" ";" ""'
    )
    assert expected in lines


@pytest.mark.parametrize(
    ("arg", "word"),
    [
        ("plain", "plain"),
        ("--port=8000", "--port=8000"),
        ("two words", '"two words"'),
        ("tab\there", '"tab\\there"'),
        ("line\nbreak", '"line\\nbreak"'),
        ("100%", "100%%"),
        ("$VAR", "$$VAR"),
        ("it's", '"it\'s"'),
    ],
)
def test_quote_exec_arg(arg: str, word: str) -> None:
    assert quote_exec_arg(arg) == word


def test_relative_executable_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absolute"):
        system_unit(tmp_path, exec_start=["gateway", "serve"])


def test_line_break_in_working_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="line break"):
        system_unit(tmp_path, working_directory=tmp_path / "a\nb")


def test_percent_in_paths_is_escaped_as_a_specifier(tmp_path: Path) -> None:
    lines = unit_lines(system_unit(tmp_path, working_directory=Path("/srv/100%")))
    assert "WorkingDirectory=/srv/100%%" in lines


def test_default_exec_start_runs_the_gateway_script_next_to_python() -> None:
    script = Path(sys.executable).parent / "gateway"
    command = default_exec_start()
    if script.is_file() and os.access(script, os.X_OK):
        assert command == [str(script), "serve"]
    else:
        assert command == [sys.executable, "-m", "loragate.cli", "serve"]


def test_default_exec_start_falls_back_to_python_m(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    assert default_exec_start() == [str(tmp_path / "python"), "-m", "loragate.cli", "serve"]


def _verify(unit_text: str, tmp_path: Path, *, user_mode: bool) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit_file = tmp_path / "loragate-test.service"
    unit_file.write_text(unit_text)
    env = dict(os.environ)
    argv = [analyze]
    if user_mode:
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        argv.append("--user")
    return subprocess.run(
        [*argv, "verify", str(unit_file)], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.parametrize("user_mode", [False, True], ids=["system", "user"])
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path, user_mode: bool) -> None:
    unit = render_unit(
        exec_start=[*default_exec_start(), "--model", "/models/my model"],
        working_directory=tmp_path,
        user=None,
        environment_file=tmp_path / "missing.env",
        user_mode=user_mode,
    )
    result = _verify(unit, tmp_path, user_mode=user_mode)
    complaints = [line for line in result.stderr.splitlines() if "loragate-test" in line]
    assert result.returncode == 0, result.stderr
    assert complaints == []
