"""The per-slice prefill LoRA path (``add_lora_sliced``) against float64 and the reference."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import CASE_SEGMENT_LEN, SGMVCase, check_add_lora

from loraplex_kernels import ops
from loraplex_kernels.lora_prefill import add_lora_sliced
from loraplex_kernels.lora_slots import LoRASlots
from loraplex_kernels.meta import SGMVMeta
from loraplex_kernels.sgmv_ref import add_lora_ref

F32 = torch.float32


def _runs(*runs: tuple[int, int]) -> tuple[int, ...]:
    """(slot, tokens) runs in order: each slot's tokens contiguous, as the runner lays
    them out; slot -1 is the base model."""
    return tuple(s for s, n in runs for _ in range(n))


# Long runs (> 32 tokens: the matmul path) of mixed ranks, short ones (native kernel) and
# base-model rows between them, over one, two and three slices of unequal widths.
PREFILL_CASES = [
    SGMVCase("qkv-mixed", _runs((-1, 7), (0, 40), (1, 90), (2, 5), (3, 33), (-1, 4)),
             (8, 16, 32, 1), 48, (48, 16, 16)),
    SGMVCase("gate-up", _runs((0, 64), (1, 3), (2, 70), (-1, 40)), (16, 8, 33, 2), 40,
             (56, 56)),
    SGMVCase("one-slice", _runs((1, 50), (3, 35), (-1, 2)), (4, 64, 8, 16), 24, (30,)),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_cpu_backend_prefill_matches_float64(case: SGMVCase) -> None:
    meta = SGMVMeta.build(case.token_slots, case.slot_ranks,
                          short_segment_len=CASE_SEGMENT_LEN)
    assert meta.long_segment_ids, "the case must reach the matmul path"
    check_add_lora(case, F32, "cpu", "cpu")


def _partial_slots(in_features: int, widths: list[int], ranks: list[int],
                   targeted: list[list[bool]], g: torch.Generator
                   ) -> tuple[LoRASlots, list[list[tuple[torch.Tensor, torch.Tensor] | None]]]:
    slots = LoRASlots(in_features, widths, len(ranks), 64, F32, torch.device("cpu"),
                      "per_slot")
    pairs_by_slot = []
    for s, r in enumerate(ranks):
        pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [
            (torch.randn(r, in_features, generator=g) / math.sqrt(in_features),
             torch.randn(w, r, generator=g) / math.sqrt(r)) if on else None
            for w, on in zip(widths, targeted[s], strict=True)]
        slots.set(s, pairs, 1.5 + s)
        pairs_by_slot.append(pairs)
    return slots, pairs_by_slot


def test_untargeted_slices_and_empty_slots_get_no_delta() -> None:
    """A slot adapting only some slices leaves the others' columns exact; a slot with no
    adapter loaded (weights None) and base-model rows are left untouched."""
    g = torch.Generator().manual_seed(3)
    widths, ranks = [20, 12, 12], [8, 16, 4, 2]
    targeted = [[True, False, True], [False, True, False], [False, False, False],
                [True, True, True]]
    slots, pairs = _partial_slots(36, widths, ranks, targeted, g)
    assert slots.weights[2] is None and slots.slices[2] == ()
    token_slots = _runs((-1, 3), (0, 41), (1, 37), (2, 50), (3, 60))
    meta = SGMVMeta.build(token_slots, ranks, short_segment_len=CASE_SEGMENT_LEN)
    x = torch.randn(len(token_slots), 36, generator=g)  # [tokens, in]
    out0 = torch.randn(len(token_slots), sum(widths), generator=g)  # [tokens, out]
    out = out0.clone()
    add_lora_sliced(out, x, slots, meta, range(len(meta.active_slots_list)))
    expected = out0.double().clone()
    offsets = slots.slice_offsets
    for t, s in enumerate(token_slots):
        if s < 0:
            continue
        for k, pair in enumerate(pairs[s]):
            if pair is not None:
                a, b = (w.double() for w in pair)
                expected[t, offsets[k]:offsets[k + 1]] += (b @ (a @ x[t].double())) * (1.5 + s)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    untouched = [t for t, s in enumerate(token_slots) if s in (-1, 2)]
    assert torch.equal(out[untouched], out0[untouched])
    rows0 = [t for t, s in enumerate(token_slots) if s == 0]
    assert torch.equal(out[rows0, 20:32], out0[rows0, 20:32]), "slot 0 leaves k_proj alone"
    # and the reference agrees to the float32 rounding of a different summation order
    ref = out0.clone()
    add_lora_ref(ref, x, slots.weights, meta)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


def test_only_the_given_segments_are_applied() -> None:
    g = torch.Generator().manual_seed(4)
    slots, _ = _partial_slots(16, [8, 8], [8, 16], [[True, True], [True, True]], g)
    token_slots = _runs((0, 40), (1, 40))
    meta = SGMVMeta.build(token_slots, [8, 16], short_segment_len=CASE_SEGMENT_LEN)
    x = torch.randn(80, 16, generator=g)  # [tokens, in]
    out0 = torch.randn(80, 16, generator=g)  # [tokens, out]
    out = out0.clone()
    add_lora_sliced(out, x, slots, meta, ())
    assert torch.equal(out, out0)
    add_lora_sliced(out, x, slots, meta, (1,))
    assert torch.equal(out[:40], out0[:40]) and not torch.equal(out[40:], out0[40:])


def test_float32_prefill_dispatch_takes_the_sliced_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU backend sends float32 long segments (and only those) to the per-slice path."""
    seen: list[tuple[int, ...]] = []

    def spy(out: torch.Tensor, x: torch.Tensor, slots: LoRASlots, meta: SGMVMeta,
            segment_ids: tuple[int, ...]) -> None:
        seen.append(tuple(segment_ids))
        add_lora_sliced(out, x, slots, meta, segment_ids)

    monkeypatch.setattr(ops, "add_lora_sliced", spy)
    case = PREFILL_CASES[0]
    check_add_lora(case, F32, "cpu", "cpu")
    meta = SGMVMeta.build(case.token_slots, case.slot_ranks,
                          short_segment_len=CASE_SEGMENT_LEN)
    assert seen == [meta.long_segment_ids]
    seen.clear()
    check_add_lora(case, torch.bfloat16, "cpu", "cpu")
    assert seen == []
