"""Datature Vi training runs: download one with the ``vi-sdk`` package, and read its layout.

A downloaded run looks like::

    <dest>/<run_id>/model_full/          # the fine-tuned model; run.json describes the run
    <dest>/<run_id>/model_adapter/       # a PEFT LoRA adapter, when the run trained one
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from loragate.adapters.json_file import read_json_object

VI_FULL_DIRNAME = "model_full"
VI_ADAPTER_DIRNAME = "model_adapter"
VI_RUN_INFO = "run.json"
SECRET_KEY_ENV = "DATATURE_VI_SECRET_KEY"
ORGANIZATION_ENV = "DATATURE_VI_ORGANIZATION_ID"
VI_EXTRA_HINT = "pip install 'loragate[vi]' (the vi-sdk package)"


class ViRunError(ValueError):
    """A Vi run cannot be downloaded or read; the message says what to do."""


def is_vi_run(path: Path) -> bool:
    """True if ``path`` looks like a downloaded Vi run directory."""
    return (path / VI_ADAPTER_DIRNAME).is_dir() or (path / VI_FULL_DIRNAME / VI_RUN_INFO).is_file()


def vi_run_layout(run_dir: Path) -> tuple[Path, Path | None, dict[str, Any]]:
    """``(model_full dir, model_adapter dir or None, run.json contents)`` of a downloaded run."""
    full_dir = run_dir / VI_FULL_DIRNAME
    adapter_dir = run_dir / VI_ADAPTER_DIRNAME
    info_path = full_dir / VI_RUN_INFO
    if not full_dir.is_dir():
        raise ViRunError(
            f"{run_dir} is not a Datature Vi run: it has no {VI_FULL_DIRNAME}/ directory; "
            "download the run again"
        )
    if not info_path.is_file():
        raise ViRunError(
            f"{run_dir} has no {VI_FULL_DIRNAME}/{VI_RUN_INFO}; download the run again"
        )
    info = read_json_object(info_path, ViRunError, "; download the run again")
    return full_dir, (adapter_dir if adapter_dir.is_dir() else None), info


def download_vi_run(
    run_id: str,
    secret_key: str | None,
    organization_id: str | None,
    dest: Path,
    *,
    checkpoint: str | None = None,
    progress: bool = True,
) -> Path:
    """Download Vi training run ``run_id`` into ``dest/<run_id>/`` and return that directory.

    Credentials fall back to ``DATATURE_VI_SECRET_KEY`` / ``DATATURE_VI_ORGANIZATION_ID``.
    Needs the ``vi-sdk`` package (the ``loragate[vi]`` extra).
    """
    try:
        import vi
    except ImportError as exc:
        raise ViRunError(
            f"downloading a Datature Vi run needs the vi-sdk package: {VI_EXTRA_HINT}"
        ) from exc
    secret_key = secret_key or os.environ.get(SECRET_KEY_ENV)
    organization_id = organization_id or os.environ.get(ORGANIZATION_ENV)
    if not secret_key or not organization_id:
        raise ViRunError(
            "downloading a Datature Vi run needs credentials: pass --secret-key and "
            f"--organization-id, or set {SECRET_KEY_ENV} and {ORGANIZATION_ENV}"
        )
    dest.mkdir(parents=True, exist_ok=True)
    try:
        client = vi.Client(secret_key=secret_key, organization_id=organization_id)
        result = client.get_model(
            run_id=run_id, ckpt=checkpoint, save_path=dest, show_progress=progress
        )
    except Exception as exc:  # the SDK raises its own ViError family and httpx errors
        raise ViRunError(f"Datature Vi could not download run {run_id!r}: {exc}") from exc
    if result is None:
        raise ViRunError(f"the download of Vi run {run_id!r} was cancelled")
    run_dir = Path(result.model_path).parent
    vi_run_layout(run_dir)
    return run_dir
