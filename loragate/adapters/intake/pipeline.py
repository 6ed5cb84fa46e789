"""From a SOURCE string to a validated PEFT adapter in the store: fetch, convert, validate, store.

Runs off the event loop (``asyncio.to_thread``); conversion that needs torch runs in a child
process, so the gateway process never imports it. Whatever fails leaves nothing in the store.

The version's preset (``preset``) is the one the caller gives (the admin API's or a manifest
entry's ``preset``), else the ``preset`` of a ``loragate.json`` beside the adapter's files
(``{"preset": {...}}``), else none; it is checked before anything is stored.

A source an admin client names goes through ``admitted_source`` first: local paths only under
the adapter source roots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loragate.adapters.errors import AdapterError, disk_error
from loragate.adapters.preset import ParameterRules, Preset, PresetError
from loragate.adapters.provenance import Provenance
from loragate.adapters.store import AdapterStore, StoredAdapter, StoreError, tree_digest
from loragate.base_model.vi_runs import (
    VI_ADAPTER_DIRNAME,
    VI_FULL_DIRNAME,
    VI_RUN_INFO,
    ViRunError,
    is_vi_run,
    vi_run_layout,
    vi_run_preset,
)
from loragate.fetching.progress import report_stage
from loragate.logs import redact_urls

log = logging.getLogger("loragate.adapters")

# Beside an adapter's files: what travels with its weights (``{"preset": {...}}``).
SIDECAR_FILENAME = "loragate.json"


@dataclass(frozen=True)
class PreparedVersion:
    """A version in the store, ready to load, and where it came from."""

    stored: StoredAdapter
    provenance: Provenance
    # True when its files were hashed just now (stored, or found intact in the store): the
    # manager loads it without hashing them again. Versions read back from disk later (a
    # rollback, a restart) are verified before they load.
    verified: bool = False


@dataclass
class AdapterPipeline:
    store: AdapterStore
    base_dir: Path
    base_config: dict[str, Any]
    max_lora_rank: int
    progress: bool = False
    # What checks a preset's defaults and clamps (the gateway's parameter table); None: only
    # their shape. Set by the backend that owns the table.
    preset_rules: ParameterRules | None = None

    async def __call__(
        self, source: str, revision: str | None, preset: Preset | None = None
    ) -> PreparedVersion:
        return await asyncio.to_thread(self.prepare, source, revision, preset)

    def prepare(
        self, source: str, revision: str | None = None, preset: Preset | None = None
    ) -> PreparedVersion:
        """Fetch, convert, validate and store ``source`` with ``preset`` (None: its
        ``loragate.json``'s); every failure is an ``AdapterError``.

        The fleet reconciler, boot and the admin API catch only ``AdapterError``: anything
        else (a full disk, a file whose numbers overflow, a bug) would abort a whole
        reconcile pass or answer a plain-text 500, so it is turned into one here, with a reason.
        """
        try:
            work = self.store.work_dir()
        except OSError as exc:
            raise disk_error(exc, f"preparing the adapter from {source}") from None
        try:
            return self._prepare_in(work, source, revision, preset)
        except AdapterError:
            raise
        except OSError as exc:
            raise disk_error(exc, f"preparing the adapter from {source}") from None
        except Exception as exc:
            log.exception("adapter from %s: unexpected failure", redact_urls(source))
            raise AdapterError(
                f"adapter from {source} could not be prepared: {type(exc).__name__}: {exc}",
                status=500,
                code="adapter_unexpected_error",
            ) from None
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _prepare_in(
        self, work: Path, source: str, revision: str | None, preset: Preset | None
    ) -> PreparedVersion:
        from loragate.adapters.intake.convert import (
            convert_in_subprocess,
            detect_format,
            needs_conversion,
        )
        from loragate.adapters.intake.sources import SourceError, fetch_source
        from loragate.adapters.intake.validate import AdapterRejected, validate_adapter

        report_stage("download")
        try:
            fetched = fetch_source(
                source,
                work / "fetched",
                revision=revision,
                progress=self.progress,
                # Outside the per-attempt work dir, so an interrupted download resumes.
                download_dir=self.store.root / "downloads",
                hf_cache_dir=self.store.root / "hf",
            )
        except SourceError as exc:
            raise AdapterError(str(exc), code="adapter_source_error") from None
        peft_dir = fetched.path
        if preset is None:
            preset = sidecar_preset(fetched.path, f"adapter from {source}", self.preset_rules)
        if preset is None and is_vi_run(fetched.path):
            preset = vi_run_preset_of(fetched.path, f"Vi run from {source}", self.preset_rules)
        if fetched.renderer is not None and (preset is None or preset.renderer is None):
            # The chat format the source says it was trained with (a Tinker run's).
            preset = dataclasses.replace(preset or Preset(), renderer=fetched.renderer)
        source_digest: str | None = None
        try:
            fmt = detect_format(fetched.path)
            if needs_conversion(fetched.path):
                # Converting costs a torch start-up: skip it when these exact files were
                # converted before and the result is still in the store.
                source_digest = tree_digest(fetched.path)
                known = self.store.converted_from(source_digest)
                if known is not None and known.preset == (preset or None):
                    self.store.touch(known)
                    return PreparedVersion(known, fetched.provenance, verified=True)
                if known is not None:  # the same weights under another preset
                    meta = {key: known.meta.get(key) for key in _FACTS}
                    stored = self._store(
                        known.path, {**fetched.provenance.to_record(), **meta}, preset
                    )
                    return PreparedVersion(stored, fetched.provenance, verified=True)
                peft_dir = work / "converted"
                report_stage("conversion")
                convert_in_subprocess(fetched.path, peft_dir, self.base_dir)
            report_stage("validation")
            facts = validate_adapter(peft_dir, self.base_config, self.max_lora_rank)
        except AdapterRejected as exc:
            raise AdapterError(
                f"adapter from {source} rejected: {exc}", code="adapter_rejected"
            ) from None
        except ValueError as exc:  # unreadable or unconvertible files: the message says which
            raise AdapterError(
                f"adapter from {source} rejected: {exc}", code="adapter_conversion_failed"
            ) from None
        meta = {
            **fetched.provenance.to_record(),
            "format": fmt,
            "rank": facts.rank,
            "target_modules": sorted(facts.target_modules),
        }
        stored = self._store(peft_dir, meta, preset)
        if source_digest is not None:
            self.store.remember_conversion(source_digest, stored)
        return PreparedVersion(stored, fetched.provenance, verified=True)

    def _store(self, peft_dir: Path, meta: dict[str, Any], preset: Preset | None) -> StoredAdapter:
        report_stage("store")
        try:
            return self.store.put_dir(peft_dir, meta, preset)
        except StoreError as exc:
            raise AdapterError(str(exc), code="adapter_store_error") from None


async def admitted_source(source: str, local_roots: Sequence[Path]) -> str:
    """``source`` as an admin client may send it (``admit_client_source``), checked off the
    event loop (resolving it and walking its links touch the disk). A local path outside
    ``local_roots`` is a 403 in the same words whatever lies there."""
    from loragate.adapters.intake.sources import (
        SourceError,
        SourceNotAllowed,
        admit_client_source,
    )

    try:
        return await asyncio.to_thread(admit_client_source, source, local_roots)
    except SourceNotAllowed as exc:
        raise AdapterError(str(exc), status=403, code="adapter_source_not_allowed") from None
    except SourceError as exc:
        raise AdapterError(str(exc), code="adapter_source_error") from None


def sidecar_preset(directory: Path, what: str, rules: ParameterRules | None) -> Preset | None:
    """The preset of the ``loragate.json`` in ``directory`` (an adapter's files, or a base
    model's); None without one. ``AdapterError`` (400) naming ``what`` when it does not hold."""
    path = directory / SIDECAR_FILENAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise AdapterError(
            f"{what}: {SIDECAR_FILENAME} is not valid JSON: {exc}", code="invalid_preset"
        ) from None
    if not isinstance(record, dict) or set(record) - {"preset"}:
        raise AdapterError(
            f'{what}: {SIDECAR_FILENAME} must be {{"preset": {{...}}}}', code="invalid_preset"
        )
    try:
        return Preset.from_dict(record.get("preset") or {}, rules) or None
    except PresetError as exc:
        raise AdapterError(f"{what}: {SIDECAR_FILENAME}: {exc}", code="invalid_preset") from None


def vi_run_preset_of(run_dir: Path, what: str, rules: ParameterRules | None) -> Preset | None:
    """A Datature Vi run's preset, as ``--run-id`` serves it: its adapter's own
    ``loragate.json``, else its ``run.json`` read as the Vi SDK reads it (``vi_run_preset``);
    None for a run that has no ``run.json``."""
    own = sidecar_preset(run_dir / VI_ADAPTER_DIRNAME, what, rules)
    if own is not None or not (run_dir / VI_FULL_DIRNAME / VI_RUN_INFO).is_file():
        return own
    try:
        _, _, info = vi_run_layout(run_dir)
        return Preset.from_dict(vi_run_preset(info), rules) or None
    except (ViRunError, PresetError) as exc:
        raise AdapterError(f"{what}: {exc}", code="invalid_preset") from None


# What validation found out about the weights, kept with every version of them.
_FACTS = ("format", "rank", "target_modules")
