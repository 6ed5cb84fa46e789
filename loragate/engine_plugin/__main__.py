"""``python -m loragate.engine_plugin``: would an engine started from this interpreter get the ops?

Prints one line and exits 0 when it would, 1 (with the reason) when it would not. Checks the
environment as it is, so prefix the engine's variables: ``LORAGATE_CPU_LORA_OPS=1 python -m ...``.
"""

from __future__ import annotations

import sys

from loragate.engine_plugin import engine_check


def main() -> int:
    reason = engine_check()
    if reason is None:
        print("loragate: an engine started here gets the CPU LoRA ops (index-safe, slot-grouped)")
        return 0
    print(f"loragate: CPU LoRA ops would not be patched: {reason}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
