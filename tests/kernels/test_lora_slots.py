"""``LoRASlots``: one copy of each slot's weights, at the slot's own rank."""

from __future__ import annotations

import torch

from loraplex_kernels.lora_slots import LoRASlots

CPU = torch.device("cpu")


def test_per_slot_layout_holds_only_loaded_slots_at_their_rank() -> None:
    slots = LoRASlots(5, [4, 3], 3, 64, torch.float32, CPU, "per_slot")
    assert slots.weights == [None] * 3 and not slots.lora_a and not slots.lora_b
    a0, b0 = torch.randn(2, 5), torch.randn(4, 2)
    a1, b1 = torch.randn(2, 5), torch.randn(3, 2)
    slots.set(1, [(a0, b0), (a1, b1)], 0.5)
    at, bt = slots.weights[1] or (None, None)
    assert at is not None and bt is not None
    assert at.shape == (5, 16) and bt.shape == (16, 7)  # 2 slices x rank 2, padded to 16
    assert torch.equal(at[:, :4], torch.cat([a0, a1]).t()) and not at[:, 4:].any()
    assert torch.equal(bt[:2, :4], b0.t() * 0.5) and torch.equal(bt[2:4, 4:], b1.t() * 0.5)
    assert not bt[:2, 4:].any() and not bt[2:4, :4].any() and not bt[4:].any()
    assert slots.ranks.tolist() == [0, 16, 0]
    assert slots.at_ptrs[1] == at.data_ptr() and slots.bt_ptrs[1] == bt.data_ptr()
    slots.set(1, [None, (a1, b1)], 1.0)  # a slice the adapter does not target: no rows
    at, bt = slots.weights[1] or (None, None)
    assert at is not None and bt is not None and torch.equal(at[:, :2], a1.t())
    assert torch.equal(bt[:2, 4:], b1.t()) and not bt[:2, :4].any()
    slots.set(1, [None, None], 1.0)
    assert slots.weights[1] is None and slots.ranks.tolist() == [0, 0, 0]
    assert slots.at_ptrs[1] == 0 and slots.bt_ptrs[1] == 0


def test_stacked_layout_pads_to_max_rank_and_clears() -> None:
    slots = LoRASlots(5, [4], 2, 8, torch.float32, CPU, "stacked")
    assert slots.lora_a[0].shape == (2, 8, 5) and slots.lora_b[0].shape == (2, 4, 8)
    a, b = torch.randn(3, 5), torch.randn(4, 3)
    slots.set(1, [(a, b)], 2.0)  # the kernels apply the scale
    assert torch.equal(slots.lora_a[0][1, :3], a) and not slots.lora_a[0][1, 3:].any()
    assert torch.equal(slots.lora_b[0][1, :, :3], b) and slots.weights == [None, None]
    slots.set(1, [None], 2.0)
    assert not slots.lora_a[0].any() and not slots.lora_b[0].any()


def test_bfloat16_slots_give_the_native_kernel_pair_interleaved_copies() -> None:
    slots = LoRASlots(5, [4, 3], 2, 64, torch.bfloat16, CPU, "per_slot")
    a, b = torch.randn(3, 5).bfloat16(), torch.randn(7, 3).bfloat16()
    slots.set(0, [(a[:2], b[:4, :2]), (a[2:], b[4:, 2:])], 1.0)
    at, bt = slots.weights[0] or (None, None)
    pair = slots.native[0]
    assert at is not None and bt is not None and pair is not None
    vat, vbt = pair
    assert vat.shape == (3, 16, 2) and vbt.shape == (8, 7, 2)  # in 5 -> 3 pairs, R 16 -> 8
    for i in range(5):
        assert torch.equal(vat[i // 2, :, i % 2], at[i])
    assert not vat[2, :, 1].any()  # the odd row's partner is zero
    for k in range(16):
        assert torch.equal(vbt[k // 2, :, k % 2], bt[k])
    assert slots.at_ptrs[0] == vat.data_ptr() and slots.bt_ptrs[0] == vbt.data_ptr()
    slots.set(0, [None, None], 1.0)
    assert slots.native[0] is None and slots.weights[0] is None


def test_float32_slots_keep_one_copy() -> None:
    slots = LoRASlots(5, [4], 1, 64, torch.float32, CPU, "per_slot")
    slots.set(0, [(torch.randn(2, 5), torch.randn(4, 2))], 1.0)
    assert slots.native == [None]
    assert slots.weights[0] is not None and slots.at_ptrs[0] == slots.weights[0][0].data_ptr()
