"""Per-step metadata the kernels read. Built once per step, shared by every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Segments (one slot's consecutive tokens) up to this long go to the native CPU LoRA
# kernel, longer ones to per-slot matmuls. The native kernel re-reads a slot's weights
# (from cache) for every 4 tokens. In float32 oneDNN's GEMM overtook it between 256 and
# 512 tokens at rank 32 and not up to 2,048 at rank 8, so 512 splits the ranks served (on
# an AVX2-only EPYC rank 32 lost from 64 tokens and rank 8 won to 1,024; a limit of 64
# there measured the same on the offline workload as 512, so one limit serves both); in
# bfloat16 the native kernel measured faster at every length up to a whole 2,048-token
# chunk, so there it takes them all (benchmarks/lora_decode.py --crossover). So does
# float32 where the native kernel has AVX-512, since its tiled layout and sums in registers
# measured faster at every length on AMD's and Intel's CPUs alike
# (cpu_native.native_lora_any_length).
SHORT_SEGMENT_LEN = 512
_NO_LIMIT = 1 << 62


def short_segment_limit(dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The ``short_segment_len`` a step of this dtype is built with (see above; on other
    devices than the CPU no kernel reads it)."""
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        return _NO_LIMIT
    from loraplex_kernels import cpu_native  # not at the top: it imports this module

    return _NO_LIMIT if cpu_native.native_lora_any_length() else SHORT_SEGMENT_LEN


@dataclass(frozen=True)
class SGMVMeta:
    """Which tokens use which adapter slot, without reordering activations.

    Tokens are grouped by slot through ``sorted_token_ids`` (a stable sort of the token
    indices by slot, base-model tokens excluded). Segment ``i`` covers
    ``sorted_token_ids[seg_starts[i] : seg_starts[i] + seg_lens[i]]`` and uses slot
    ``active_slots[i]`` with rank ``slot_ranks[active_slots[i]]``.
    """

    token_slots: torch.Tensor  # [num_tokens] int32, -1 = base model
    sorted_token_ids: torch.Tensor  # [num_lora_tokens] int64
    active_slots: torch.Tensor  # [num_active] int32
    seg_starts: torch.Tensor  # [num_active] int32
    seg_lens: torch.Tensor  # [num_active] int32
    slot_ranks: torch.Tensor  # [num_slots] int32
    # Host copies so CPU code and launchers never synchronise with the device.
    active_slots_list: tuple[int, ...]
    seg_starts_list: tuple[int, ...]
    seg_lens_list: tuple[int, ...]
    slot_ranks_list: tuple[int, ...]
    num_tokens: int
    max_seg_len: int
    max_rank: int  # largest rank among active slots (0 when none)
    # First token of each segment when every segment is a contiguous run of tokens (the
    # runner orders sequences by slot so that it is); None otherwise.
    seg_first_tokens: tuple[int, ...] | None = None
    # When contiguous: segments of at most ``short_segment_len`` tokens as int64
    # [3, num_short] (first token, length, slot), for kernels that take many short
    # segments in one call, and the indices of the longer ones.
    short_segments: torch.Tensor | None = None
    long_segment_ids: tuple[int, ...] = ()

    @property
    def has_lora(self) -> bool:
        return len(self.active_slots_list) > 0

    @classmethod
    def build(
        cls,
        token_slots: Sequence[int],
        slot_ranks: Sequence[int],
        device: torch.device | str = "cpu",
        short_segment_len: int = SHORT_SEGMENT_LEN,
    ) -> SGMVMeta:
        num_slots = len(slot_ranks)
        for s in token_slots:
            if s < -1 or s >= num_slots:
                raise ValueError(f"token slot {s} out of range [-1, {num_slots})")
        order = sorted((i for i, s in enumerate(token_slots) if s >= 0),
                       key=lambda i: token_slots[i])
        active: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        for pos, tok in enumerate(order):
            s = token_slots[tok]
            if not active or active[-1] != s:
                active.append(s)
                starts.append(pos)
                lens.append(0)
            lens[-1] += 1
        i32 = dict(dtype=torch.int32, device=device)
        firsts = _contiguous_firsts(order, starts, lens)
        short = None
        long_ids: tuple[int, ...] = ()
        if firsts is not None:
            keep = [i for i, n in enumerate(lens) if n <= short_segment_len]
            long_ids = tuple(i for i, n in enumerate(lens) if n > short_segment_len)
            short = torch.tensor([[firsts[i] for i in keep], [lens[i] for i in keep],
                                  [active[i] for i in keep]], dtype=torch.int64,
                                 device=device).reshape(3, len(keep))
        return cls(
            token_slots=torch.tensor(list(token_slots), **i32),  # type: ignore[arg-type]
            sorted_token_ids=torch.tensor(order, dtype=torch.int64, device=device),
            active_slots=torch.tensor(active, **i32),  # type: ignore[arg-type]
            seg_starts=torch.tensor(starts, **i32),  # type: ignore[arg-type]
            seg_lens=torch.tensor(lens, **i32),  # type: ignore[arg-type]
            slot_ranks=torch.tensor(list(slot_ranks), **i32),  # type: ignore[arg-type]
            active_slots_list=tuple(active),
            seg_starts_list=tuple(starts),
            seg_lens_list=tuple(lens),
            slot_ranks_list=tuple(int(r) for r in slot_ranks),
            num_tokens=len(token_slots),
            max_seg_len=max(lens, default=0),
            max_rank=max((int(slot_ranks[s]) for s in active), default=0),
            seg_first_tokens=firsts,
            short_segments=short,
            long_segment_ids=long_ids,
        )


def _contiguous_firsts(order: list[int], starts: list[int],
                       lens: list[int]) -> tuple[int, ...] | None:
    firsts = []
    for start, length in zip(starts, lens, strict=True):
        first = order[start]
        if order[start + length - 1] - first != length - 1:
            return None  # sorted within a segment, so equal span means contiguous
        firsts.append(first)
    return tuple(firsts)


@dataclass(frozen=True)
class AttentionMeta:
    """Paged-attention layout of one step's flattened batch.

    Sequence ``b`` owns query rows ``query_start_loc[b] : query_start_loc[b + 1]`` and
    attends to its first ``seq_lens[b]`` cached positions (which include the new tokens,
    already stored). The causal mask is aligned bottom-right: query row ``i`` of a sequence
    with ``q`` new tokens sees keys ``0 .. seq_len - q + i``.
    """

    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    seq_lens_list: tuple[int, ...]
    query_lens_list: tuple[int, ...]
    block_size: int
    # Sequences with one query token (decode) and their query rows, for decode kernels.
    decode_seq_ids: torch.Tensor  # [num_decode] int64
    decode_rows: torch.Tensor  # [num_decode] int64
    # Sequences with several query tokens (prefill chunks), for prefill kernels.
    prefill_seq_ids: torch.Tensor  # [num_prefill] int64

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_list, default=0)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_list)

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMeta:
        """Builds the metadata; the slot mapping is derived from the block tables."""
        if not (len(block_tables) == len(seq_lens) == len(query_lens)):
            raise ValueError("block_tables, seq_lens and query_lens differ in length")
        width = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        slots: list[int] = []
        decode_ids: list[int] = []
        decode_rows: list[int] = []
        prefill_ids: list[int] = []
        for b, (table, seq_len, q_len) in enumerate(
                zip(block_tables, seq_lens, query_lens, strict=True)):
            if q_len < 1 or q_len > seq_len:
                raise ValueError(f"query length {q_len} not in [1, seq_len={seq_len}]")
            if len(table) * block_size < seq_len:
                raise ValueError(f"block table of {len(table)} blocks too short for {seq_len}")
            if q_len == 1:
                decode_ids.append(b)
                decode_rows.append(starts[-1])
            else:
                prefill_ids.append(b)
            starts.append(starts[-1] + q_len)
            for pos in range(seq_len - q_len, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        return cls(
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
                len(padded), width),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            seq_lens_list=tuple(seq_lens),
            query_lens_list=tuple(query_lens),
            block_size=block_size,
            decode_seq_ids=torch.tensor(decode_ids, dtype=torch.int64, device=device),
            decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
            prefill_seq_ids=torch.tensor(prefill_ids, dtype=torch.int64, device=device),
        )
