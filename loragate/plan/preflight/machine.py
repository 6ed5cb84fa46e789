"""What the machine offers an engine, read without loading CUDA (not NVML or torch): the NVIDIA
GPUs this process may use and their free memory (``nvidia-smi``), and the NUMA nodes vLLM's CPU
build binds a worker to each of; and running such a probe without letting a hung or missing
program stop the gateway's start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from xml.etree import ElementTree

import psutil

# Running a short command for a preflight check (the engine's Python, ``nvidia-smi``) without
# letting a hung or missing program stop the gateway's start.
# How long the engine's Python may take to answer (importlib lookups, no vLLM import).
ENGINE_PYTHON_TIMEOUT = 60.0


def run_probe(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str] | str:
    """The finished process, or why it could not run."""
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return f"no answer within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


# NUMA nodes this process may run on: vLLM's CPU build binds one worker to each.
def numa_node_count() -> int:
    """NUMA nodes with a CPU this process may run on (vLLM's CPU build binds one worker to each)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    nodes = 0
    for cpulist in Path("/sys/devices/system/node").glob("node[0-9]*/cpulist"):
        with contextlib.suppress(OSError, ValueError):
            if _cpu_ids(cpulist.read_text()) & allowed:
                nodes += 1
    return max(nodes, 1)


def _cpu_ids(text: str) -> set[int]:
    ids: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            low, high = part.split("-")
            ids.update(range(int(low), int(high) + 1))
        elif part:
            ids.add(int(part))
    return ids


logger = logging.getLogger(__name__)

_NVIDIA_SMI_TIMEOUT = 20.0
# ``nvidia-smi -L``'s lines: a GPU, then each of its MIG slices beneath it.
_LISTED_GPU = re.compile(r"^GPU (\d+): .*\(UUID: (GPU-[^)]+)\)")
_LISTED_MIG = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)]+)\)")
_MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuInfo:
    """One GPU the engine may use, as ``nvidia-smi`` lists it: a whole GPU, a MIG slice (its
    own memory, not its GPU's), or a GPU that shares the host's memory (its total and free
    are the host's)."""

    index: str  # nvidia-smi's index; "GPU:SLICE" for a MIG slice
    name: str
    total_bytes: int  # 0 when its memory cannot be read (memory_known False)
    free_bytes: int
    uuid: str = field(default="", compare=False)  # what CUDA_VISIBLE_DEVICES may name
    note: str = field(default="", compare=False)  # "MIG 1g.10gb of GPU 0", "unified memory"
    # The user's own CUDA_VISIBLE_DEVICES entry for it: an engine is given that, not the UUID,
    # so that an index means what CUDA's device order (not nvidia-smi's) makes it mean.
    cuda_name: str = field(default="", compare=False)
    memory_known: bool = field(default=True, compare=False)

    @property
    def is_mig(self) -> bool:
        """A MIG slice: CUDA shows a process one of them at most."""
        return self.uuid.startswith("MIG-")


GpuInventory = Callable[[], "list[GpuInfo] | None"]


def visible_gpus() -> list[GpuInfo] | None:
    """The NVIDIA GPUs this process may use (``CUDA_VISIBLE_DEVICES``), in CUDA's order.

    None when ``nvidia-smi`` is missing or fails (no driver, no GPU). A GPU in MIG mode is its
    slices, each with its own memory (``memory_known`` False, never its whole GPU's, when
    that cannot be read); one whose memory nvidia-smi gives as ``[N/A]`` (a unified-memory GPU
    such as GB10) has the host's. With ``CUDA_VISIBLE_DEVICES`` set, each GPU keeps the entry
    that named it (``cuda_name``): an index there is matched to nvidia-smi's index (PCI bus
    order), which is CUDA's only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or GPUs alike, so the
    engine is given the user's entry back rather than a UUID that may name another GPU.
    Read through ``nvidia-smi``, not NVML or torch: the gateway never loads CUDA itself.
    """
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    result = run_probe(
        [
            nvidia_smi,
            "--query-gpu=index,uuid,name,memory.total,memory.free",
            "--format=csv,noheader,nounits",
        ],
        _NVIDIA_SMI_TIMEOUT,
    )
    if isinstance(result, str) or result.returncode != 0:
        logger.debug("nvidia-smi failed: %s", result if isinstance(result, str) else result.stderr)
        return None
    gpus = [gpu for line in result.stdout.splitlines() if (gpu := _csv_gpu(line)) is not None]
    if not gpus:
        return None
    slices = _mig_slices(nvidia_smi, gpus)
    # CUDA shows a GPU in MIG mode as its slices.
    listed = [part for gpu in gpus for part in slices.get(gpu.uuid, [gpu])]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return listed
    chosen: list[GpuInfo] = []
    for token in (token.strip() for token in visible.split(",")):
        match = [gpu for gpu in [*gpus, *listed] if _names_gpu(token, gpu)]
        if not match:
            break  # CUDA ignores everything from the first entry it cannot match
        parts = slices.get(match[0].uuid)
        if parts is None:
            chosen.append(replace(match[0], cuda_name=token))
        else:  # a MIG-mode GPU named whole: its slices, each by its own UUID
            chosen += parts
    return chosen


def _csv_gpu(line: str) -> GpuInfo | None:
    fields = [field.strip() for field in line.split(",")]
    if len(fields) < 5:
        return None
    name = ", ".join(fields[2:-2])  # a name could hold a comma; the numbers cannot
    if all(value.strip("[]").upper() == "N/A" for value in fields[-2:]):
        # Unified memory (GB10, Jetson): CUDA's free and total are the host's.
        host = psutil.virtual_memory()
        return GpuInfo(fields[0], name, host.total, host.available, fields[1], "unified memory")
    try:
        total, free = (int(float(value)) * _MIB for value in fields[-2:])
    except ValueError:
        return None
    return GpuInfo(fields[0], name, total, free, fields[1])


def _mig_slices(nvidia_smi: str, gpus: list[GpuInfo]) -> dict[str, list[GpuInfo]]:
    """Each MIG-mode GPU's slices (by the GPU's UUID), with their own memory: the slices from
    ``nvidia-smi -L``, their memory from ``nvidia-smi -q -x`` (unknown when it cannot be
    read: the plan then cannot tell, rather than guess)."""
    listing = run_probe([nvidia_smi, "-L"], _NVIDIA_SMI_TIMEOUT)
    if isinstance(listing, str) or listing.returncode != 0:
        return {}
    found: dict[str, list[tuple[str, str, str]]] = {}  # GPU UUID -> (profile, device, UUID)
    parent = ""
    for line in listing.stdout.splitlines():
        if gpu_line := _LISTED_GPU.match(line):
            parent = gpu_line.group(2)
        elif (mig_line := _LISTED_MIG.match(line)) and parent:
            profile, device, uuid = mig_line.groups()
            found.setdefault(parent, []).append((profile, device, uuid))
    if not found:
        return {}
    query = run_probe([nvidia_smi, "-q", "-x"], _NVIDIA_SMI_TIMEOUT)
    memory = {} if isinstance(query, str) else _mig_memory(query.stdout)
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    slices: dict[str, list[GpuInfo]] = {}
    for parent, listed in found.items():
        whole = by_uuid.get(parent)
        if whole is None:
            continue
        for profile, device, uuid in listed:
            sizes = memory.get((parent, device))
            if sizes is None:
                logger.debug("no memory for MIG slice %s of %s", device, parent)
            slices.setdefault(parent, []).append(
                GpuInfo(
                    f"{whole.index}:{device}",
                    f"{whole.name} MIG {profile}",
                    *(sizes or (0, 0)),
                    uuid,
                    f"MIG {profile} of GPU {whole.index}",
                    memory_known=sizes is not None,
                )
            )
    return slices


def _mig_memory(xml: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(GPU UUID, MIG device index) -> (total, free) bytes, from ``nvidia-smi -q -x``."""
    try:
        root = ElementTree.fromstring(xml)
    except ElementTree.ParseError:
        return {}
    sizes: dict[tuple[str, str], tuple[int, int]] = {}
    for gpu in root.iter("gpu"):
        uuid = (gpu.findtext("uuid") or "").strip()
        for mig in gpu.iter("mig_device"):
            with contextlib.suppress(ValueError, AttributeError):
                total = (mig.findtext("fb_memory_usage/total") or "").split()[0]
                free = (mig.findtext("fb_memory_usage/free") or "").split()[0]
                key = (uuid, (mig.findtext("index") or "").strip())
                sizes[key] = (int(float(total)) * _MIB, int(float(free)) * _MIB)
    return sizes


def visible_gpu_free_bytes() -> list[int] | None:
    """Free memory of each GPU ``visible_gpus`` lists; None without a GPU."""
    gpus = visible_gpus()
    return None if gpus is None else [gpu.free_bytes for gpu in gpus]


def _names_gpu(token: str, gpu: GpuInfo) -> bool:
    # CUDA_VISIBLE_DEVICES takes indices, full UUIDs or unique UUID prefixes (MIG slices by
    # their MIG- UUID).
    if token.startswith(("GPU-", "MIG-")):
        return bool(gpu.uuid) and gpu.uuid.startswith(token)
    return token == gpu.index
