"""Whether the engine will run loragate's CPU LoRA ops (``loragate.engine_plugin``).

The plugin lives in the engine's processes; this process never imports it (nor vLLM or torch):
it asks the engine's interpreter, with the engine's environment, in a child process.
"""

from __future__ import annotations

import subprocess

SWITCH = "LORAGATE_CPU_LORA_OPS"
_CHECK_TIMEOUT = 60.0


def plugin_problem(python: str, env: dict[str, str]) -> str | None:
    """Why an engine started by ``python`` with ``env`` would not get the ops; None if it would."""
    try:
        done = subprocess.run(
            [python, "-m", "loragate.engine_plugin"],
            env={**env, SWITCH: "1"},
            capture_output=True,
            text=True,
            timeout=_CHECK_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot ask {python} about the plugin: {exc}"
    if done.returncode == 0:
        return None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[-1] if lines else f"the check exited with status {done.returncode}"
