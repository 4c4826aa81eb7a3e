"""Native CPU kernels (``csrc/``, float32) against float64 and the PyTorch reference.

Unowned cache rows hold NaN, so a kernel that reads past a sequence's length or outside its
blocks fails. The build and the switch are checked in child processes, since the library
is loaded once per process.
"""

from __future__ import annotations

import copy
import ctypes
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    ATTENTION_CASES,
    CASE_SEGMENT_LEN,
    DECODE_SPLIT_CASES,
    PART_TILE_CASES,
    SGMV_CASES,
    AttentionCase,
    SGMVCase,
    check_add_lora,
    check_attention,
    check_partial_targets,
    lora_slots,
    make_attention_inputs,
    make_sgmv_inputs,
    torch_threads,
)

from loraplex_kernels import cpu_native, ops
from loraplex_kernels.lora_slots import tiled_layout
from loraplex_kernels.meta import SGMVMeta, short_segment_limit

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="no C compiler: the native CPU kernels are not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=str)
def test_attention_cpu_backend(case: AttentionCase, dtype: torch.dtype) -> None:
    check_attention(case, dtype, "cpu", "cpu")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=7),
    prefill=st.lists(st.integers(1, 12), min_size=0, max_size=2),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 4, 8]),
    head_dim=st.sampled_from([8, 17, 64, 128]),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_decode_random_batches(lens: list[int], prefill: list[int], kv_heads: int,
                               group: int, head_dim: int, block_size: int) -> None:
    """Decode rows mixed with prefill chunks, odd head sizes, blocks of one position."""
    seq_lens = tuple(lens) + tuple(q + 5 for q in prefill)
    query_lens = (1,) * len(lens) + tuple(prefill)
    case = AttentionCase("random", seq_lens, query_lens, kv_heads * group, kv_heads,
                         head_dim, block_size)
    check_attention(case, torch.float32, "cpu", "cpu")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    chunks=st.lists(st.tuples(st.integers(2, 70), st.integers(0, 60)), min_size=1,
                    max_size=4),
    decode=st.lists(st.integers(1, 40), min_size=0, max_size=3),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([8, 17, 64]),
    block_size=st.sampled_from([1, 5, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    threads=st.sampled_from([1, 2, 3]),
)
def test_prefill_random_batches(chunks: list[tuple[int, int]], decode: list[int],
                                kv_heads: int, group: int, head_dim: int, block_size: int,
                                dtype: torch.dtype, threads: int) -> None:
    """Prefill chunks (query tiles of 16 and their remainders) after cached prefixes of
    any length, beside decode rows: the native prefill kernel against float64 and the
    reference, never reading a cache row it does not own (NaN garbage)."""
    seq_lens = tuple(q + cached for q, cached in chunks) + tuple(decode)
    query_lens = tuple(q for q, _ in chunks) + (1,) * len(decode)
    case = AttentionCase("random-prefill", seq_lens, query_lens, kv_heads * group, kv_heads,
                         head_dim, block_size)
    with torch_threads(threads):
        check_attention(case, dtype, "cpu", "cpu")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    chunks=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 90)), min_size=1,
                    max_size=5),
    window=st.integers(1, 70),
    softcap=st.sampled_from([0.0, 0.0, 1.0, 30.0]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([8, 17, 64]),
    block_size=st.sampled_from([1, 5, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    threads=st.sampled_from([1, 2, 3]),
)
def test_window_softcap_random_batches(chunks: list[tuple[int, int]], window: int,
                                       softcap: float, kv_heads: int, group: int,
                                       head_dim: int, block_size: int, dtype: torch.dtype,
                                       threads: int) -> None:
    """Sliding windows of any length (shorter and longer than the sequences, any offset in
    a block) over decode rows (chunks of one) and prefill chunks after cached prefixes,
    soft-capped or not: against float64 and the reference, never reading a position before
    a sequence's earliest window start (NaN there, and in a block its table names for the
    blocks wholly before it); decode rows split over threads where they are few."""
    case = AttentionCase("random-window", tuple(q + cached for q, cached in chunks),
                         tuple(q for q, _ in chunks), kv_heads * group, kv_heads, head_dim,
                         block_size, window=window, softcap=softcap,
                         q_scale=3.0 if softcap == 1.0 else 1.0)
    with torch_threads(threads):
        check_attention(case, dtype, "cpu", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_window_past_every_key_is_no_window(dtype: torch.dtype, threads: int) -> None:
    """A window at least as long as every sequence sees what no window sees, bit for bit
    (the same blocks from the same start, the same sums): decode rows, split over threads
    or not, and prefill chunks."""
    case = ATTENTION_CASES[3]  # prefill-prefix-mixed: chunks and decode rows
    inp = make_attention_inputs(case, dtype, "cpu", garbage=float("nan"))
    outs = []
    for window in (0, max(case.seq_lens), max(case.seq_lens) + 7):
        out = torch.full_like(inp.query, float("nan"))
        with torch_threads(threads):
            ops.paged_attention(inp.query, inp.k_cache, inp.v_cache, inp.meta,
                                case.head_dim ** -0.5, out, backend="cpu", window=window)
        outs.append(out)
    assert outs[0].isfinite().all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_window_and_softcap_must_not_be_negative() -> None:
    case = ATTENTION_CASES[0]
    inp = make_attention_inputs(case, torch.float32, "cpu", garbage=0.0)
    out = torch.empty_like(inp.query)
    for backend in ("cpu", "torch"):
        with pytest.raises(ValueError, match="must be >= 0"):
            ops.paged_attention(inp.query, inp.k_cache, inp.v_cache, inp.meta, 0.1, out,
                                backend=backend, window=-1)
        with pytest.raises(ValueError, match="must be >= 0"):
            ops.paged_attention(inp.query, inp.k_cache, inp.v_cache, inp.meta, 0.1, out,
                                backend=backend, softcap=-2.0)
    with pytest.raises(ValueError, match="window must be >= 0"):
        cpu_native.paged_decode_attention(inp.query, inp.k_cache, inp.v_cache, inp.meta, 0.1,
                                          out, window=-3)


@pytest.mark.parametrize(("threads", "case"), DECODE_SPLIT_CASES, ids=str)
def test_decode_split_over_threads(threads: int, case: AttentionCase) -> None:
    """Fewer sequences than threads: a sequence's parts run on different threads and their
    softmax states are merged."""
    with torch_threads(threads):
        check_attention(case, torch.float32, "cpu", "cpu")


def test_dispatch_prefers_native_on_cpu() -> None:
    assert ops.resolve_backend(torch.device("cpu")) == "cpu"
    assert ops.resolve_backend(torch.device("cpu"), "torch") == "torch"


def _child(code: str, **env: str) -> str:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=root, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_switch_off_falls_back_to_the_reference() -> None:
    code = ("import torch; from loraplex_kernels import ops, cpu_native; "
            "print(cpu_native.available(), ops.resolve_backend(torch.device('cpu')))")
    assert _child(code, LORAPLEX_CPU_KERNELS="0") == "False torch"


def test_build_is_cached_per_source_and_machine(tmp_path: Path) -> None:
    code = ("from loraplex_kernels import cpu_native; "
            "print(cpu_native.build(progress=lambda line: print('>', line)))")
    first = _child(code, LORAPLEX_KERNEL_CACHE=str(tmp_path)).splitlines()
    again = _child(code, LORAPLEX_KERNEL_CACHE=str(tmp_path)).splitlines()
    library = Path(first[-1])
    assert again[-1] == first[-1] and library.parent == tmp_path
    # Every stage of the first build said in a line, each source once with its time; the
    # second only that it uses the cached build.
    assert first[0].startswith(f"> compiling the native CPU kernels ({len(cpu_native._SOURCES)}"
                               f" sources, ") and str(tmp_path) in first[0]
    compiled = sorted(line.split()[2] for line in first[1:-2])
    assert compiled == sorted(source.name for source in cpu_native._SOURCES)
    assert all(re.fullmatch(r"> compiled \S+\.c in \d+\.\d s \(\d/\d\)", line)
               for line in first[1:-2]), first
    assert re.fullmatch(r"> linked in \d+\.\d s; the kernels took \d+\.\d s", first[-2])
    assert again == [f"> using the cached build {library}", str(library)]
    # One library and its lock, no build folder or object left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{library.stem}.lock",
                                                           library.name]


@pytest.mark.slow
def test_concurrent_builds_compile_once(tmp_path: Path) -> None:
    """Two processes starting on one empty cache: one compiles, the other waits for it and
    uses its library (a test session's servers all starting on a fresh machine)."""
    code = ("from loraplex_kernels import cpu_native; "
            "print(cpu_native.build(progress=lambda line: print('>', line)))")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "LORAPLEX_KERNEL_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=root) for _ in range(2)]
    outputs = [proc.communicate()[0].splitlines() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert outputs[0][-1] == outputs[1][-1]
    builders = [out for out in outputs if out[0].startswith("> compiling")]
    waiters = [out for out in outputs if not out[0].startswith("> compiling")]
    assert len(builders) == 1, outputs
    # The second may have arrived after the first finished (a cached build) or while it ran.
    assert waiters[0][-2] in (f"> using the cached build {outputs[0][-1]}",
                              f"> using the build another process just made, "
                              f"{outputs[0][-1]}"), waiters
def test_broken_compiler_is_a_clear_error(tmp_path: Path) -> None:
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'fake cc 1.0'\necho 'cc: boom' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="building the kernels in .* failed: cc: boom"):
        cpu_native.build(str(fake), tmp_path / "cache")
    # No library, object or build folder: only the (empty) lock of the key it tried.
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".lock"]


def _sorted(case: SGMVCase) -> SGMVCase:
    """The same tokens ordered by slot (as the runner orders them), so every slot's tokens
    are one run and the native path applies."""
    return replace(case, name=case.name + "-sorted", token_slots=tuple(sorted(case.token_slots)))


@pytest.mark.parametrize("case", [_sorted(c) for c in SGMV_CASES], ids=str)
def test_add_lora_cpu_backend(case: SGMVCase) -> None:
    meta = SGMVMeta.build(case.token_slots, case.slot_ranks,
                          short_segment_len=CASE_SEGMENT_LEN)
    assert meta.short_segments is not None
    check_add_lora(case, torch.float32, "cpu", "cpu")


@pytest.mark.parametrize("case", PART_TILE_CASES, ids=str)
def test_add_lora_part_tiles(case: SGMVCase) -> None:
    """Ranks padded only to 8: every size of a last, part tile (half vectors included)."""
    slots = lora_slots(case, make_sgmv_inputs(case, torch.float32, "cpu"), "per_slot")
    if cpu_native.lora_rank_multiple(torch.float32) == 8:
        assert any(int(r) % 16 == 8 for r in slots.ranks), "no slot pads to a half vector"
    check_add_lora(case, torch.float32, "cpu", "cpu")


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    runs=st.lists(st.tuples(st.integers(-1, 3), st.integers(1, 45)), min_size=1, max_size=6),
    ranks=st.lists(st.sampled_from([1, 2, 8, 16, 33, 64]), min_size=4, max_size=4),
    hidden=st.integers(1, 80),
    widths=st.lists(st.integers(1, 70), min_size=1, max_size=3),
)
def test_add_lora_random_runs(runs: list[tuple[int, int]], ranks: list[int], hidden: int,
                              widths: list[int]) -> None:
    """Short (native) and long (> 32 tokens, per-slot matmul) runs of one slot mixed with
    base-model tokens; odd sizes and ranks."""
    slots = sorted(s for s, n in runs for _ in range(n))
    case = SGMVCase("random", tuple(slots), tuple(ranks), hidden, tuple(widths))
    check_add_lora(case, torch.float32, "cpu", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [(1, 2, 1, 3, 1), (20, 9, 40)], ids=["decode", "past-plan"])
def test_lora_items_planned_or_claimed(dtype: torch.dtype, tokens: tuple[int, ...]) -> None:
    """A decode step's call (up to 64 tokens) shares its work items out before the team
    starts, costliest first to the least loaded thread (common.h: lora_plan_items); larger
    calls claim them at run time. Either way each item writes its own rows the same way:
    the outputs at 2 and 3 threads are the single thread's bit for bit, and float64's."""
    if dtype == torch.bfloat16 and not cpu_native.can_skinny(torch.bfloat16):
        pytest.skip("no bfloat16 native kernels here")
    slots_of = tuple(s for s, n in enumerate(tokens) for _ in range(n))
    case = SGMVCase("plan", slots_of, (8, 16, 32, 8, 16), 96, (64, 32, 32))
    inp = make_sgmv_inputs(case, dtype, "cpu")
    slots = lora_slots(case, inp, "per_slot")
    meta = SGMVMeta.build(case.token_slots, case.slot_ranks)
    assert meta.short_segments is not None
    outs = []
    for threads in (1, 2, 3):
        out = torch.zeros(len(slots_of), 128, dtype=dtype)
        with torch_threads(threads):
            cpu_native.add_lora(out, inp.x, meta.short_segments, slots)
        outs.append(out)
    assert outs[0].abs().sum() > 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    with torch_threads(2):
        check_add_lora(case, dtype, "cpu", "cpu")


def test_add_lora_past_the_short_limit() -> None:
    """Prefill segments past ``SHORT_SEGMENT_LEN`` (a chunk's share of one adapter) at the
    limit the engine builds float32 steps with: where ``native_lora_any_length`` they all
    go to the native kernel, else the long ones to the per-slot matmuls; either way the
    float64 oracle's sums."""
    slots = [-1] * 7 + [0] * 600 + [1] * 70 + [2] * 530 + [-1] * 3
    case = SGMVCase("past-limit", tuple(slots), (8, 32, 16), 72, (40, 24, 24))
    limit = short_segment_limit(torch.float32)
    meta = SGMVMeta.build(case.token_slots, case.slot_ranks, short_segment_len=limit)
    long_lens = [meta.seg_lens_list[i] for i in meta.long_segment_ids]
    assert long_lens == ([] if cpu_native.native_lora_any_length() else [600, 530])
    check_add_lora(case, torch.float32, "cpu", "cpu", segment_len=limit)


def test_add_lora_partial_targets() -> None:
    check_partial_targets(torch.float32)


@pytest.mark.skipif("avx512f" not in cpu_native._cpu_signature().split()
                    or not {"avx2", "fma"} <= set(cpu_native._cpu_signature().split()),
                    reason="needs AVX-512 and AVX2 with FMA: the two builds compared")
@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    runs=st.lists(st.tuples(st.integers(-1, 3), st.integers(1, 11)), min_size=1, max_size=6),
    ranks=st.lists(st.sampled_from([1, 8, 16, 33, 64]), min_size=4, max_size=4),
    hidden=st.integers(1, 80),
    widths=st.lists(st.integers(1, 150), min_size=1, max_size=3),
)
def test_add_lora_avx2_build_matches(avx2_library: ctypes.CDLL, runs: list[tuple[int, int]],
                                     ranks: list[int], hidden: int, widths: list[int]) -> None:
    """The float32 LoRA kernel as an AVX2-only CPU gets it (tiles of 16 columns, 8-float
    vectors) gives this machine's AVX-512 build's outputs to float32 rounding (the two
    builds' tails of columns past whole tiles round apart by an ulp). Groups of 1-4 tokens
    (each multiplies only its own), ranks past whole tiles, odd widths."""
    slots_of = sorted(s for s, n in runs for _ in range(n))
    case = SGMVCase("avx2", tuple(slots_of), tuple(ranks), hidden, tuple(widths))
    inp = make_sgmv_inputs(case, torch.float32, "cpu")
    slots = lora_slots(case, inp, "per_slot")
    segments = SGMVMeta.build(case.token_slots, case.slot_ranks).short_segments
    assert segments is not None
    tile = cpu_native.lora_tile_of(avx2_library)
    assert tile == 16 and cpu_native.lora_tile(torch.float32) == 64
    other = copy.copy(slots)  # the same weights in the AVX2 build's tiled layout
    other.at_ptrs, other.bt_ptrs = slots.at_ptrs.clone(), slots.bt_ptrs.clone()
    keep = []
    assert cpu_native.lora_rank_multiple_of(avx2_library, torch.float32) == 8
    for s, pair in enumerate(slots.weights):
        if pair is not None:
            rank = int(slots.ranks[s])  # both builds' multiple
            at, bt = tiled_layout(pair[0][:, :rank], pair[1][:rank], slots.slices[s], tile)
            keep.append((at, bt))
            other.at_ptrs[s], other.bt_ptrs[s] = at.data_ptr(), bt.data_ptr()
    out0 = torch.randn(len(slots_of), inp.slice_offsets[-1])
    here, avx2 = out0.clone(), out0.clone()
    cpu_native.add_lora(here, inp.x, segments, slots)
    cpu_native.add_lora(avx2, inp.x, segments, other, lib=avx2_library)
    assert not torch.equal(here, out0) or not any(s >= 0 for s in slots_of)
    torch.testing.assert_close(avx2, here, rtol=1e-5, atol=1e-5)



@pytest.mark.skipif(not cpu_native.can_skinny(torch.float32),
                    reason="this CPU has neither AVX-512 nor AVX2 with FMA (the skinny GEMM's)")
@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    runs=st.lists(st.tuples(st.integers(-1, 3), st.integers(1, 9)), min_size=1, max_size=8),
    ranks=st.lists(st.sampled_from([1, 8, 16, 33]), min_size=4, max_size=4),
    hidden=st.integers(1, 80),
    widths=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    threads=st.sampled_from([1, 2, 3]),
    bf16=st.booleans(),
)
def test_skinny_gemm_and_lora_in_one_call(runs: list[tuple[int, int]], ranks: list[int],
                                          hidden: int, widths: list[int], threads: int,
                                          bf16: bool) -> None:
    """A decode batch's projection: the fused native call (one parallel region) gives
    exactly what the skinny GEMM and then the LoRA kernel give apart, rows of base tokens
    included; past 64 rows ``linear_lora`` takes the two apart. bfloat16 where the skinny
    GEMM runs it (AVX512_BF16, or AVX2), else float32."""
    dtype = torch.bfloat16 if bf16 and cpu_native.can_skinny(torch.bfloat16) else torch.float32
    slots_of = sorted(s for s, n in runs for _ in range(n))
    case = SGMVCase("decode", tuple(slots_of), tuple(ranks), hidden, tuple(widths))
    inp = make_sgmv_inputs(case, dtype, "cpu")
    slots = lora_slots(case, inp, "per_slot")
    g = torch.Generator().manual_seed(len(slots_of))
    weight = torch.randn(inp.slice_offsets[-1], hidden, generator=g).to(dtype)
    bias = torch.randn(inp.slice_offsets[-1], generator=g).to(dtype)
    packed = ops.pack_linear_weight(weight)
    assert packed is not None and packed.kind == "skinny"
    meta = SGMVMeta.build(case.token_slots, case.slot_ranks)
    assert meta.short_segments is not None and not meta.long_segment_ids
    with torch_threads(threads):
        apart = cpu_native.skinny_linear(inp.x, weight, bias)
        cpu_native.add_lora(apart, inp.x, meta.short_segments, slots)
        fused = ops.linear_lora(inp.x, torch.empty(0), bias, packed, slots, inp.scales, meta)
    assert torch.equal(fused, apart)
    plain = cpu_native.skinny_linear(inp.x, weight, bias)
    base = [t for t, s in enumerate(case.token_slots) if s < 0]
    assert torch.equal(fused[base], plain[base]), "a base-model row got a LoRA delta"
    if meta.has_lora:
        assert not torch.equal(fused, plain)
    many = inp.x.repeat(-(-65 // inp.x.shape[0]), 1)[:65]  # 65 rows: oneDNN, then LoRA
    meta65 = SGMVMeta.build([0] * 65, case.slot_ranks)
    out = ops.linear_lora(many, torch.empty(0), bias, packed, slots, inp.scales, meta65)
    expected = ops.linear(many, torch.empty(0), bias, packed)
    cpu_native.add_lora(expected, many, meta65.short_segments, slots)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.skipif(not cpu_native.can_skinny(torch.float32),
                    reason="this CPU has neither AVX-512 nor AVX2 with FMA (the skinny GEMM's)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_lora_read_ahead_changes_no_result(dtype: torch.dtype, threads: int) -> None:
    """A decode step's projection with the GEMM reading its LoRA weights ahead (csrc/lora.h)
    and without: the same output bit for bit, forced either way whatever this CPU's default
    (AMD's Zen 4 has it on), and the default back after. 21 rows over 9 slots of three
    ranks and two slices, as in the offline workload's decode steps, base rows between."""
    if dtype == torch.bfloat16 and not cpu_native.can_skinny(dtype):
        pytest.skip("the bfloat16 skinny GEMM does not run here")
    default = cpu_native.lora_read_ahead()
    slots_of = (-1, 0, 0, 1, 2, 2, 2, 3, -1, 4, 5, 5, 6, 7, 8, 8, -1, 1, 3, 6, 7)
    case = SGMVCase("decode", tuple(sorted(slots_of)), (8, 16, 32, 8, 16, 32, 8, 16, 32),
                    96, (64, 96))
    inp = make_sgmv_inputs(case, dtype, "cpu")
    slots = lora_slots(case, inp, "per_slot")
    g = torch.Generator().manual_seed(21)
    weight = torch.randn(inp.slice_offsets[-1], 96, generator=g).to(dtype)
    packed = ops.pack_linear_weight(weight)
    assert packed is not None and packed.kind == "skinny"
    meta = SGMVMeta.build(case.token_slots, case.slot_ranks)
    assert meta.has_lora and meta.short_segments is not None
    outs = {}
    try:
        built = cpu_native.lora_read_ahead(True)  # False: an AVX2 build leaves it out
        with torch_threads(threads):
            for on in (False, True):
                assert cpu_native.lora_read_ahead(on) == (on and built)
                outs[on] = ops.linear_lora(inp.x, torch.empty(0), None, packed, slots,
                                           inp.scales, meta)
    finally:
        assert cpu_native.lora_read_ahead("auto") == default
    assert torch.equal(outs[True], outs[False])
    apart = cpu_native.skinny_linear(inp.x, weight)
    cpu_native.add_lora(apart, inp.x, meta.short_segments, slots)
    assert torch.equal(outs[True], apart)
