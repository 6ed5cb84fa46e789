"""Index-safe, slot-grouped replacements for vLLM's torch LoRA ops (``vllm.lora.ops.torch_ops``).

The originals gather one weight matrix per token, ``lora_b_weights[lora_indices_tensor]``, and
run one einsum over the gathered stack. Two problems follow:

- a token with no adapter carries slot index -1, which Python indexing turns into the *last*
  slot, so a base-model token gets the last adapter's delta (requests borrow an adapter);
- the gather materialises a ``[tokens, out, in]`` tensor on every call, which is what makes
  LoRA about 3x slower than the base model on the CPU build.

These ops group tokens by slot and run one matmul per slot present. A token with index -1 gets
no contribution: where an op accumulates (``add_inputs=True``) its output row is not touched;
where an op overwrites (the shrink ops, ``add_inputs=False``) its row gets the zero delta. That
matches the GPU (Triton) kernels, which skip index -1, on every buffer vLLM actually passes
(it zeroes them first). Everything else follows the originals: signatures and defaults, the
output dtype as compute dtype, ``scaling``, ``add_inputs``, the slice offsets, the expand ops'
padding rules (``common_len`` and the single-row broadcast) and the sgmv ops' expansion of
per-sequence indices over ``seq_len_tensor``.

This module imports only torch; the plugin imports it only once it has decided to patch.
"""

from __future__ import annotations

import torch

OP_NAMES = (
    "bgmv_expand",
    "bgmv_expand_slice",
    "bgmv_shrink",
    "sgmv_expand",
    "sgmv_expand_slice",
    "sgmv_shrink",
)

# All tokens, no gather: the common case of a batch served by one adapter.
_ALL_ROWS = None


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


def _align(inputs: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and indices with one row per token, broadcasting a single row as einsum does."""
    indices = indices.reshape(-1)
    rows, count = inputs.shape[0], indices.shape[0]
    if rows == count:
        return inputs, indices
    if rows == 1:
        return inputs.expand(count, -1), indices
    if count == 1:
        return inputs, indices.expand(rows)
    raise RuntimeError(f"{rows} input rows do not match {count} LoRA indices")


Rows = torch.Tensor | None  # row indices into the batch, or _ALL_ROWS


def _slot_groups(indices: torch.Tensor) -> tuple[list[tuple[int, Rows]], list[Rows]]:
    """``(slot, rows)`` for each slot >= 0 present, and the rows of the tokens with no adapter.

    ``rows`` is ``_ALL_ROWS`` when one slot serves every token; the no-adapter rows come back as
    a list holding one row tensor (or ``_ALL_ROWS``), empty when every token has an adapter.
    """
    if indices.numel() == 0:
        return [], []
    # counts[0] is the number of tokens with index -1, counts[s + 1] that of slot s.
    counts = torch.bincount(indices + 1).tolist()
    present = [slot for slot, count in enumerate(counts, start=-1) if count]
    if len(present) == 1:
        slot = present[0]
        return ([], [_ALL_ROWS]) if slot < 0 else ([(slot, _ALL_ROWS)], [])
    order = torch.argsort(indices, stable=True)
    groups: list[tuple[int, Rows]] = []
    no_adapter: list[Rows] = []
    for slot, rows in zip(range(-1, len(counts) - 1), order.split(counts), strict=True):
        if rows.numel() == 0:
            continue
        if slot < 0:
            no_adapter.append(rows)
        else:
            groups.append((slot, rows))
    return groups, no_adapter


def _write(
    target: torch.Tensor,
    rows: Rows,
    values: torch.Tensor,
    accumulate: bool,
) -> None:
    if rows is _ALL_ROWS:
        if accumulate:
            target.add_(values)
        else:
            target.copy_(values)
    elif accumulate:
        target.index_add_(0, rows, values)
    else:
        target.index_copy_(0, rows, values)


def _products(
    inputs: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    dtype: torch.dtype,
    out_features: int,
) -> torch.Tensor:
    """``inputs[t] @ weights[indices[t], :out_features].T`` for every token, zero for index -1."""
    groups, _ = _slot_groups(indices)
    if len(groups) == 1 and groups[0][1] is _ALL_ROWS:
        slot = groups[0][0]
        return torch.nn.functional.linear(inputs, weights[slot, :out_features].to(dtype))
    outputs = torch.zeros((indices.shape[0], out_features), dtype=dtype, device=inputs.device)
    _accumulate_groups(outputs, inputs, weights, groups, dtype, out_features, accumulate=False)
    return outputs


def _accumulate_groups(
    target: torch.Tensor,
    inputs: torch.Tensor,
    weights: torch.Tensor,
    groups: list[tuple[int, Rows]],
    dtype: torch.dtype,
    out_features: int,
    accumulate: bool,
) -> None:
    for slot, rows in groups:
        weight = weights[slot, :out_features].to(dtype)
        picked = inputs if rows is _ALL_ROWS else inputs.index_select(0, rows)
        _write(target, rows, torch.nn.functional.linear(picked, weight), accumulate)


def _apply_in_place(
    target: torch.Tensor,
    inputs: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    dtype: torch.dtype,
    add_inputs: bool,
) -> None:
    """``target[t] (+)= inputs[t] @ weights[indices[t]].T``; rows with index -1 get nothing.

    ``target`` has one row per token and exactly as many columns as the product.
    """
    groups, no_adapter = _slot_groups(indices)
    _accumulate_groups(
        target, inputs, weights, groups, dtype, target.shape[1], accumulate=add_inputs
    )
    if not add_inputs:
        # Overwriting with "no adapter" means writing the zero delta, never stale values.
        for rows in no_adapter:
            if rows is _ALL_ROWS:
                target.zero_()
            else:
                target.index_fill_(0, rows, 0)


def bgmv_shrink(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    """``output[:, :rank] = scaling * inputs @ lora_a[slot].T`` per token; zero for index -1."""
    weights = _weights_3d(lora_b_weights)
    dtype = output_tensor.dtype
    inputs, indices = _align(inputs.to(dtype=dtype), lora_indices_tensor)
    outputs = _products(inputs, weights, indices, dtype, weights.shape[1])
    output_tensor[:, : outputs.shape[1]] = outputs.mul_(scaling)


def bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    """``output[:, :common] (+)= inputs @ lora_b[slot].T`` per token; nothing for index -1."""
    weights = _weights_3d(lora_b_weights)
    dtype = output_tensor.dtype
    inputs, indices = _align(inputs.to(dtype=dtype), lora_indices_tensor)
    # LoRA adapter and model may add different amounts of padding to the output.
    common_len = min(weights.shape[1], output_tensor.shape[1])
    out_rows = output_tensor.shape[0]
    if indices.shape[0] >= out_rows and not (indices.shape[0] == 1 and out_rows != 1):
        # One row per output row (extra tokens beyond the output are dropped, as originally).
        _apply_in_place(
            output_tensor[:, :common_len],
            inputs[:out_rows],
            weights,
            indices[:out_rows],
            dtype,
            add_inputs,
        )
        return
    # The original's remaining shapes: one product row broadcast over every output row, or a
    # shape error, raised by the same statement.
    outputs = _products(inputs, weights, indices, dtype, common_len)
    limit = 1 if outputs.shape[0] == 1 and out_rows != 1 else out_rows
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


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
    weights = _weights_3d(lora_b_weights)
    dtype = output_tensor.dtype
    inputs, indices = _align(inputs.to(dtype=dtype), lora_indices_tensor)
    target = output_tensor[:, slice_offset : slice_offset + slice_size]
    if target.shape == (indices.shape[0], weights.shape[1]):
        _apply_in_place(target, inputs, weights, indices, dtype, add_inputs)
        return
    # Any other shape broadcasts, or fails, exactly as the original statement does.
    outputs = _products(inputs, weights, indices, dtype, weights.shape[1])
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


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
    exploded_indices = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand(inputs, lora_b_weights, output_tensor, exploded_indices, add_inputs)


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
    exploded_indices = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_shrink(inputs, lora_a_weights, output_tensor, exploded_indices, scaling)


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
    exploded_indices = torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)
    bgmv_expand_slice(
        inputs,
        lora_b_weights,
        output_tensor,
        exploded_indices,
        slice_offset,
        slice_size,
        add_inputs,
    )
