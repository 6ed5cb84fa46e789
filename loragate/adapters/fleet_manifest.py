"""The fleet's adapter manifest: desired state that every replica pointing at it converges on.

A manifest is JSON or YAML with the fields of ``PUT /admin/adapters/{name}``, plus an optional
digest pin::

    {"adapters": {"support": {"source": "hf://acme/support-lora", "revision": "v3",
                              "follow": false, "digest": "3f1c0a9d2b7e",
                              "preset": {"system_prompt": "You answer support tickets."}}}}

``preset`` is the version's preset (``loragate.adapters.preset``; ``{}``: none, absent: the
source's own ``loragate.json``), part of the version's identity like its weights.

A manifest that names no adapter is refused (the current adapters keep serving) unless it says
so on purpose: ``{"adapters": {}, "allow_empty": true}``. A truncated file (``adapters:``),
``adapters: null``, an empty file or one that is not a mapping would otherwise read as "serve
nothing" and remove every adapter of every replica at once.

Its revision is the sha256 of its bytes, so every replica computes the same value for the same
manifest. It is fetched from a local file, an ``http(s)://`` URL or a file in a Hugging Face
repository (``hf://ORG/REPO[@REV]/PATH``). A URL gets the adapter sources' address policy
(``source_networks``): a loopback, private or link-local host must be in
``allowed_source_networks``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loragate.adapters.names import InvalidAdapterName, validate_adapter_name
from loragate.adapters.preset import Preset, PresetError

MAX_MANIFEST_BYTES = 1 << 20  # a thousand adapters fit in a few hundred KiB
_FIELDS = {"source", "revision", "follow", "digest", "preset"}
_DIGEST = re.compile(r"^[0-9a-f]{8,64}$")
_HF_FILE = re.compile(r"^hf://(?P<repo>[^/@\s]+/[^/@\s]+)(?:@(?P<rev>[^/\s]+))?/(?P<path>.+)$")


class FleetManifestError(ValueError):
    """The manifest cannot be fetched or does not say what it must."""


@dataclass(frozen=True)
class DesiredAdapter:
    source: str
    revision: str | None = None
    follow: bool = False
    digest: str | None = None  # a prefix of the version's sha256 the store must end up with
    # The preset as written (its values are checked against the parameter table when applied).
    preset: dict[str, Any] | None = None


@dataclass(frozen=True)
class FleetManifest:
    revision: str  # sha256 of the manifest's bytes
    adapters: dict[str, DesiredAdapter]


def parse_fleet_manifest(data: bytes, base: str | None = None) -> FleetManifest:
    """The manifest in ``data`` (JSON or YAML); every mistake in it named in the error.

    With ``base`` (a catalog's model id), the manifest is one per base model:
    ``{"models": {"ID": {"adapters": {...}}}}``, and this is ``base``'s part of it (its
    revision still the whole file's: every model's reconciler sees the same one)."""
    revision = hashlib.sha256(data).hexdigest()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FleetManifestError("the adapters manifest is not UTF-8 text") from None
    document = _load(text)
    if base is not None:
        document = _part_of(document, base)
    elif isinstance(document, dict) and "models" in document:
        raise FleetManifestError(
            'this manifest lists adapters per base model ("models"), but this gateway serves '
            'one base model: give it {"adapters": {"NAME": {"source": ...}}}'
        )
    if not isinstance(document, dict) or "adapters" not in document or set(document) - _TOP:
        raise FleetManifestError(
            'the adapters manifest must be an object with the key "adapters" (and optionally '
            '"allow_empty"): {"adapters": {"NAME": {"source": ...}}}'
            + (" (it is empty: a truncated or missing file?)" if document is None else "")
        )
    adapters, allow_empty = document["adapters"], document.get("allow_empty", False)
    if not isinstance(allow_empty, bool):
        raise FleetManifestError('"allow_empty" must be true or false')
    if adapters is None:
        raise FleetManifestError(
            '"adapters" is empty (null): a truncated file? The adapters served now are kept; '
            'to serve none, write {"adapters": {}, "allow_empty": true}'
        )
    if not isinstance(adapters, dict):
        raise FleetManifestError('"adapters" must map adapter names to {"source": ...}')
    if not adapters and not allow_empty:
        raise FleetManifestError(
            "the adapters manifest names no adapters; the adapters served now are kept. To "
            'serve none, say so: {"adapters": {}, "allow_empty": true}'
        )
    return FleetManifest(
        revision, {str(name): _desired(str(name), spec) for name, spec in adapters.items()}
    )


_TOP = {"adapters", "allow_empty"}


def _part_of(document: Any, base: str) -> Any:
    """``base``'s part of a per-base-model manifest, checked as a whole manifest is."""
    models = document.get("models") if isinstance(document, dict) else None
    if not isinstance(models, dict) or set(document) != {"models"}:
        raise FleetManifestError(
            'a catalog\'s adapters manifest must be an object with the key "models", one part '
            'per base model: {"models": {"ID": {"adapters": {"NAME": {"source": ...}}}}}'
            + (" (it is empty: a truncated or missing file?)" if document is None else "")
        )
    if base not in models:
        raise FleetManifestError(
            f"the adapters manifest has no part for base model {base!r} (it has: "
            f"{', '.join(map(str, models)) or 'none'}); its adapters now are kept. To serve none, "
            f'say so: {{"models": {{"{base}": {{"adapters": {{}}, "allow_empty": true}}}}}}'
        )
    return models[base]


def _load(text: str) -> Any:
    import yaml

    try:
        try:
            return json.loads(text)
        except ValueError:
            pass
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FleetManifestError(f"the adapters manifest is neither JSON nor YAML: {exc}") from None
    except RecursionError:  # both parsers recurse per level of nesting
        raise FleetManifestError("the adapters manifest is nested too deeply") from None


def _desired(name: str, spec: Any) -> DesiredAdapter:
    try:
        validate_adapter_name(name)
    except InvalidAdapterName as exc:
        raise FleetManifestError(f"adapters manifest: {exc}") from None
    if isinstance(spec, str):
        spec = {"source": spec}
    if not isinstance(spec, dict):
        raise FleetManifestError(f"adapters manifest: {name!r} must be {{'source': ...}}")
    unknown = sorted(set(spec) - _FIELDS)
    if unknown:
        raise FleetManifestError(
            f"adapters manifest: {name!r} has unknown field(s) {unknown}; known: {sorted(_FIELDS)}"
        )
    source, revision = spec.get("source"), spec.get("revision")
    follow, digest = spec.get("follow", False), spec.get("digest")
    if not isinstance(source, str) or not source.strip():
        raise FleetManifestError(f"adapters manifest: {name!r} needs a source (a string)")
    if revision is not None and not isinstance(revision, str):
        raise FleetManifestError(f"adapters manifest: {name!r}: revision must be a string")
    if not isinstance(follow, bool):
        raise FleetManifestError(f"adapters manifest: {name!r}: follow must be true or false")
    if digest is not None and (not isinstance(digest, str) or not _DIGEST.match(digest)):
        raise FleetManifestError(
            f"adapters manifest: {name!r}: digest must be 8 to 64 lowercase hex digits of the "
            "version's sha256 (GET /admin/adapters shows it as 'version')"
        )
    preset = spec.get("preset")
    if preset is not None:
        try:
            Preset.from_dict(preset)  # its shape now; its values when the entry is applied
        except PresetError as exc:
            raise FleetManifestError(f"adapters manifest: {name!r}: {exc}") from None
    return DesiredAdapter(source.strip(), revision, follow, digest, preset)


def fetch_fleet_manifest(source: str, timeout: float = 30.0) -> bytes:
    """The manifest's bytes from a local path, an http(s) URL or ``hf://ORG/REPO[@REV]/PATH``."""
    if source.startswith(("http://", "https://")):
        return _fetch_url(source, timeout)
    if source.startswith("hf://"):
        return _fetch_hf(source)
    try:
        path = Path(source.removeprefix("file://")).expanduser()
        with path.open("rb") as handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)
    except (OSError, RuntimeError) as exc:  # RuntimeError: ~user of an unknown user
        raise FleetManifestError(f"cannot read the adapters manifest {source}: {exc}") from None
    return _bounded(data, source)


def _fetch_url(url: str, timeout: float) -> bytes:
    """The manifest at ``url``, through the adapter sources' client: an address off
    ``allowed_source_networks`` (loopback, private, link-local) is refused, every hop."""
    import httpx

    from loragate.fetching.source_networks import SourceAddressRefused, source_client
    from loragate.logs import redact

    try:
        with source_client(timeout) as http, http.stream("GET", url) as response:
            if response.status_code != 200:
                raise FleetManifestError(
                    f"the adapters manifest {redact(url)} answered HTTP {response.status_code}"
                )
            data = b""
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_MANIFEST_BYTES:
                    break
    except (httpx.HTTPError, SourceAddressRefused) as exc:
        raise FleetManifestError(
            f"cannot fetch the adapters manifest {redact(url)}: {exc}"
        ) from None
    return _bounded(data, redact(url))


def _fetch_hf(source: str) -> bytes:
    match = _HF_FILE.match(source)
    if match is None:
        raise FleetManifestError(
            f"{source!r} is not of the form hf://ORG/REPO[@REVISION]/PATH/TO/MANIFEST.yaml"
        )
    from huggingface_hub import hf_hub_download

    from loragate.fetching.hub import hf_token

    try:
        path = hf_hub_download(
            match["repo"], match["path"], revision=match["rev"], token=hf_token()
        )
    except Exception as exc:  # auth, not found, network: the hub raises many kinds
        raise FleetManifestError(f"cannot download the adapters manifest {source}: {exc}") from None
    with open(path, "rb") as handle:
        return _bounded(handle.read(MAX_MANIFEST_BYTES + 1), source)


def _bounded(data: bytes, where: str) -> bytes:
    if len(data) > MAX_MANIFEST_BYTES:
        raise FleetManifestError(
            f"the adapters manifest {where} is over {MAX_MANIFEST_BYTES >> 10} KiB"
        )
    return data
