"""The base model: a local directory, a Hugging Face id downloaded once into the cache, or a
GGUF file dequantized once into the cache (``loragate.base_model.gguf``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loragate.base_model.hub_cache import (
    MODELS_DIRNAME,
    BaseModelError,
    hub_cache_dir,
    hub_cache_holding,
    offline,
)
from loragate.fetching.hub import check_hub_endpoint, hf_token
from loragate.fetching.json_file import read_json_object
from loragate.fetching.progress import hub_progress_class, report_stage

# Never fetched for a base model, as vLLM's own downloader (LoadConfig.ignore_patterns):
# Meta's original checkpoint, a second copy of the weights for another runtime.
ALWAYS_IGNORED = ["original/*", "*.pth"]


def _looks_like_path(model: str) -> bool:
    # Hugging Face ids are "name" or "org/name"; anything else is meant as a directory.
    return model.startswith(("/", ".", "~")) or model.count("/") > 1


def resolve_base_model(
    model: str,
    cache_dir: Path,
    progress: bool = True,
    revision: str | None = None,
    python: str | None = None,
    dtype: str | None = None,
) -> Path:
    """The local directory of base model ``model`` (a directory, a Hugging Face id, or GGUF).

    A Hugging Face id is downloaded with ``snapshot_download`` into the user's Hugging Face
    hub cache the first time (unless it is there already, from vLLM, transformers or
    ``huggingface-cli download``); later calls, and any call under ``HF_HUB_OFFLINE=1``, use
    that copy without touching the network. A copy in loragate's former cache
    (``cache_dir/models/``) is still used. ``HF_TOKEN`` is honoured for gated models.

    A GGUF file (``path/model.gguf``, ``hf://ORG/REPO/FILE.gguf``, ``pkg://DIST/PATH``) is
    dequantized the first time to ``dtype`` (the engine's ``--dtype``; default bfloat16) by a
    child running ``python`` (default: this interpreter), into
    ``cache_dir/models/gguf/<sha256>-<dtype>/``; see ``loragate.base_model.gguf``.
    """
    try:
        local = Path(model).expanduser()
    except RuntimeError:  # ~user of an unknown user
        raise BaseModelError(
            f"base model {model} names the home directory of an unknown user"
        ) from None
    if local.is_dir():
        return local.resolve()
    from loragate.base_model.gguf import is_gguf_source, resolve_gguf_model  # heavy: lazily

    if is_gguf_source(model):
        return resolve_gguf_model(
            model, cache_dir, python=python, progress=progress, revision=revision, dtype=dtype
        )
    if _looks_like_path(model):
        raise BaseModelError(
            f"base model directory {model} does not exist; pass an existing directory, a "
            "Hugging Face id such as Org/Model, or a .gguf file"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    hub_cache = hub_cache_holding(model, cache_dir / MODELS_DIRNAME)
    try:
        # A copy in the cache wins: serving must not depend on the hub being reachable.
        return Path(
            snapshot_download(model, revision=revision, cache_dir=hub_cache, local_files_only=True)
        )
    except LocalEntryNotFoundError:
        if offline():
            raise BaseModelError(
                f"base model {model} is not in the Hugging Face cache {hub_cache or hub_cache_dir()}"
                f" and HF_HUB_OFFLINE is set; run `gateway pull {model}` with network access first"
            ) from None
    try:
        check_hub_endpoint()
        report_stage("download")
        path = snapshot_download(
            model,
            revision=revision,
            cache_dir=hub_cache,
            token=hf_token(),
            ignore_patterns=_ignore_patterns(model, revision),
            tqdm_class=hub_progress_class(),
        )
    except Exception as exc:  # the hub raises many kinds: auth, not found, network
        raise BaseModelError(
            f"cannot download base model {model} from Hugging Face: {exc}"
        ) from exc
    return Path(path)


def base_model_ignore_patterns(files: list[str]) -> list[str]:
    """What not to download of a repository holding ``files``, the way vLLM picks weights:
    safetensors when there are any (then no ``*.bin``/``*.pt`` duplicates), Hugging Face
    shards over Mistral's ``consolidated*`` copy of the same weights when both are there, and
    never ``original/`` nor ``*.pth`` (which vLLM does not load)."""
    top = [name for name in files if "/" not in name]
    ignored = list(ALWAYS_IGNORED)
    safetensors = [name for name in top if name.endswith(".safetensors")]
    if safetensors:
        ignored += ["*.bin", "*.pt"]
        if any(not name.startswith("consolidated") for name in safetensors):
            ignored += ["consolidated*"]
    return ignored


def _ignore_patterns(model: str, revision: str | None) -> list[str]:
    """``base_model_ignore_patterns`` of the repository's listing (one hub call), or the
    patterns that hold for any repository when it cannot be listed."""
    from huggingface_hub import HfApi

    try:
        files = HfApi().list_repo_files(model, revision=revision, token=hf_token())
    except Exception:  # the download that follows reports the hub's trouble better
        return list(ALWAYS_IGNORED)
    return base_model_ignore_patterns(files)


def read_base_config(model_dir: Path) -> dict[str, Any]:
    """The base model's ``config.json`` as a dict."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise BaseModelError(
            f"{model_dir} has no config.json: it is not a Hugging Face model directory"
        )
    return read_json_object(path, BaseModelError)
