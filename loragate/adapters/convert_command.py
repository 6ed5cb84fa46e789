"""`gateway adapters convert SOURCE OUT --base MODEL`: any supported adapter, offline, into a
PEFT directory that vLLM loads, checked against the base model the way a running gateway would.

The conversion itself runs in a child Python (torch stays out of the CLI process).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from loragate.adapters.convert import convert_in_subprocess, needs_conversion
from loragate.adapters.models import read_base_config, resolve_base_model
from loragate.adapters.sources import fetch_source

# The largest rank vLLM accepts at all: the engine's own --max-lora-rank is checked at load.
_ANY_ENGINE_RANK = 512


def convert_command(source: str, out: Path, base: str, cache_dir: Path) -> Path:
    """Fetch ``source``, convert it to PEFT when needed, validate it against ``base`` and write
    it to ``out`` (which must not exist or be empty). Raises ``ValueError`` subclasses with a
    message the user can act on; ``out`` is left as it was on failure."""
    from loragate.adapters.validate import validate_adapter

    out = out.expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} already exists and is not an empty directory; pick a new OUT")
    base_dir = resolve_base_model(base, cache_dir.expanduser())
    base_config = read_base_config(base_dir)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=out.parent.resolve()) as tmp:
        work = Path(tmp)
        fetched = fetch_source(source, work / "fetched", download_dir=work)
        peft_dir = fetched.path
        if needs_conversion(peft_dir):
            peft_dir = convert_in_subprocess(
                fetched.path, work / "converted", base_dir, base_model_name=base
            )
        validate_adapter(peft_dir, base_config, _ANY_ENGINE_RANK)
        staged = work / "out"
        shutil.copytree(peft_dir, staged)
        if out.exists():
            out.rmdir()
        staged.rename(out)
    return out
