"""Conversion in a child Python, so the gateway process never imports torch: the parent side
(``convert_in_subprocess``) and the child's entry point (``main``, run as
``python -m loragate.adapters.intake.convert``). The child's last error line carries its message back.
"""

from __future__ import annotations

import argparse
import errno
import subprocess
import sys
from pathlib import Path

from loragate.adapters.intake.convert.errors import ConversionError
from loragate.adapters.intake.convert.to_peft import convert_to_peft

ERROR_MARKER = "loragate-convert-error: "
# Starts the message when the disk filled up, so the parent raises ENOSPC, not a bad adapter.
NO_SPACE = "no space left on device: "


def convert_in_subprocess(
    src: Path,
    out: Path,
    base_model_dir: Path | None,
    *,
    base_model_name: str | None = None,
    python: str | None = None,
    timeout: float = 900.0,
) -> Path:
    """Run ``convert_to_peft`` in a child Python so this process never imports torch.

    ``python`` is the interpreter with torch (the engine's); the child's error message comes
    back as a ``ConversionError``.
    """
    command = [
        python or sys.executable,
        "-m",
        "loragate.adapters.intake.convert",
        str(src),
        str(out),
    ]
    if base_model_dir is not None:
        command += ["--base", str(base_model_dir)]
    if base_model_name is not None:
        command += ["--base-model-name", base_model_name]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ConversionError(f"converting {src} took longer than {timeout:.0f}s; gave up") from exc
    except OSError as exc:
        raise ConversionError(f"cannot start {command[0]} to convert {src}: {exc}") from exc
    if done.returncode != 0:
        message = _child_error(done.stderr, done.returncode)
        if message.startswith(NO_SPACE):
            # The disk, not the adapter: the caller reports it as such (507).
            raise OSError(errno.ENOSPC, f"converting {src}: {message[len(NO_SPACE) :]}")
        raise ConversionError(message)
    return out


def _child_error(stderr: str, returncode: int) -> str:
    for line in reversed(stderr.splitlines()):
        if line.startswith(ERROR_MARKER):
            return line[len(ERROR_MARKER) :]
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    return f"the converter exited with status {returncode}: {tail or 'no output'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loragate.adapters.intake.convert", description="Convert an adapter to PEFT."
    )
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--base", type=Path, default=None, help="base model directory")
    parser.add_argument("--base-model-name", default=None, help="base_model_name_or_path to record")
    args = parser.parse_args(argv)
    try:
        base_config = None
        if args.base is not None:
            from loragate.base_model.resolve import read_base_config

            base_config = read_base_config(args.base)
        name = args.base_model_name or (str(args.base) if args.base is not None else None)
        convert_to_peft(args.src, args.out, base_config, name)
    except Exception as exc:  # whatever the files make fail: one line the parent can show
        text = " ".join(str(exc).split())
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            text = f"{NO_SPACE}{text}"
        elif not isinstance(exc, ValueError | OSError):
            text = f"{type(exc).__name__}: {text}"
        print(f"{ERROR_MARKER}{text}", file=sys.stderr)
        return 1
    print(args.out)
    return 0
