"""``LoRASlots``: one copy of each slot's weights, at the slot's own rank."""

from __future__ import annotations

import torch

from loraplex_kernels import cpu_native
from loraplex_kernels.lora_slots import LoRASlots, tiled_layout

CPU = torch.device("cpu")


def _read(slots: LoRASlots, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the native kernel reads for a slot: the tiled copies, or (no library) the plain."""
    pair = slots.native[slot] or slots.weights[slot]
    assert pair is not None
    return pair


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
    # the kernels are told the native copies' R: the ranks rounded up to the native
    # kernel's multiple (8 but where AMX takes bfloat16), the plain width without one
    native = cpu_native.lora_rank_multiple(torch.float32)
    assert slots.ranks.tolist() == [0, 16 if native is None else native, 0]
    read = _read(slots, 1)
    assert slots.at_ptrs[1] == read[0].data_ptr() and slots.bt_ptrs[1] == read[1].data_ptr()
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


def test_the_tiled_layout_holds_each_block_contiguously() -> None:
    at, bt = torch.randn(5, 32), torch.randn(32, 40)
    slices = [(0, 3, 0, 24), (3, 20, 24, 40)]  # ranks 3 and 17 (odd: pairs straddle)
    a, b = tiled_layout(at, bt, slices, 16)
    assert torch.equal(a, torch.cat([at[:, :16].reshape(-1), at[:, 16:].reshape(-1)]))
    expect = [bt[0:3, 0:16], bt[0:3, 16:24], bt[3:20, 24:40]]  # diagonal blocks only
    assert torch.equal(b, torch.cat([e.reshape(-1) for e in expect]))
    a, b = tiled_layout(at, bt, slices, 16, pairs=True)
    assert a.numel() == 3 * 32 * 2  # in 5 -> 3 pairs, the last row's partner zero
    blocks = a.view(2, 3, 16, 2)  # [rank block, pair, rank, which of the pair]
    for i in range(6):
        row = at[i] if i < 5 else torch.zeros(32)
        assert torch.equal(blocks[0, i // 2, :, i % 2], row[:16])
        assert torch.equal(blocks[1, i // 2, :, i % 2], row[16:])
    # slice 0: ranks 0..3 -> pairs 0..2 (rows 0..4, row 3 slice 1's, zero in its columns)
    first = b[:2 * 2 * 16].view(2, 16, 2)
    for k in range(4):
        assert torch.equal(first[k // 2, :, k % 2], bt[k, 0:16])
    # slice 1: ranks 3..20 -> pairs 1..10 (rows 2..20, row 2 slice 0's)
    second = b[-9 * 16 * 2:].view(9, 16, 2)
    for k in range(2, 20):
        assert torch.equal(second[k // 2 - 1, :, k % 2], bt[k, 24:40])


def test_the_tiled_layout_at_the_avx512_width() -> None:
    """Tiles of 64 (AVX-512): a last rank block narrower than a tile (R 80 = 64 + 16), and a
    slice narrower than one tile of columns, stored at its own width."""
    at, bt = torch.randn(3, 80), torch.randn(80, 100)
    slices = [(0, 40, 0, 70), (40, 75, 70, 100)]
    a, b = tiled_layout(at, bt, slices, 64)
    assert torch.equal(a, torch.cat([at[:, :64].reshape(-1), at[:, 64:].reshape(-1)]))
    expect = [bt[0:40, 0:64], bt[0:40, 64:70], bt[40:75, 70:100]]
    assert torch.equal(b, torch.cat([e.reshape(-1) for e in expect]))


def test_slots_point_the_native_kernel_at_their_tiled_copies() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        tile = cpu_native.lora_tile(dtype)
        slots = LoRASlots(5, [4, 3], 2, 64, dtype, CPU, "per_slot")
        a, b = torch.randn(3, 5).to(dtype), torch.randn(7, 3).to(dtype)
        slots.set(0, [(a[:2], b[:4, :2]), (a[2:], b[4:, 2:])], 1.0)
        at, bt = slots.weights[0] or (None, None)
        assert at is not None and bt is not None
        if tile is None:  # no native kernel: nothing else is kept
            assert slots.native[0] is None and slots.at_ptrs[0] == at.data_ptr()
            continue
        na, nb = _read(slots, 0)
        rank = cpu_native.lora_rank_multiple(dtype)  # ranks 2 + 1, rounded up to it
        assert rank in (8, 16) and slots.ranks[0] == rank
        ea, eb = tiled_layout(at[:, :rank], bt[:rank], slots.slices[0], tile,
                              pairs=dtype == torch.bfloat16)
        assert torch.equal(na, ea) and torch.equal(nb, eb)
        assert slots.at_ptrs[0] == na.data_ptr() and slots.bt_ptrs[0] == nb.data_ptr()
        slots.set(0, [None, None], 1.0)
        assert slots.native[0] is None and slots.weights[0] is None
