"""Where each engine runs and the share of each GPU it boots with, so that vLLM agrees at every
boot: a share no larger than what is free on its GPUs when it starts (less its CUDA context),
and no smaller than what it needs (``need``). Engines that fit beside each other on a GPU get a
share each, together no more than what is free there; the room is counted per GPU, never
summed across GPUs.

In turn (``keep`` models first, then those pinned to their catalog ``devices``, then
``preload`` ones, then the biggest): each engine goes where it fits beside the engines placed
before it (its ``devices``, or the fullest GPUs that still hold it, so an empty GPU is left for
a bigger model), within ``max_loaded_models`` and the memory budget; those are
``resident_at_once``. One that fits only alone on its GPUs is planned alone there (it takes
turns with the others). One that fits nowhere is refused with the flag and value that would
make it fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loragate.plan.gpu.need import (
    SHORTEST_LEN,
    STEP,
    EngineAsk,
    EngineNeed,
    engine_need,
    online_fp8,
    suggested_len,
    without_quantization,
)
from loragate.plan.gpu.vllm_rules import (
    CUDA_CONTEXT_BYTES,
    DRIVER_RESERVE_FRACTION,
    DRIVER_RESERVE_MAX_FRACTION,
    EngineRules,
    share_verdict,
)
from loragate.plan.preflight.machine import GpuInfo
from loragate.plan.preflight.memory import size

_TENSOR_SIZES = (2, 4, 8)


@dataclass
class Placement:
    """One engine's part of the plan; ``fits`` None when its need cannot be told."""

    name: str
    fits: bool | None = None
    reason: str | None = None
    devices: list[int] = field(default_factory=list)  # positions in the plan's GPU list
    share: float | None = None  # the --gpu-memory-utilization it boots with
    resident: bool = False  # one of resident_at_once
    weights_bytes: int | None = None  # the whole model in the served dtype
    kv_cache_bytes: int | None = None  # what vLLM will size, all its GPUs together
    max_model_len: int | None = None
    one_sequence_kv_bytes: int | None = None
    largest_max_model_len: int | None = None  # the longest that fits in its share
    need_bytes: int | None = None  # what the share must hold, on each of its GPUs
    held_bytes: dict[int, int] = field(default_factory=dict)  # per GPU, when it runs
    args: list[str] = field(default_factory=list)  # engine flags the plan adds
    env: dict[str, str] = field(default_factory=dict)  # CUDA_VISIBLE_DEVICES
    argv: list[str] = field(default_factory=list)  # the engine arguments that size it
    warnings: list[str] = field(default_factory=list)  # what may still stop vLLM at boot

    @property
    def share_is_users(self) -> bool:
        """The share is the user's --gpu-memory-utilization, not one the plan chose."""
        return self.share is not None and "--gpu-memory-utilization" not in self.args

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "fits": self.fits,
            "reason": self.reason,
            "devices": self.devices,
            "gpu_memory_utilization": self.share,
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "max_model_len": self.max_model_len,
            "argv": self.argv,
            "args": self.args,
            "env": self.env,
            "resident": self.resident,
            "need_bytes_per_gpu": self.need_bytes,
            "one_sequence_kv_bytes": self.one_sequence_kv_bytes,
            "largest_max_model_len": self.largest_max_model_len,
            "cuda_context_bytes": CUDA_CONTEXT_BYTES if self.fits else None,
            "held_bytes": {str(k): v for k, v in self.held_bytes.items()},
            "warnings": self.warnings,
        }


@dataclass
class GpuPlan:
    """Every engine's placement, and which can be resident together. No GPUs: the CPU
    build's plan of ``host_bytes`` of host memory."""

    gpus: list[GpuInfo]
    engines: list[Placement]
    resident_at_once: list[str]
    rules: EngineRules
    host_bytes: int | None = None

    def engine(self, name: str) -> Placement | None:
        return next((p for p in self.engines if p.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        """What ``gateway plan --json`` prints; scripts read this shape."""
        return {
            "engines": [placement.as_dict() for placement in self.engines],
            "resident_at_once": self.resident_at_once,
            "gpus": [
                {
                    "number": n,  # what devices (and a catalog's devices:) name
                    "index": gpu.index,  # nvidia-smi's
                    "name": gpu.name,
                    "note": gpu.note or None,
                    # null: nvidia-smi did not say (a MIG slice's memory unread)
                    "total_bytes": gpu.total_bytes if gpu.memory_known else None,
                    "free_bytes": gpu.free_bytes if gpu.memory_known else None,
                }
                for n, gpu in enumerate(self.gpus)
            ],
            "host_bytes": self.host_bytes,
            "vllm": self.rules.describe(),
            "quantization_methods": list(self.rules.quantization),
        }


@dataclass
class _Device:
    position: int
    gpu: GpuInfo
    # (engine index, its need, its least share) of each engine resident here
    members: list[tuple[int, EngineNeed, int]] = field(default_factory=list)

    def room(self, engines: int) -> int:
        """The most (thousandths) ``engines`` may take together: what is free less a CUDA
        context each, over the total vLLM multiplies the share by."""
        free = self.gpu.free_bytes - engines * CUDA_CONTEXT_BYTES
        return max(0, free * STEP // max(self.gpu.total_bytes, 1))

    def left_for(self, least: int) -> int:
        """What would be left if one more engine needing ``least`` joined; negative: none."""
        taken = sum(share for _, _, share in self.members) + least
        return self.room(len(self.members) + 1) - taken

    def describe(self) -> str:
        return (
            f"GPU {self.position} ({self.gpu.name}, {size(self.gpu.total_bytes)}, "
            f"{size(self.gpu.free_bytes)} free)"
        )


def plan_gpus(
    asks: Sequence[EngineAsk],
    gpus: Sequence[GpuInfo],
    rules: EngineRules,
    *,
    max_loaded: int | None = None,
    budget: int | None = None,
) -> GpuPlan:
    """The plan for ``asks`` on ``gpus``; ``budget`` caps what the resident engines hold of
    all GPUs together (the catalog's ``memory_budget``, when set)."""
    devices = [_Device(position, gpu) for position, gpu in enumerate(gpus)]
    default = round(rules.default_share * STEP)
    placements = [Placement(ask.name) for ask in asks]
    needs = [engine_need(ask, rules) for ask in asks]
    order = sorted(range(len(asks)), key=lambda i: _placing_order(asks[i], needs[i], i))
    alone: dict[int, tuple[list[_Device], int]] = {}
    resident: list[int] = []
    held = 0
    for i in order:
        ask, need, placement = asks[i], needs[i], placements[i]
        if isinstance(need, str):
            placement.fits = None if need.startswith("cannot tell") else False
            placement.reason = need
            if placement.fits is False:
                placement.reason = _with_fp8_instead(need, ask, devices, rules)
            continue
        placement.weights_bytes = need.memory.weights_bytes
        placement.max_model_len = need.max_model_len
        candidates = _candidates(ask, devices)
        if isinstance(candidates, str):
            placement.fits, placement.reason = False, candidates
            continue
        known = [d for d in candidates if d.gpu.memory_known]
        if need.kv_known and known:
            placement.one_sequence_kv_bytes = need.one_sequence_on(known[0].gpu)
        fitted = _fit_alone(need, known, default) if len(known) >= ask.gpu_count else None
        if fitted is None and len(known) < len(candidates):
            placement.reason = _unread(ask, candidates)
            continue
        if fitted is None:
            placement.fits = False
            placement.reason = _refusal(need, candidates, devices, rules)
            continue
        if not need.kv_known:  # the weights fit; the KV cache cannot be sized
            said = need.describe_need(fitted[0][0].gpu)
            placement.reason = f"cannot tell whether {ask.name} fits: {said}"
            continue
        placement.fits = True
        alone[i] = fitted
        chosen = _fit_beside(need, known)
        cost = sum(_held(d.gpu, chosen[1]) for d in chosen[0]) if chosen else 0
        room_left = (max_loaded is None or len(resident) < max_loaded) and (
            budget is None or held + cost <= budget
        )
        if chosen is not None and room_left:
            for device in chosen[0]:
                device.members.append((i, need, chosen[1]))
            resident.append(i)
            held += cost
            placements[i].devices = [d.position for d in chosen[0]]
        else:
            placements[i].devices = [d.position for d in fitted[0]]
    shares = _split(devices, default)
    if budget is not None:
        shares = _within_budget(shares, devices, budget)
    for i, placement in enumerate(placements):
        need = needs[i]
        if not placement.fits or isinstance(need, str):
            continue
        used = [devices[p] for p in placement.devices]
        share = min(shares[(p, i)] for p in placement.devices) if i in resident else alone[i][1]
        _fill(placement, need, used, share, resident=i in resident)
    return GpuPlan(list(gpus), placements, [asks[i].name for i in sorted(resident)], rules)


def gpu_room(gpus: Sequence[GpuInfo]) -> dict[int, int]:
    """Each GPU's room for a catalog's engines: free at the gateway's start, never summed
    across GPUs; none for one whose memory is unknown (nothing is refused or placed there)."""
    return {number: gpu.free_bytes for number, gpu in enumerate(gpus) if gpu.memory_known}


def fits_on_gpus(
    needs: Mapping[int, int], taken: Iterable[Mapping[int, int]], room: Mapping[int, int]
) -> bool:
    """Whether an engine holding ``needs`` (bytes by GPU number: a placement's
    ``held_bytes``) fits beside engines holding ``taken``, on each GPU it uses with a room."""
    used: dict[int, int] = {}
    for held in taken:
        for number, nbytes in held.items():
            used[number] = used.get(number, 0) + nbytes
    return all(used.get(n, 0) + nbytes <= room[n] for n, nbytes in needs.items() if n in room)


def boot_refusal(placement: Placement, gpus: Sequence[GpuInfo]) -> str | None:
    """Why vLLM would refuse the planned engine if it booted now (``gpus`` as nvidia-smi
    lists them now): its share of one of its GPUs is more than is free there, less its CUDA
    context (a share of the user's own: only when vLLM's check surely fails). None when it
    would start, or a GPU's memory is not known."""
    for number in placement.devices:
        if placement.share is None or number >= len(gpus):
            return None
        gpu = gpus[number]
        if not gpu.memory_known:
            continue
        wanted = placement.share * gpu.total_bytes + CUDA_CONTEXT_BYTES
        if placement.share_is_users:  # only what vLLM's own check surely refuses
            if share_verdict(placement.share, gpu.total_bytes, gpu.free_bytes) != "refused":
                continue
        elif wanted <= gpu.free_bytes:
            continue
        return (
            f"{placement.name} boots with --gpu-memory-utilization {placement.share:g} of "
            f"GPU {number} ({size(wanted)} with its CUDA context), and only "
            f"{size(gpu.free_bytes)} is free there now: vLLM would refuse to start; free "
            "that GPU's memory (another program holds it), or plan again (gateway plan)"
        )
    return None


def _candidates(ask: EngineAsk, devices: list[_Device]) -> list[_Device] | str:
    """The GPUs ``ask`` may run on, or why none can hold its layout: an engine of several
    workers never runs on MIG slices, since CUDA shows a process one MIG slice at most."""
    count = ask.gpu_count
    if count > 1:
        named = [d for d in devices if ask.devices is None or d.position in ask.devices]
        slices = [d for d in named if d.gpu.is_mig]
        whole = [d for d in devices if not d.gpu.is_mig]
        if slices and (ask.devices is not None or len(whole) < count):
            return (
                f"{ask.layout.describe()} needs {count} GPUs, and MIG slices cannot be among "
                f"them: CUDA shows a process one MIG slice at most (GPU {slices[0].position} "
                f"is {slices[0].gpu.note or 'a MIG slice'}); this machine has {len(whole)} GPU"
                f"{'s' if len(whole) != 1 else ''} not in MIG mode. Run it on one slice "
                "(--tensor-parallel-size 1), or on GPUs not in MIG mode"
            )
        if ask.devices is None:
            devices = whole
    if ask.devices is not None:
        missing = [d for d in ask.devices if not 0 <= d < len(devices)]
        if missing:
            return (
                f"devices {list(ask.devices)} names GPU {missing[0]}, but this machine has "
                f"{len(devices)} (0 to {len(devices) - 1}): name GPUs from `gateway plan`'s list"
            )
        if len(ask.devices) != count:
            return (
                f"devices {list(ask.devices)} names {len(ask.devices)} GPU(s), but its engine "
                f"runs {count} worker(s) ({ask.layout.describe()}): name {count}"
            )
        return [devices[d] for d in ask.devices]
    if count > len(devices):
        return (
            f"{ask.layout.describe()} needs {count} GPUs and this machine has {len(devices)}: "
            f"lower --tensor-parallel-size to {len(devices)} or less"
        )
    return devices


def _unread(ask: EngineAsk, candidates: list[_Device]) -> str:
    unread = [d for d in candidates if not d.gpu.memory_known]
    names = ", ".join(f"GPU {d.position} ({d.gpu.note or d.gpu.name})" for d in unread)
    return (
        f"cannot tell whether {ask.name} fits: nvidia-smi does not say how much memory {names} "
        "has (nvidia-smi -q -x gives no memory for it), and it does not fit on the others"
    )


def _least(need: EngineNeed, used: Sequence[_Device]) -> int:
    """The share (thousandths) ``need`` boots with at the least on ``used``: the user's, or
    what holds its need on the neediest of them."""
    if need.share_given is not None:
        return round(need.share_given * STEP)
    return max(need.least_share_on(d.gpu) for d in used)


def _fits_share(need: EngineNeed, used: Sequence[_Device], share: int) -> bool:
    return share >= max(need.least_share_on(d.gpu) for d in used)


def _fit_alone(
    need: EngineNeed, candidates: list[_Device], default: int
) -> tuple[list[_Device], int] | None:
    """The GPUs with the most room where ``need`` fits on its own, and the share it takes
    there: as much as vLLM's default (or what it needs, above that), never more than is
    free; with --kv-cache-memory-bytes, just what it needs (vLLM ignores the rest)."""
    used = sorted(candidates, key=lambda d: -d.room(1))[: need.ask.gpu_count]
    if len(used) < need.ask.gpu_count:
        return None
    least, room = _least(need, used), min(d.room(1) for d in used)
    if not _fits_share(need, used, least):
        return None
    if need.share_given is not None:  # the user's: refused only where vLLM surely refuses it
        verdicts = [share_verdict(need.share_given, d.gpu.total_bytes, d.gpu.free_bytes)
                    for d in used]  # fmt: skip
        return None if "refused" in verdicts else (used, least)
    if least > room:
        return None
    if need.kv_given is not None:
        return used, least
    return used, min(room, max(least, default))


def _placing_order(ask: EngineAsk, need: EngineNeed | str, index: int) -> tuple[Any, ...]:
    """Who is placed first: ``keep`` models (they are never unloaded), then those pinned to
    their ``devices`` (they have no choice), then ``preload`` ones, then the biggest first
    (small ones fill the gaps the big ones leave), in catalog order at equal size."""
    size_of = 0 if isinstance(need, str) else need.weights_per_gpu
    return (not ask.keep, ask.devices is None, not ask.preload, -size_of, index)


def _fit_beside(need: EngineNeed, candidates: list[_Device]) -> tuple[list[_Device], int] | None:
    """The GPUs where ``need`` fits beside the engines already there, the fullest that still
    hold it first (so that a GPU left empty can take a bigger model), and the least share it
    needs there."""
    fitting = [d for d in candidates if d.left_for(need.least_share_on(d.gpu)) >= 0]
    used = sorted(fitting, key=lambda d: d.left_for(need.least_share_on(d.gpu)))
    used = used[: need.ask.gpu_count]
    if len(used) < need.ask.gpu_count:
        return None
    least = _least(need, used)
    if not _fits_share(need, used, least) or any(d.left_for(least) < 0 for d in used):
        return None
    return used, least


def _split(devices: list[_Device], default: int) -> dict[tuple[int, int], int]:
    """Each resident engine's share on each of its GPUs, by (GPU, engine): its least, plus a
    part of what is left there in proportion to it (an engine with a share or a KV cache
    size of its own keeps just that), the GPU's engines together within vLLM's default
    share (``default``, thousandths) unless they need more, and within what is free."""
    shares: dict[tuple[int, int], int] = {}
    for device in devices:
        if not device.members:
            continue
        least_total = sum(share for _, _, share in device.members)
        cap = min(device.room(len(device.members)), max(least_total, default))
        growing = {
            index: share
            for index, need, share in device.members
            if need.share_given is None and need.kv_given is None
        }
        base = sum(growing.values())
        for index, _, share in device.members:
            extra = (cap - least_total) * share // base if index in growing else 0
            shares[(device.position, index)] = share + extra
    return shares


def _within_budget(
    shares: dict[tuple[int, int], int], devices: list[_Device], budget: int
) -> dict[tuple[int, int], int]:
    """The split's shares, each engine's part of what was left cut by the same fraction so
    that the resident engines hold no more than ``budget`` of all GPUs together."""
    least = {(d.position, index): share for d in devices for index, _, share in d.members}
    floor = sum(_held(devices[p].gpu, share) for (p, _), share in least.items())
    grown = sum(_held(devices[p].gpu, share) for (p, _), share in shares.items())
    if grown <= budget or grown == floor:
        return shares
    fraction = max(0.0, (budget - floor) / (grown - floor))
    return {key: least[key] + int((share - least[key]) * fraction) for key, share in shares.items()}


def _held(gpu: GpuInfo, share: int) -> int:
    """What an engine holds of ``gpu`` when it runs: its CUDA context and its share."""
    return CUDA_CONTEXT_BYTES + gpu.total_bytes * share // STEP


def _fill(
    placement: Placement, need: EngineNeed, used: list[_Device], share: int, *, resident: bool
) -> None:
    placement.resident = resident
    placement.share = share / STEP
    placement.need_bytes = max(need.need_on(d.gpu) for d in used)
    placement.one_sequence_kv_bytes = max(need.one_sequence_on(d.gpu) for d in used)
    kv_room = min(need.kv_in_share(d.gpu, share) for d in used)
    placement.kv_cache_bytes = kv_room * len(used)
    placement.largest_max_model_len = min(need.longest_len(kv_room, d.gpu) for d in used)
    if need.auto_len:
        placement.max_model_len = placement.largest_max_model_len
    placement.held_bytes = {d.position: _held(d.gpu, share) for d in used}
    if need.share_given is None:
        placement.args = ["--gpu-memory-utilization", f"{share / STEP:g}"]
    else:
        placement.warnings = [
            _share_warning(need.share_given, d)
            for d in used
            if share_verdict(need.share_given, d.gpu.total_bytes, d.gpu.free_bytes) == "unsure"
        ]
    placement.env = {"CUDA_VISIBLE_DEVICES": ",".join(_cuda_name(d) for d in used)}
    ask = need.ask
    placement.argv = [
        "--model", str(ask.model_dir), "--enable-lora", "--max-loras", str(ask.lora_slots),
        "--max-lora-rank", str(ask.lora_rank), *placement.args, *ask.engine_args,
    ]  # fmt: skip


def _cuda_name(device: _Device) -> str:
    """How CUDA_VISIBLE_DEVICES names the GPU: the user's own entry when the user set it (an
    index means what CUDA's device order makes it mean), else its UUID (the same GPU whatever
    that order), else its position."""
    return device.gpu.cuda_name or device.gpu.uuid or str(device.position)


def _share_warning(share: float, device: _Device) -> str:
    gpu = device.gpu
    least = share * gpu.total_bytes * (1 - DRIVER_RESERVE_MAX_FRACTION)
    return (
        f"--gpu-memory-utilization {share:g} asks vLLM for {size(share * gpu.total_bytes)} of "
        f"{device.describe()}, or {size(least)} if the driver keeps back 2% of it: vLLM starts "
        "only if that much is still free once its CUDA context (up to "
        f"{size(CUDA_CONTEXT_BYTES)}) is made; a lower share is surer"
    )


# ----- refusals: what is short, and the flag and value that would fit ----------------------


def _refusal(
    need: EngineNeed, candidates: list[_Device], devices: list[_Device], rules: EngineRules
) -> str:
    used = sorted(candidates, key=lambda d: -d.room(1))[: need.ask.gpu_count]
    tightest = min(used, key=lambda d: d.room(1))
    gpu = tightest.gpu
    where = tightest.describe()
    if len(used) > 1:
        where = (
            f"each of the {len(used)} GPUs {need.ask.layout.describe()} spreads it over (the "
            f"tightest: {where})"
        )
    head = f"{need.ask.name} needs {size(need.need_on(gpu))} on {where}: {need.describe_need(gpu)}"
    room = tightest.room(1)
    free = gpu.free_bytes - CUDA_CONTEXT_BYTES
    given = need.share_given
    if given is not None and share_verdict(given, gpu.total_bytes, gpu.free_bytes) == "refused":
        at_least = gpu.total_bytes * given * (1 - DRIVER_RESERVE_MAX_FRACTION)
        lack = (
            f"but --gpu-memory-utilization {given:g} asks vLLM for {size(gpu.total_bytes * given)}"
            f" (at least {size(at_least)} of the total torch counts, which leaves out what the "
            f"driver keeps back) and only {size(gpu.free_bytes)} is free there, so vLLM refuses "
            "to start"
        )
    elif given is not None:
        lack = f"but --gpu-memory-utilization {given:g} gives it {size(gpu.total_bytes * given)}"
    else:
        lack = (
            f"but vLLM may take at most {size(max(free, 0))} there (what is free less "
            f"{size(CUDA_CONTEXT_BYTES)} of CUDA context: --gpu-memory-utilization {room / STEP:g})"
        )
    fix = _what_fits(need, candidates, devices, rules)
    if fix is not None:
        return f"{head}; {lack}. It fits with {' '.join(fix)} ({need.ask.flags_at})."
    biggest = max(d.gpu.free_bytes for d in devices)
    wanted = size(need.need_on(gpu) + CUDA_CONTEXT_BYTES)
    gpus = "a GPU" if len(used) == 1 else f"{len(used)} GPUs"
    return (
        f"{head}; {lack}. Nothing here holds it (the most free on a GPU is {size(biggest)}): it "
        f"needs {gpus} with {wanted} free{' each' if len(used) > 1 else ''}, or a smaller or "
        "quantized model."
    )


def _what_fits(
    need: EngineNeed,
    candidates: list[_Device],
    devices: list[_Device],
    rules: EngineRules,
    *,
    depth: int = 0,
) -> list[str] | None:
    """The flags (with values) that make ``need`` fit alone on ``candidates``, tried in the
    order a person would: the share, the length, fp8 weights, tensor parallelism."""
    ask = need.ask
    used = sorted(candidates, key=lambda d: -d.room(1))[: ask.gpu_count]
    room = min(d.room(1) for d in used)
    if need.share_given is not None:
        least = max(need.least_share_on(d.gpu) for d in used)
        if least <= room:
            share = min(room, max(least, round(rules.default_share * STEP)))
            return ["--gpu-memory-utilization", f"{share / STEP:g}"]
    usable = min(
        int(d.gpu.total_bytes * (1 - DRIVER_RESERVE_FRACTION)) * room // STEP - need.fixed_on(d.gpu)
        for d in used
    )
    gpu = min(used, key=lambda d: d.room(1)).gpu
    wanted = need.sequence_need_on(gpu)
    if need.kv_given is not None and need.kv_known and need.kv_given < wanted:
        if wanted <= usable:
            return ["--kv-cache-memory-bytes", str(wanted)]
        tokens = suggested_len(need.longest_len(need.kv_given, gpu))
        if tokens >= SHORTEST_LEN:
            return ["--max-model-len", str(tokens)]
    tokens = suggested_len(need.longest_len(usable, gpu))
    if need.kv_given is None and not need.auto_len and tokens >= SHORTEST_LEN:
        # A share of the user's own must grow to what is free, too.
        grown = [] if need.share_given is None else ["--gpu-memory-utilization", f"{room / STEP:g}"]
        return [*grown, "--max-model-len", str(tokens)]
    if depth:
        return None
    fp8 = online_fp8(rules)
    if fp8 is not None and need.memory.quantization is None:
        fixed = _try(need.ask.with_args("--quantization", fp8), candidates, devices, rules)
        if fixed is not None:
            return ["--quantization", fp8, *fixed]
    if ask.devices is None:
        wider_sizes = (t for t in _TENSOR_SIZES if t > ask.layout.tensor)
        for tensor in (
            t for t in wider_sizes if t * ask.gpu_count // ask.layout.tensor <= len(devices)
        ):
            if need.shape is not None and need.shape.heads % tensor:
                continue
            wider = replace(ask, layout=replace(ask.layout, tensor=tensor))
            fixed = _try(wider, devices, devices, rules)
            if fixed is not None:
                return ["--tensor-parallel-size", str(tensor), *fixed]
    return None


def _with_fp8_instead(
    reason: str, ask: EngineAsk, devices: list[_Device], rules: EngineRules
) -> str:
    """A quantization refusal, with what fits instead: fp8 weights (and the length)."""
    fp8 = online_fp8(rules)
    if fp8 is None or not devices:
        return reason + "."
    plain = without_quantization(ask)
    candidates = _candidates(plain, devices)
    fixed = None
    if not isinstance(candidates, str):
        fixed = _try(plain.with_args("--quantization", fp8), candidates, devices, rules)
    if fixed is None:
        return reason + "."
    return f"{reason}. It fits with {' '.join(['--quantization', fp8, *fixed])} ({ask.flags_at})."


def _try(
    ask: EngineAsk, candidates: list[_Device], devices: list[_Device], rules: EngineRules
) -> list[str] | None:
    """[] when ``ask`` fits as it is, the flags that make it fit, or None."""
    need = engine_need(ask, rules)
    if isinstance(need, str) or ask.gpu_count > len(candidates):
        return None
    if _fit_alone(need, candidates, round(rules.default_share * STEP)) is not None:
        return []
    return _what_fits(need, candidates, devices, rules, depth=1)
