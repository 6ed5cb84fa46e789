from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loragate.cli import app as cli_app
from loragate.systemd import default_exec_start, quote_exec_arg, render_unit


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
        working_directory=working_directory,
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
        "WorkingDirectory=%S/loragate",
        "EnvironmentFile=-/etc/loragate/loragate.env",
        "User=loragate",
        "Group=loragate",
        "StateDirectory=loragate",
        "CacheDirectory=loragate",
        "Restart=on-failure",
        "RestartPreventExitStatus=2",
        "RestartSec=5",
        "TimeoutStartSec=300",
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
        user=None if user_mode else "loragate",
        environment_file=tmp_path / "missing.env",
        user_mode=user_mode,
    )
    result = _verify(unit, tmp_path, user_mode=user_mode)
    complaints = [line for line in result.stderr.splitlines() if "loragate-test" in line]
    assert result.returncode == 0, result.stderr
    assert complaints == []


# ----- the sandbox ---------------------------------------------------------------------------

SANDBOX = [
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "ProtectHome=yes",
    "PrivateTmp=yes",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectControlGroups=yes",
    "RestrictSUIDSGID=yes",
    "LockPersonality=yes",
    "RestrictRealtime=yes",
    "SystemCallArchitectures=native",
    "CapabilityBoundingSet=",
    "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
]
# Each would break vLLM on a GPU: the devices hidden or closed, JIT compilers refused.
BREAKS_VLLM = ["PrivateDevices", "DeviceAllow", "ProtectClock", "MemoryDenyWriteExecute"]


def settings_of(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit_lines(text):
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def test_system_unit_runs_sandboxed_but_keeps_the_gpus_and_the_jit(tmp_path: Path) -> None:
    text = system_unit(tmp_path)
    lines = unit_lines(text)
    missing = [line for line in SANDBOX if line not in lines]
    assert not missing, f"the system unit lacks {missing}"
    present = [key for key in BREAKS_VLLM if key in settings_of(text)]
    assert not present, f"these break vLLM on a GPU: {present}"


def test_system_unit_keeps_its_files_in_its_own_state_and_cache_directories(
    tmp_path: Path,
) -> None:
    lines = unit_lines(system_unit(tmp_path))
    assert "StateDirectory=loragate" in lines
    assert "CacheDirectory=loragate" in lines
    assert "WorkingDirectory=%S/loragate" in lines
    # A home and the Hugging Face cache the sandbox lets it write, whatever the account's home.
    assert "Environment=HOME=%S/loragate" in lines
    assert "Environment=HF_HOME=%C/loragate/huggingface" in lines


def test_an_install_under_a_home_directory_stays_readable(tmp_path: Path) -> None:
    text = system_unit(tmp_path, exec_start=["/home/alice/loragate/.venv/bin/gateway", "serve"])
    assert settings_of(text)["ProtectHome"] == ["read-only"]


@pytest.mark.parametrize("user", ["root", "0"])
def test_a_system_unit_as_root_is_refused(tmp_path: Path, user: str) -> None:
    with pytest.raises(ValueError, match="dedicated user"):
        system_unit(tmp_path, user=user)


def test_user_unit_has_its_directories_and_no_privileges_but_no_sandbox(tmp_path: Path) -> None:
    text = system_unit(tmp_path, user=None, user_mode=True)
    lines = unit_lines(text)
    for line in ["StateDirectory=loragate", "CacheDirectory=loragate", "NoNewPrivileges=yes"]:
        assert line in lines
    # In a user manager the mount sandbox needs user namespaces; HF_HOME stays the user's.
    assert "ProtectSystem" not in settings_of(text)
    assert "Environment" not in settings_of(text)


def test_the_systemd_unit_command_prints_a_unit_for_a_dedicated_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SUDO_USER", "alice")
    result = CliRunner().invoke(cli_app, ["systemd-unit"])
    assert result.exit_code == 0, result.output
    lines = unit_lines(result.output)
    assert "User=loragate" in lines and "Group=loragate" in lines
    assert "WorkingDirectory=%S/loragate" in lines
    assert str(tmp_path) not in result.output, "nothing comes from the generating shell"

    named = CliRunner().invoke(cli_app, ["systemd-unit", "--run-as", "llm"])
    assert "User=llm" in unit_lines(named.output)
    refused = CliRunner().invoke(cli_app, ["systemd-unit", "--run-as", "root"])
    assert refused.exit_code == 2
    assert "dedicated user" in refused.output


def test_systemd_analyze_security_rates_the_system_unit_ok(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit_file = tmp_path / "loragate-test.service"
    unit_file.write_text(system_unit(tmp_path, exec_start=default_exec_start()))
    result = subprocess.run(
        [analyze, "security", "--offline=true", "--no-pager", str(unit_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", result.stdout)
    if found is None and "offline" in result.stderr:
        pytest.skip(f"this systemd-analyze cannot review a unit file: {result.stderr.strip()}")
    assert found is not None, result.stdout + result.stderr
    score, rating = float(found[1]), found[2]
    print(f"systemd-analyze security: exposure {score} {rating}")
    # systemd rates below 5.0 OK, 5.0-7.0 MEDIUM, above UNSAFE; 10 is no sandbox at all.
    assert score < 5.0, result.stdout
