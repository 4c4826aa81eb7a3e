"""Every kernel compiles for Hopper (sm_90) to a cubin, without a GPU.

The interpreter runs kernels as NumPy, so it accepts code the real compiler rejects
(pointer selects in branches, dot shapes, layouts). Compiling ahead of time with the
ptxas shipped in the Triton wheel catches those on CPU-only CI.
"""

from __future__ import annotations

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loraplex_kernels import attention_triton as attn
from loraplex_kernels import sgmv_triton as sgmv

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("nvidia" not in triton.backends.backends,
                       reason="Triton built without the NVIDIA backend"),
]

DT = "bf16"
META = {"sorted_ids_ptr": "i64", "active_slots_ptr": "i32", "seg_starts_ptr": "i32",
        "seg_lens_ptr": "i32", "slot_ranks_ptr": "i32"}
PAGED = {"block_tables_ptr": "i32", "seq_lens_ptr": "i32", "query_start_ptr": "i32"}
SCALES = ("scale_log2", "scale", "softcap")  # the attention kernels' float scalars

# kernel, pointer element types, float scalars, constexprs (as the launchers pick them)
KERNELS: list[tuple[str, object, dict[str, str], tuple[str, ...], dict[str, object]]] = [
    ("shrink-decode", sgmv._sgmv_shrink_kernel,
     {"x_ptr": DT, "a0_ptr": DT, "a1_ptr": DT, "a2_ptr": DT, "scales_ptr": "fp32",
      "out_ptr": DT, **META}, (),
     {"NUM_SLICES": 3, "BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 128,
      "DOT_PRECISION": "tf32"}),
    ("shrink-prefill", sgmv._sgmv_shrink_kernel,
     {"x_ptr": DT, "a0_ptr": DT, "a1_ptr": DT, "a2_ptr": DT, "scales_ptr": "fp32",
      "out_ptr": DT, **META}, (),
     {"NUM_SLICES": 1, "BLOCK_M": 64, "BLOCK_R": 32, "BLOCK_K": 64,
      "DOT_PRECISION": "tf32"}),
    ("expand", sgmv._sgmv_expand_kernel,
     {"y_ptr": DT, "b0_ptr": DT, "b1_ptr": DT, "b2_ptr": DT, "out_ptr": DT, **META}, (),
     {"NUM_SLICES": 3, "BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_R": 16,
      "DOT_PRECISION": "tf32"}),
    ("store-kv", attn._store_kv_kernel,
     {"key_ptr": DT, "value_ptr": DT, "k_cache_ptr": DT, "v_cache_ptr": DT,
      "slot_ptr": "i64"}, (), {"BLOCK_D": 128}),
    ("decode-split", attn._paged_decode_kernel,
     {"q_ptr": DT, "k_cache_ptr": DT, "v_cache_ptr": DT, "out_ptr": DT,
      "part_acc_ptr": "fp32", "part_ml_ptr": "fp32", **PAGED}, SCALES,
     {"BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128, "SPLIT": True,
      "DOT_PRECISION": "tf32", "WINDOW": False, "SOFTCAP": False}),
    ("decode-split-window-softcap", attn._paged_decode_kernel,
     {"q_ptr": DT, "k_cache_ptr": DT, "v_cache_ptr": DT, "out_ptr": DT,
      "part_acc_ptr": "fp32", "part_ml_ptr": "fp32", **PAGED}, SCALES,
     {"BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128, "SPLIT": True,
      "DOT_PRECISION": "tf32", "WINDOW": True, "SOFTCAP": True}),
    ("merge", attn._merge_splits_kernel,
     {"out_ptr": DT, "part_acc_ptr": "fp32", "part_ml_ptr": "fp32",
      "query_start_ptr": "i32"}, (), {"BLOCK_S": 8, "BLOCK_D": 128}),
    ("prefill", attn._paged_prefill_kernel,
     {"q_ptr": DT, "k_cache_ptr": DT, "v_cache_ptr": DT, "out_ptr": DT, **PAGED}, SCALES,
     {"BLOCK_Q": 64, "BLOCK_N": 32, "BLOCK_D": 128, "DOT_PRECISION": "tf32",
      "WINDOW": False, "SOFTCAP": False}),
    ("prefill-window-softcap", attn._paged_prefill_kernel,
     {"q_ptr": DT, "k_cache_ptr": DT, "v_cache_ptr": DT, "out_ptr": DT, **PAGED}, SCALES,
     {"BLOCK_Q": 64, "BLOCK_N": 32, "BLOCK_D": 128, "DOT_PRECISION": "tf32",
      "WINDOW": True, "SOFTCAP": True}),
]


@pytest.mark.parametrize(("name", "kernel", "pointers", "floats", "constexprs"), KERNELS,
                         ids=[k[0] for k in KERNELS])
def test_kernel_compiles_for_sm90(name: str, kernel: triton.runtime.JITFunction,
                                  pointers: dict[str, str], floats: tuple[str, ...],
                                  constexprs: dict[str, object]) -> None:
    if not isinstance(kernel, triton.runtime.JITFunction):
        pytest.skip("kernels were defined under TRITON_INTERPRET=1")
    signature = {}
    for arg in kernel.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = "*" + pointers[arg]
        else:
            signature[arg] = "fp32" if arg in floats else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"], f"{name}: no cubin"
    # Hopper gives a block at most 227 KiB of shared memory.
    assert compiled.metadata.shared <= 227 * 1024, f"{name}: {compiled.metadata.shared} B"
