"""Index-safe, slot-grouped replacements for vLLM's torch LoRA ops (``vllm.lora.ops.torch_ops``).

The originals gather one weight matrix per token, ``lora_b_weights[lora_indices_tensor]``, and
run one einsum over the gathered stack. Two problems follow:

- a token with no adapter carries slot index -1, which Python indexing turns into the *last*
  slot, so a base-model token gets the last adapter's delta (requests borrow an adapter);
- the gather materialises a ``[tokens, out, in]`` tensor on every call, which is what makes
  LoRA about 3x slower than the base model on the CPU build.

These ops group tokens by slot and run one matmul per slot present. A token with index -1 gets
no contribution: where an op accumulates (``add_inputs=True``) its output row is not touched;
where an op overwrites (the shrink ops; expand with ``add_inputs=False``) its row gets the zero
delta. That matches the GPU (Triton) kernels, which skip index -1, on every buffer vLLM actually passes
(it zeroes them first). Everything else follows the originals: signatures and defaults, the
output dtype as compute dtype, ``scaling``, ``add_inputs``, the slice offsets, the expand ops'
padding rules (``common_len`` and the single-row broadcast) and the sgmv ops' expansion of
per-sequence indices over ``seq_len_tensor``.

This module imports only torch; the plugin imports it only once it has decided to patch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

OP_NAMES = (
    "bgmv_expand",
    "bgmv_expand_slice",
    "bgmv_shrink",
    "sgmv_expand",
    "sgmv_expand_slice",
    "sgmv_shrink",
)

# The rows of one slot's tokens: a slice when they are one contiguous run (a view, no copy),
# else an index tensor.
Rows = slice | torch.Tensor
# (slot, first token, end token) of consecutive tokens with one slot.
Run = tuple[int, int, int]


@dataclass
class _Tokens:
    """The tokens of one call, grouped by the adapter slot they use."""

    count: int
    by_slot: list[tuple[int, Rows]]  # slots >= 0
    no_adapter: list[Rows]  # index -1, empty or one entry

    @property
    def one_slot_for_all(self) -> int | None:
        if len(self.by_slot) == 1 and not self.no_adapter:
            slot, rows = self.by_slot[0]
            if isinstance(rows, slice):
                return slot
        return None


def _weights_3d(weights: torch.Tensor) -> torch.Tensor:
    # vLLM stacks LoRA weights as [slots, 1, out, in]; the originals squeeze that dim after the
    # gather, we squeeze it before (a view, no copy).
    if weights.dim() == 4 and weights.shape[1] == 1:
        weights = weights.squeeze(1)
    if weights.dim() != 3:
        raise ValueError(
            f"LoRA weights must be [slots, out, in] or [slots, 1, out, in], got {tuple(weights.shape)}"
        )
    return weights


def _token_runs(indices: torch.Tensor) -> list[Run]:
    # On the CPU a Python pass beats torch's small-tensor ops; bgmv gets one token per request.
    runs: list[Run] = []
    for token, slot in enumerate(indices.reshape(-1).tolist()):
        if runs and runs[-1][0] == slot:
            runs[-1] = (slot, runs[-1][1], token + 1)
        else:
            runs.append((slot, token, token + 1))
    return runs


def _sequence_runs(lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor) -> list[Run]:
    # The sgmv layout, read as the originals' repeat_interleave reads it: sequences back to back.
    runs: list[Run] = []
    start = 0
    for slot, length in zip(lora_indices_tensor.tolist(), seq_len_tensor.tolist(), strict=True):
        if length > 0:
            runs.append((slot, start, start + length))
            start += length
    return runs


def _group(
    inputs: torch.Tensor, runs: list[Run], token_slots: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, _Tokens]:
    """Inputs with one row per token (broadcast as the originals' einsum does) and the tokens
    grouped by slot. ``token_slots`` gives every token's slot, asked for only when a slot's
    tokens are not one contiguous run."""
    count = runs[-1][2] if runs else 0
    rows = inputs.shape[0]
    if rows != count:
        if rows == 1:
            inputs = inputs.expand(count, -1)
        elif count == 1:
            slot = runs[0][0]
            runs, count = [(slot, 0, rows)], rows
        else:
            raise RuntimeError(f"{rows} input rows do not match {count} LoRA indices")
    spans: dict[int, list[tuple[int, int]]] = {}
    for slot, start, end in runs:
        slot_spans = spans.setdefault(slot, [])
        if slot_spans and slot_spans[-1][1] == start:
            slot_spans[-1] = (slot_spans[-1][0], end)
        else:
            slot_spans.append((start, end))
    tokens = _Tokens(count, [], [])
    exploded: torch.Tensor | None = None
    for slot, slot_spans in spans.items():
        if len(slot_spans) == 1:
            rows_of_slot: Rows = slice(*slot_spans[0])
        else:
            if exploded is None:
                exploded = token_slots().reshape(-1)
            rows_of_slot = torch.nonzero(exploded == slot).squeeze(1)
        if slot < 0:
            tokens.no_adapter.append(rows_of_slot)
        else:
            tokens.by_slot.append((slot, rows_of_slot))
    return inputs, tokens


def _read(inputs: torch.Tensor, rows: Rows) -> torch.Tensor:
    return inputs[rows] if isinstance(rows, slice) else inputs.index_select(0, rows)


def _write(target: torch.Tensor, rows: Rows, values: torch.Tensor, accumulate: bool) -> None:
    if isinstance(rows, slice):
        if accumulate:
            target[rows].add_(values)
        else:
            target[rows].copy_(values)
    elif accumulate:
        target.index_add_(0, rows, values)
    else:
        target.index_copy_(0, rows, values)


def _clear(target: torch.Tensor, rows: Rows) -> None:
    if isinstance(rows, slice):
        target[rows].zero_()
    else:
        target.index_fill_(0, rows, 0)


def _apply(
    target: torch.Tensor,
    inputs: torch.Tensor,
    weights: torch.Tensor,
    tokens: _Tokens,
    add_inputs: bool,
) -> None:
    """``target[t] (+)= inputs[t] @ weights[slot of t].T``, one matmul per slot present.

    ``target`` has one row per token and as many columns as it takes from each product; a token
    with index -1 gets no contribution: untouched when accumulating, zero when overwriting.
    """
    dtype = target.dtype
    out_features = target.shape[1]
    for slot, rows in tokens.by_slot:
        weight = weights[slot, :out_features].to(dtype)
        _write(target, rows, torch.nn.functional.linear(_read(inputs, rows), weight), add_inputs)
    if not add_inputs:
        for rows in tokens.no_adapter:
            _clear(target, rows)


def _products(
    inputs: torch.Tensor, weights: torch.Tensor, tokens: _Tokens, dtype: torch.dtype, out: int
) -> torch.Tensor:
    """Every token's product as one ``[tokens, out]`` tensor, zero rows for index -1."""
    slot = tokens.one_slot_for_all
    if slot is not None:
        return torch.nn.functional.linear(inputs, weights[slot, :out].to(dtype))
    outputs = torch.zeros((tokens.count, out), dtype=dtype, device=inputs.device)
    _apply(outputs, inputs, weights, tokens, add_inputs=True)
    return outputs


def _shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    runs: list[Run],
    token_slots: Callable[[], torch.Tensor],
    scaling: float,
) -> None:
    weights = _weights_3d(lora_a_weights)
    dtype = output_tensor.dtype
    inputs, tokens = _group(inputs.to(dtype=dtype), runs, token_slots)
    outputs = _products(inputs, weights, tokens, dtype, weights.shape[1])
    output_tensor[:, : outputs.shape[1]] = outputs.mul_(scaling)


def _expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    runs: list[Run],
    token_slots: Callable[[], torch.Tensor],
    add_inputs: bool,
) -> None:
    weights = _weights_3d(lora_b_weights)
    dtype = output_tensor.dtype
    out_rows = output_tensor.shape[0]
    count = runs[-1][2] if runs else 0
    if count > out_rows and inputs.shape[0] == count:
        # Tokens past the output's rows are dropped, as the originals' `outputs[:limit]` does.
        runs = [(slot, start, min(end, out_rows)) for slot, start, end in runs if start < out_rows]
        inputs = inputs[:out_rows]
        token_slots = _first(token_slots, out_rows)
    inputs, tokens = _group(inputs.to(dtype=dtype), runs, token_slots)
    # LoRA adapter and model may add different amounts of padding to the output.
    common_len = min(weights.shape[1], output_tensor.shape[1])
    if tokens.count == out_rows:
        _apply(output_tensor[:, :common_len], inputs, weights, tokens, add_inputs)
        return
    # The originals' other shapes: one product row broadcast over every output row, or a shape
    # error, raised by the same statement.
    outputs = _products(inputs, weights, tokens, dtype, common_len)
    limit = 1 if outputs.shape[0] == 1 and out_rows != 1 else out_rows
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def _expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    runs: list[Run],
    token_slots: Callable[[], torch.Tensor],
    slice_offset: int,
    slice_size: int,
    add_inputs: bool,
) -> None:
    weights = _weights_3d(lora_b_weights)
    dtype = output_tensor.dtype
    inputs, tokens = _group(inputs.to(dtype=dtype), runs, token_slots)
    target = output_tensor[:, slice_offset : slice_offset + slice_size]
    if target.shape == (tokens.count, weights.shape[1]):
        _apply(target, inputs, weights, tokens, add_inputs)
        return
    # Any other shape broadcasts, or fails, exactly as the original statement does.
    outputs = _products(inputs, weights, tokens, dtype, weights.shape[1])
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """``output[:, :rank] = scaling * inputs @ lora_a[slot].T`` per token; zero for index -1."""
    runs = _token_runs(lora_indices_tensor)
    _shrink(inputs, lora_b_weights, output_tensor, runs, lambda: lora_indices_tensor, scaling)


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """``output[:, :common] (+)= inputs @ lora_b[slot].T`` per token; nothing for index -1."""
    runs = _token_runs(lora_indices_tensor)
    _expand(inputs, lora_b_weights, output_tensor, runs, lambda: lora_indices_tensor, add_inputs)


def bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    """``output[:, offset:offset + size] (+)= inputs @ lora_b[slot].T``; nothing for index -1."""
    _expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        _token_runs(lora_indices_tensor),
        lambda: lora_indices_tensor,
        slice_offset,
        slice_size,
        add_inputs,
    )


def _first(token_slots: Callable[[], torch.Tensor], count: int) -> Callable[[], torch.Tensor]:
    return lambda: token_slots().reshape(-1)[:count]


def _exploded(
    lora_indices_tensor: torch.Tensor, seq_len_tensor: torch.Tensor
) -> Callable[[], torch.Tensor]:
    return lambda: torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    add_inputs: bool = False,
) -> None:
    runs = _sequence_runs(lora_indices_tensor, seq_len_tensor)
    _expand(
        inputs,
        lora_b_weights,
        output_tensor,
        runs,
        _exploded(lora_indices_tensor, seq_len_tensor),
        add_inputs,
    )


def sgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    scaling: float,
) -> None:
    runs = _sequence_runs(lora_indices_tensor, seq_len_tensor)
    _shrink(
        inputs,
        lora_a_weights,
        output_tensor,
        runs,
        _exploded(lora_indices_tensor, seq_len_tensor),
        scaling,
    )


def sgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    b_seq_start_loc: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    batches: int,
    max_seq_length: int,
    token_nums: int,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = False,
) -> None:
    _expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        _sequence_runs(lora_indices_tensor, seq_len_tensor),
        _exploded(lora_indices_tensor, seq_len_tensor),
        slice_offset,
        slice_size,
        add_inputs,
    )
