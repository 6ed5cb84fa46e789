"""The engine plugin's LoRA ops against a naive per-token reference, and against vLLM's own ops.

The reference computes every token on its own: ``inputs[t] @ weights[slot].T`` for a token with
an adapter, nothing for a token with slot -1. Shapes follow what vLLM's CPU punica wrapper
passes: LoRA A stacked as ``[slots, 1, rank, in]`` (and plain ``[slots, rank, in]``), LoRA B as
``[slots, 1, out, rank]``, a float32 shrink buffer, the model dtype for the expand output, and
the output slices of merged projections (q/k/v, gate/up) written at their offsets.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch", reason="the CPU LoRA ops need torch (the engine extra)")

from loragate.engine_plugin import cpu_lora_ops  # noqa: E402

SLOTS = 3
RANK = 8
HIDDEN = 48
DTYPES = [torch.float32, torch.bfloat16]


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}


def stacked(out: int, inp: int, dtype: torch.dtype, four_d: bool, gen: torch.Generator):
    weights = torch.randn(SLOTS, out, inp, generator=gen).to(dtype)
    return weights.unsqueeze(1) if four_d else weights


def token_indices(tokens: int, gen: torch.Generator, with_base: bool = True) -> torch.Tensor:
    low = -1 if with_base else 0
    indices = torch.randint(low, SLOTS, (tokens,), generator=gen)
    if with_base and tokens > 1:
        indices[0] = -1  # always at least one token without an adapter
    return indices


def per_token(
    inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The product for each token (float64, zero for slot -1) and a mask of tokens with one."""
    weights = weights.squeeze(1) if weights.dim() == 4 else weights
    products = torch.zeros(indices.shape[0], weights.shape[1], dtype=torch.float64)
    for token, slot in enumerate(indices.tolist()):
        if slot >= 0:
            row = inputs[token].to(dtype).double()
            products[token] = weights[slot].to(dtype).double() @ row
    return products, indices >= 0


def sequences(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sgmv metadata for per-token indices, as vLLM's compute_meta builds it."""
    slots, lengths = torch.unique_consecutive(indices, return_counts=True)
    starts = torch.zeros_like(lengths)
    starts[1:] = torch.cumsum(lengths, 0)[:-1]
    return starts, lengths, slots


def sgmv_args(indices: torch.Tensor) -> tuple:
    starts, lengths, slots = sequences(indices)
    return starts, lengths, slots, len(slots), int(lengths.max()), int(lengths.sum())


# ----- shrink ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "four_d", "tokens", "sgmv"),
    list(itertools.product(DTYPES, [True, False], [1, 7, 64], [False, True])),
)
def test_shrink_scales_each_tokens_own_adapter_and_writes_zero_for_base_tokens(
    dtype: torch.dtype, four_d: bool, tokens: int, sgmv: bool
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    lora_a = stacked(RANK, HIDDEN, dtype, four_d, gen)
    inputs = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    indices = token_indices(tokens, gen)
    # The wrapper's buffer is float32 and may be wider than the rank; stale values must go.
    output = torch.randn(tokens, RANK + 4, generator=gen)
    before = output.clone()
    if sgmv:
        cpu_lora_ops.sgmv_shrink(inputs, lora_a, output, *sgmv_args(indices), 0.5)
    else:
        cpu_lora_ops.bgmv_shrink(inputs, lora_a, output, indices, 0.5)

    products, _ = per_token(inputs, lora_a, indices, torch.float32)
    torch.testing.assert_close(output[:, :RANK].double(), 0.5 * products, **tolerance(dtype))
    assert torch.equal(output[indices < 0, :RANK], torch.zeros_like(output[indices < 0, :RANK]))
    assert torch.equal(output[:, RANK:], before[:, RANK:])


# ----- expand ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "four_d", "tokens", "add_inputs", "sgmv"),
    list(itertools.product(DTYPES, [True, False], [1, 7, 64], [True, False], [False, True])),
)
def test_expand_adds_each_tokens_own_adapter_and_leaves_base_tokens_alone(
    dtype: torch.dtype, four_d: bool, tokens: int, add_inputs: bool, sgmv: bool
) -> None:
    gen = torch.Generator().manual_seed(100 + tokens)
    lora_b = stacked(HIDDEN, RANK, dtype, four_d, gen)
    inputs = torch.randn(tokens, RANK, generator=gen)  # the float32 shrink buffer
    indices = token_indices(tokens, gen)
    output = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    before = output.clone()
    if sgmv:
        cpu_lora_ops.sgmv_expand(inputs, lora_b, output, *sgmv_args(indices), add_inputs)
    else:
        cpu_lora_ops.bgmv_expand(inputs, lora_b, output, indices, add_inputs)

    products, has_adapter = per_token(inputs, lora_b, indices, dtype)
    expected = before.double() + products if add_inputs else products
    torch.testing.assert_close(output.double(), expected, **tolerance(dtype))
    base_rows = output[~has_adapter]
    if add_inputs:
        assert torch.equal(base_rows, before[~has_adapter])
    else:
        assert torch.equal(base_rows, torch.zeros_like(base_rows))


@pytest.mark.parametrize("lora_out", [HIDDEN - 8, HIDDEN + 8])
def test_expand_writes_only_the_columns_adapter_and_output_share(lora_out: int) -> None:
    # LogitsProcessorWithLoRA: the adapter's vocab and the model's may be padded differently.
    gen = torch.Generator().manual_seed(lora_out)
    lora_b = stacked(lora_out, RANK, torch.float32, True, gen)
    inputs = torch.randn(9, RANK, generator=gen)
    indices = token_indices(9, gen)
    output = torch.randn(9, HIDDEN, generator=gen)
    before = output.clone()
    cpu_lora_ops.bgmv_expand(inputs, lora_b, output, indices, add_inputs=True)

    common = min(lora_out, HIDDEN)
    products, _ = per_token(inputs, lora_b, indices, torch.float32)
    expected = before[:, :common].double() + products[:, :common]
    torch.testing.assert_close(output[:, :common].double(), expected, **tolerance(torch.float32))
    assert torch.equal(output[:, common:], before[:, common:])


# ----- expand_slice ------------------------------------------------------------------------

# The output slices of the projections the wrapper expands: o_proj and down_proj (one slice),
# gate_up_proj (two equal), qkv_proj with grouped-query attention (q wider than k and v).
SLICE_LAYOUTS = [(HIDDEN,), (32, 32), (HIDDEN, 16, 16)]


@pytest.mark.parametrize(
    ("dtype", "four_d", "layout", "add_inputs", "sgmv"),
    list(itertools.product(DTYPES, [True, False], SLICE_LAYOUTS, [True, False], [False, True])),
)
def test_expand_slice_writes_every_slice_at_its_offset_and_leaves_base_tokens_alone(
    dtype: torch.dtype,
    four_d: bool,
    layout: tuple[int, ...],
    add_inputs: bool,
    sgmv: bool,
) -> None:
    tokens = 23
    gen = torch.Generator().manual_seed(sum(layout))
    indices = token_indices(tokens, gen)
    output = torch.randn(tokens, sum(layout), generator=gen).to(dtype)
    before = output.clone()
    expected = before.double()
    offset = 0
    for size in layout:
        lora_b = stacked(size, RANK, dtype, four_d, gen)
        inputs = torch.randn(tokens, RANK, generator=gen)
        if sgmv:
            cpu_lora_ops.sgmv_expand_slice(
                inputs, lora_b, output, *sgmv_args(indices), offset, size, add_inputs
            )
        else:
            cpu_lora_ops.bgmv_expand_slice(
                inputs, lora_b, output, indices, offset, size, add_inputs
            )
        products, _ = per_token(inputs, lora_b, indices, dtype)
        if add_inputs:
            expected[:, offset : offset + size] += products
        else:
            expected[:, offset : offset + size] = products
        offset += size

    torch.testing.assert_close(output.double(), expected, **tolerance(dtype))
    base_rows = output[indices < 0]
    if add_inputs:
        assert torch.equal(base_rows, before[indices < 0])
    else:
        assert torch.equal(base_rows, torch.zeros_like(base_rows))


# ----- the same answers as vLLM's ops wherever those are right -----------------------------


@pytest.fixture(scope="module")
def vllm_ops():
    return pytest.importorskip(
        "vllm.lora.ops.torch_ops.lora_ops", reason="vLLM is not installed (the engine extra)"
    )


def call_both(
    vllm_ops, name: str, make_output: Callable[[], torch.Tensor], *args
) -> tuple[torch.Tensor, torch.Tensor]:
    theirs, ours = make_output(), make_output()
    getattr(vllm_ops, name)(args[0], args[1], theirs, *args[2:])
    getattr(cpu_lora_ops, name)(args[0], args[1], ours, *args[2:])
    return theirs, ours


def test_matches_vllms_ops_when_every_token_has_an_adapter(vllm_ops) -> None:
    gen = torch.Generator().manual_seed(7)
    indices = token_indices(40, gen, with_base=False)
    lora_a = stacked(RANK, HIDDEN, torch.float32, True, gen)
    lora_b = stacked(HIDDEN, RANK, torch.float32, True, gen)
    x = torch.randn(40, HIDDEN, generator=gen)
    buffer = torch.randn(40, RANK, generator=gen)
    y = torch.randn(40, HIDDEN + 16, generator=gen)
    meta = sgmv_args(indices)
    cases = [
        ("bgmv_shrink", lambda: torch.zeros(40, RANK), x, lora_a, indices, 0.25),
        ("sgmv_shrink", lambda: torch.zeros(40, RANK), x, lora_a, *meta, 0.25),
        ("bgmv_expand", y.clone, buffer, lora_b, indices, True),
        ("bgmv_expand", y.clone, buffer, lora_b, indices, False),
        ("sgmv_expand", y.clone, buffer, lora_b, *meta, True),
        ("bgmv_expand_slice", y.clone, buffer, lora_b, indices, 16, HIDDEN, True),
        ("sgmv_expand_slice", y.clone, buffer, lora_b, *meta, 16, HIDDEN, False),
    ]
    for name, make_output, *args in cases:
        theirs, ours = call_both(vllm_ops, name, make_output, *args)
        torch.testing.assert_close(ours, theirs, msg=name)


def test_matches_vllms_broadcast_of_a_single_row(vllm_ops) -> None:
    gen = torch.Generator().manual_seed(8)
    lora_b = stacked(HIDDEN, RANK, torch.float32, False, gen)
    one_row = torch.randn(1, RANK, generator=gen)
    # One product row over every output row (the original's `limit = 1`) ...
    theirs, ours = call_both(
        vllm_ops, "bgmv_expand", lambda: torch.ones(5, HIDDEN), one_row, lora_b, torch.tensor([2])
    )
    torch.testing.assert_close(ours, theirs)
    # ... one input row under several indices, and several rows under one index (einsum's).
    for inputs, indices in [
        (one_row, torch.tensor([0, 2, 1])),
        (torch.randn(3, RANK, generator=gen), torch.tensor([1])),
    ]:
        theirs, ours = call_both(
            vllm_ops, "bgmv_expand", lambda: torch.ones(3, HIDDEN), inputs, lora_b, indices
        )
        torch.testing.assert_close(ours, theirs)


def test_matches_vllms_ops_when_there_are_more_tokens_than_output_rows(vllm_ops) -> None:
    gen = torch.Generator().manual_seed(10)
    lora_b = stacked(HIDDEN, RANK, torch.float32, True, gen)
    inputs = torch.randn(12, RANK, generator=gen)
    indices = torch.tensor([0, 1, 0, 2, 2, 1, 0, 0, 1, 2, 0, 1])
    for add_inputs in (True, False):
        theirs, ours = call_both(
            vllm_ops,
            "bgmv_expand",
            lambda: torch.ones(5, HIDDEN),
            inputs,
            lora_b,
            indices,
            add_inputs,
        )
        torch.testing.assert_close(ours, theirs)
        theirs, ours = call_both(
            vllm_ops,
            "sgmv_expand",
            lambda: torch.ones(5, HIDDEN),
            inputs,
            lora_b,
            *sgmv_args(indices),
            add_inputs,
        )
        torch.testing.assert_close(ours, theirs)


def test_vllms_op_hands_a_base_token_the_last_slots_adapter_and_ours_does_not(vllm_ops) -> None:
    # The cross-talk bug at its root: index -1 picks the last slot's weights.
    gen = torch.Generator().manual_seed(9)
    lora_b = stacked(HIDDEN, RANK, torch.float32, True, gen)
    inputs = torch.randn(3, RANK, generator=gen)
    indices = torch.tensor([0, -1, 1])
    theirs, ours = call_both(
        vllm_ops, "bgmv_expand", lambda: torch.zeros(3, HIDDEN), inputs, lora_b, indices, True
    )

    last_slot = lora_b[SLOTS - 1, 0] @ inputs[1]
    torch.testing.assert_close(theirs[1], last_slot)
    assert theirs[1].abs().sum() > 0
    assert torch.equal(ours[1], torch.zeros(HIDDEN))
    torch.testing.assert_close(ours[[0, 2]], theirs[[0, 2]])


def test_a_batch_without_adapters_leaves_the_output_untouched() -> None:
    lora_b = torch.randn(SLOTS, 1, HIDDEN, RANK)
    output = torch.randn(6, HIDDEN)
    before = output.clone()
    cpu_lora_ops.bgmv_expand(torch.randn(6, RANK), lora_b, output, torch.full((6,), -1))
    assert torch.equal(output, before)
