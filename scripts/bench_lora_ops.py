"""Microbenchmark: vLLM's torch LoRA ops against loragate's engine plugin ops, on the CPU.

Calls the sgmv ops the way vLLM's CPU punica wrapper does (vLLM V1 always takes the prefill
path): LoRA A stacked ``[slots, 1, rank, in]``, a float32 shrink buffer, LoRA B stacked
``[slots, 1, out, rank]``, the expand written into a slice of the output with add_inputs.
Shapes default to SmolLM2-135M (hidden 576, MLP 1536) with rank 8 and two slots.

    python scripts/bench_lora_ops.py [--tokens 1 4 16 40 128 512] [--repeats 200]

Prints the median CPU microseconds per call (one torch thread), old and new, and the speed-up; and whether the two agree
on tokens with an adapter (they must) and on tokens without one (vLLM's do not: that is the bug).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from loragate.engine_plugin import cpu_lora_ops


def sgmv_meta(indices: torch.Tensor) -> tuple:
    # As vLLM's compute_meta: consecutive tokens of one slot form a sequence.
    slots, lengths = torch.unique_consecutive(indices, return_counts=True)
    starts = torch.zeros_like(lengths)
    starts[1:] = torch.cumsum(lengths, 0)[:-1]
    return starts, lengths, slots, len(slots), int(lengths.max()), int(lengths.sum())


def token_slots(tokens: int, mix: str) -> torch.Tensor:
    if mix == "one adapter":
        return torch.zeros(tokens, dtype=torch.long)
    # Four requests in a row: adapter 0, base, adapter 1, adapter 0 (decode: one token each).
    pattern = torch.tensor([0, -1, 1, 0])
    return pattern.repeat_interleave(max(1, tokens // 4)).repeat(4)[:tokens]


def paired_median_us(
    old: Callable[..., None], new: Callable[..., None], args: tuple, repeats: int
) -> tuple[float, float]:
    """Median microseconds per call of each op: CPU time of this thread (torch runs on one), in
    alternating order, so that time spent waiting for a shared CPU counts for neither."""
    for _ in range(max(3, repeats // 10)):
        old(*args)
        new(*args)
    times: dict[Callable[..., None], list[int]] = {old: [], new: []}
    for repeat in range(repeats):
        for op in (old, new) if repeat % 2 else (new, old):
            start = time.thread_time_ns()
            op(*args)
            times[op].append(time.thread_time_ns() - start)
    return statistics.median(times[old]) / 1e3, statistics.median(times[new]) / 1e3


def cases(tokens: int, mix: str, hidden: int, mlp: int, rank: int, slots: int):
    """(label, op name, a fresh output, the arguments before the output, those after it)."""
    gen = torch.Generator().manual_seed(tokens)
    meta = sgmv_meta(token_slots(tokens, mix))
    x = torch.randn(tokens, hidden, generator=gen)
    lora_a = torch.randn(slots, 1, rank, hidden, generator=gen)
    yield (
        f"shrink {hidden}->{rank}",
        "sgmv_shrink",
        lambda: torch.zeros(tokens, rank),
        (x, lora_a),
        (*meta, 0.5),
    )
    buffer = torch.randn(tokens, rank, generator=gen)
    for out in (hidden, mlp):
        lora_b = torch.randn(slots, 1, out, rank, generator=gen)
        y = torch.randn(tokens, out, generator=gen)
        yield (
            f"expand {rank}->{out}",
            "sgmv_expand_slice",
            y.clone,
            (buffer, lora_b),
            (*meta, 0, out, True),
        )


def row(*cells: object) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 40, 128, 512])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--mlp", type=int, default=1536)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vllm.lora.ops.torch_ops import lora_ops as vllm_ops

    print(f"torch {torch.__version__}, one thread, median CPU time of {args.repeats} calls")
    print(
        row("op", "tokens", "batch", "vLLM us", "ours us", "speed-up", "adapter rows", "base rows")
    )
    print(row("---", "---:", "---", "---:", "---:", "---:", "---", "---"))
    for mix in ("one adapter", "mixed"):
        for tokens in args.tokens:
            has_adapter = token_slots(tokens, mix) >= 0
            for label, op, make_output, before, after in cases(
                tokens, mix, args.hidden, args.mlp, args.rank, args.slots
            ):
                old, new = getattr(vllm_ops, op), getattr(cpu_lora_ops, op)
                scratch = make_output()
                old_us, new_us = paired_median_us(
                    old, new, (*before, scratch, *after), args.repeats
                )
                theirs, ours = make_output(), make_output()
                old(*before, theirs, *after)
                new(*before, ours, *after)
                agree = torch.allclose(theirs[has_adapter], ours[has_adapter], rtol=1e-4, atol=1e-4)
                if has_adapter.all():
                    base = "-"
                else:
                    base = (
                        "same"
                        if torch.equal(theirs[~has_adapter], ours[~has_adapter])
                        else "differ"
                    )
                print(
                    row(
                        label,
                        tokens,
                        mix,
                        f"{old_us:.1f}",
                        f"{new_us:.1f}",
                        f"{old_us / new_us:.1f}x",
                        "agree" if agree else "DIFFER",
                        base,
                    )
                )


if __name__ == "__main__":
    main()
