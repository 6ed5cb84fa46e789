"""Convert adapters from the formats people train in to the PEFT layout vLLM loads.

Supported inputs (``detect_format`` names them), one module each where they need work:

- ``peft``: ``adapter_config.json`` + ``adapter_model.safetensors``; keys with the PEFT
  adapter name inside (``.lora_A.default.weight``) are renamed, the config completed.
- ``peft-bin`` (``peft_bin``): an old PEFT save, ``adapter_model.bin`` (a torch pickle, read
  with ``weights_only=True`` so it cannot run code).
- ``tinker`` (``tinker``): Tinker's export: PEFT-like keys, the unembedding LoRA named
  ``model.unembed_tokens``, MoE experts as 3-D ``mlp.experts.w1|w2|w3`` tensors, and a
  config that often holds only ``r`` and ``lora_alpha``.
- ``mlx`` (``mlx``): ``adapters.safetensors`` with ``lora_a`` (in, r) / ``lora_b`` (r, out)
  keys and ``lora_parameters {rank, scale}`` in ``adapter_config.json``.
- ``vi-run``: a Datature Vi training run directory; its ``model_adapter/`` is converted.

``detect`` tells the layouts apart, ``to_peft`` writes the result (exactly
``adapter_config.json`` + ``adapter_model.safetensors``, the config from ``peft_config``).
torch and safetensors are imported only inside the functions that need them; the gateway calls
``convert_in_subprocess`` (``child_process``) so that its own process never imports torch.
"""

from loragate.adapters.intake.convert.child_process import convert_in_subprocess
from loragate.adapters.intake.convert.detect import FORMATS, detect_format, needs_conversion
from loragate.adapters.intake.convert.errors import ConversionError
from loragate.adapters.intake.convert.peft_config import build_peft_config
from loragate.adapters.intake.convert.to_peft import convert_to_peft

__all__ = [
    "FORMATS",
    "ConversionError",
    "build_peft_config",
    "convert_in_subprocess",
    "convert_to_peft",
    "detect_format",
    "needs_conversion",
]
