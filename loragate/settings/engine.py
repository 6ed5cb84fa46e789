"""The engine's limits and arguments: LoRA slots, the tool-call parser, parallelism, the
arguments passed through after `--`, and how base-model requests reach it."""

from __future__ import annotations

import sys
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from loragate.engine_flags import ParallelLayout, check_engine_args, parallel_layout
from loragate.settings.serve_option import serve_option

BaseRouting = Literal["auto", "zero-adapter", "direct"]
ExecutorBackend = Literal["mp", "ray", "uni", "external_launcher"]  # vLLM's, config/parallel.py
EngineBootMode = Literal["multiprocess", "single-process"]


class EngineFields(BaseModel):
    max_loras: int = Field(
        default=2, ge=1, description="Adapters in one batch.", json_schema_extra=serve_option()
    )
    max_lora_rank: int = Field(
        default=16, ge=1, description="Largest adapter rank.", json_schema_extra=serve_option()
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        description="Engine-side adapter LRU size.",
        json_schema_extra=serve_option(),
    )
    tool_call_parser: str | None = Field(
        default=None,
        description=(
            "vLLM's tool-call parser (passed with --enable-auto-tool-choice; vLLM 0.32 wants both "
            "for any tool_choice). Default: the model family's parser when its chat template "
            "renders tools, else 'pythonic' (named tool_choice works on any model); 'none': off."
        ),
        json_schema_extra=serve_option(),
    )
    # Parallelism: vLLM's options under vLLM's names. Also accepted after `--`; the preflight
    # reads them either way (``parallel``) and refuses one given both ways, differently.
    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="GPUs each model replica is split over (vLLM's; also accepted after `--`).",
        json_schema_extra=serve_option("--tensor-parallel-size", "-tp"),
    )
    pipeline_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="Pipeline stages, one GPU (group) each (vLLM's; also accepted after `--`).",
        json_schema_extra=serve_option("--pipeline-parallel-size", "-pp"),
    )
    data_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="Model replicas (vLLM's; also accepted after `--`).",
        json_schema_extra=serve_option("--data-parallel-size", "-dp"),
    )
    distributed_executor_backend: ExecutorBackend | None = Field(
        default=None,
        description=(
            "How vLLM runs its workers: 'mp' (processes on this machine) or 'ray' (a Ray "
            "cluster; needs ray in the engine's Python). Default: vLLM's choice."
        ),
        json_schema_extra=serve_option(),
    )
    engine_boot_mode: EngineBootMode = Field(
        default="multiprocess",
        description=(
            "How many processes one engine boot starts. 'multiprocess': vLLM's own choice (on "
            "the CPU build an API server, an engine core and a worker, each importing vLLM). "
            "'single-process': the worker runs inside the engine core "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0 and --distributed-executor-backend uni), one "
            "process fewer and a faster boot on the CPU build, but without vLLM's CPU thread "
            "binding (slower generation); the same as 'multiprocess' on a GPU. Either way the "
            "API server is the engine the supervisor probes, restarts and stops. Ignored when "
            "the engine's environment sets VLLM_ENABLE_V1_MULTIPROCESSING, when an executor "
            "backend is given, and for a parallel layout (tensor, pipeline or data parallel "
            "over 1)."
        ),
        json_schema_extra=serve_option(),
    )
    spare_engine: bool | None = Field(
        default=None,
        description=(
            "Keep one spare engine process that has imported vLLM already and waits for the "
            "next boot (a catalog's cold model, a restart), so that boot costs little more "
            "than loading the weights; it holds the memory of a Python with vLLM imported "
            "(about 0.6 GiB) while it waits, and is spawned again after each boot it took. "
            "Default: on for a catalog of more than one model, off otherwise. Used only for "
            "vLLM's own API server (no engine_command)."
        ),
        json_schema_extra=serve_option(),
    )
    engine_args: list[str] = Field(
        default_factory=list, description="Passed to the engine untouched."
    )
    engine_python: str = Field(default=sys.executable, description="Python that runs vLLM.")
    engine_command: list[str] | None = Field(
        default=None,
        description="Replaces `python -m vllm.entrypoints.openai.api_server` (advanced).",
    )
    base_routing: BaseRouting = Field(
        default="auto",
        description=(
            "How base-model requests reach the engine. 'zero-adapter' routes them through an "
            "all-zero LoRA so the CPU build's slot -1 bug cannot hand them another adapter's "
            "weights; 'auto' does so on the CPU build only, and only when the engine does not "
            "run loragate's fixed CPU LoRA ops (cpu_lora_ops)."
        ),
    )
    cpu_lora_ops: bool = Field(
        default=True,
        description=(
            "On vLLM's CPU build, run loragate's index-safe, slot-grouped LoRA ops in the engine "
            "(a vLLM plugin): base requests go to the engine plainly and adapters need no slot "
            "gate. Off: vLLM's own ops, behind the zero-adapter and slot guards."
        ),
    )

    @field_validator("engine_args")
    @classmethod
    def _engine_args_leave_loragates_flags_alone(cls, value: list[str]) -> list[str]:
        check_engine_args(value)
        return value

    @property
    def parallel(self) -> ParallelLayout:
        """The parallel layout, from the options and the engine arguments after `--`."""
        return parallel_layout(self.engine_args, self.parallel_options())

    def parallel_options(self) -> dict[str, int | str | None]:
        """The parallelism options given before `--`, by vLLM flag name."""
        return {
            "--tensor-parallel-size": self.tensor_parallel_size,
            "--pipeline-parallel-size": self.pipeline_parallel_size,
            "--data-parallel-size": self.data_parallel_size,
            "--distributed-executor-backend": self.distributed_executor_backend,
        }
