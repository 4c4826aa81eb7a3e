"""A step's decoder layers in one native call (``cpu_decode``, ``csrc/cpu_decode_layers.c``)
against the same native kernels called one by one, with what each layer row carries of its
family: its own sliding window and attention-logit soft-cap (Gemma 2/3 alternate windowed
and global layers), q/k norms (per head, or over each projection), the norm layout
("pre", "sandwich", "post") with its extra norms, SiLU or GELU-tanh, a residual
multiplier, and which of the step's rotations it takes (one without RoPE among them).

The layers are tiny and random, without LoRA; a step holds decode rows and a prefill chunk
after cached prefixes longer than the windows, so every layer's window cuts keys off.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

import pytest
import torch
from kernel_cases import torch_threads

from loraplex_kernels import cpu_decode, cpu_native, ops
from loraplex_kernels.lora_slots import LoRASlots
from loraplex_kernels.meta import AttentionMeta

pytestmark = pytest.mark.skipif(
    not cpu_decode.available() or not cpu_native.can_skinny(torch.float32),
    reason="no native decode layers here (no C compiler, or no skinny GEMM on this CPU)")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 96
Q_SIZE, KV_SIZE = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
EPS = 1e-5
SCALE = HEAD_DIM ** -0.5
BLOCK_SIZE = 4
# (cached positions before the step, new tokens): two decode rows and a prefill chunk
SEQS = [(37, 1), (22, 1), (19, 6)]


@dataclass(frozen=True)
class Config:
    """One layer row's settings beside its weights (``cpu_decode.layer_row``'s keywords)."""

    window: int = 0
    softcap: float = 0.0
    qk_norm: str = ""
    norm_layout: str = "pre"
    activation: str = "silu"
    residual_scale: float = 1.0
    rope: int = 0


# each layer's window and softcap: a global layer, windows not multiples of the block size,
# a window of one key
LAYERS = [Config(0, 0.0), Config(5, 0.0), Config(0, 2.0), Config(7, 3.0), Config(1, 0.0)]
# every family's parts, and each layout after each other one: Llama; Gemma 3 (sandwich,
# GELU, per-head q/k norms, a second rotation); OLMo 2 (post, q/k norms over the
# projections) without RoPE (SmolLM3's NoPE layer: the third rotation, cos 1 and sin 0);
# Granite (a residual multiplier) after it; Gemma 2 with a multiplier of its own; OLMo 2
# after Gemma and first
FAMILY_LAYERS = [
    Config(),
    Config(5, 2.0, "head", "sandwich", "gelu_pytorch_tanh", rope=1),
    Config(0, 0.0, "proj", "post", rope=2),
    Config(7, 0.0, residual_scale=0.6),
    Config(0, 3.0, "", "sandwich", "gelu_pytorch_tanh", 0.5, rope=1),
    Config(1, 0.0, "head", "post", residual_scale=1.5),
]
FIRST_POST = [Config(0, 0.0, "proj", "post"), Config(3, 0.0, "head", "sandwich", rope=1)]


@dataclass
class Layer:
    input_norm: torch.Tensor  # [hidden]
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    post_feedforward_norm: torch.Tensor
    head_norms: tuple[torch.Tensor, torch.Tensor]  # q, k: [head_dim] each
    proj_norms: tuple[torch.Tensor, torch.Tensor]  # q [q_size], k [kv_size]
    weights: list[torch.Tensor]  # qkv, o, gate_up, down: [out, in]
    slots: list[LoRASlots]  # empty: no adapter loaded

    def qk_norms(self, kind: str) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        return {"head": self.head_norms, "proj": self.proj_norms}.get(kind, (None, None))


def _layer(dtype: torch.dtype, g: torch.Generator) -> Layer:
    shapes = [(Q_SIZE + 2 * KV_SIZE, HIDDEN), (HIDDEN, Q_SIZE), (2 * INTER, HIDDEN),
              (HIDDEN, INTER)]
    weights = [(torch.randn(o, i, generator=g) / i ** 0.5).to(dtype) for o, i in shapes]
    slots = [LoRASlots(i, [o], 1, 8, dtype, torch.device("cpu"), "per_slot")
             for o, i in shapes]

    def norm(size: int) -> torch.Tensor:
        return (1 + 0.2 * torch.randn(size, generator=g)).to(dtype)

    return Layer(norm(HIDDEN), norm(HIDDEN), norm(HIDDEN), norm(HIDDEN),
                 (norm(HEAD_DIM), norm(HEAD_DIM)), (norm(Q_SIZE), norm(KV_SIZE)), weights,
                 slots)


def _row(layer: Layer, config: Config) -> list[int]:
    q_norm, k_norm = layer.qk_norms(config.qk_norm)
    return cpu_decode.layer_row(
        None if config.norm_layout == "post" else layer.input_norm, layer.post_attention_norm,
        [(w, None, s) for w, s in zip(layer.weights, layer.slots, strict=True)],
        window=config.window, softcap=config.softcap, qk_norm=config.qk_norm,
        q_norm=q_norm, k_norm=k_norm, norm_layout=config.norm_layout,
        pre_feedforward_norm=layer.pre_feedforward_norm,
        post_feedforward_norm=layer.post_feedforward_norm, activation=config.activation,
        residual_scale=config.residual_scale, rope=config.rope)


def _double(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def test_layer_row_stores_window_and_softcap() -> None:
    layer = _layer(torch.float32, torch.Generator().manual_seed(0))
    at = cpu_decode.LAYER_FIELDS.index
    row = _row(layer, Config(4096, 50.0))
    assert len(row) == len(cpu_decode.LAYER_FIELDS)
    assert row[at("window")] == 4096
    assert _double(row[at("softcap")]) == 50.0
    default = cpu_decode.layer_row(layer.input_norm, layer.post_attention_norm,
                                   [(w, None, s) for w, s in zip(layer.weights, layer.slots,
                                                                  strict=True)])
    assert default[at("window")] == 0 and default[at("softcap")] == 0
    assert default[:at("window")] == row[:at("window")]
    for window, softcap in ((-1, 0.0), (0, -1.0), (0, float("nan"))):
        with pytest.raises(ValueError, match="window and softcap"):
            _row(layer, Config(window, softcap))


def test_layer_row_stores_the_family_parts() -> None:
    """A Llama row's new fields are the defaults (no q/k norm, "pre", SiLU, scale 1, the
    first rotation, no extra norms); a Gemma or OLMo 2 row names its norms and kinds, and
    only those its layout reads; rows that lack a norm their kinds need are refused."""
    layer = _layer(torch.float32, torch.Generator().manual_seed(0))
    at = cpu_decode.LAYER_FIELDS.index
    llama = _row(layer, Config())
    assert [llama[at(f)] for f in ("qk_norm", "q_norm", "k_norm", "norm_layout",
                                   "pre_feedforward_norm", "post_feedforward_norm",
                                   "activation", "rope")] == [0] * 8
    assert _double(llama[at("residual_scale")]) == 1.0
    gemma = _row(layer, FAMILY_LAYERS[1])
    assert gemma[at("qk_norm")] == 1 and gemma[at("norm_layout")] == 1
    assert gemma[at("q_norm")] == layer.head_norms[0].data_ptr()
    assert gemma[at("pre_feedforward_norm")] == layer.pre_feedforward_norm.data_ptr()
    assert gemma[at("post_feedforward_norm")] == layer.post_feedforward_norm.data_ptr()
    assert gemma[at("activation")] == 1 and gemma[at("rope")] == 1
    olmo = _row(layer, replace(FAMILY_LAYERS[2], residual_scale=0.25))
    assert olmo[at("input_norm")] == 0 and olmo[at("pre_feedforward_norm")] == 0
    assert olmo[at("qk_norm")] == 2 and olmo[at("k_norm")] == layer.proj_norms[1].data_ptr()
    assert olmo[at("norm_layout")] == 2 and _double(olmo[at("residual_scale")]) == 0.25
    projections = [(w, None, s) for w, s in zip(layer.weights, layer.slots, strict=True)]
    norm = layer.input_norm
    for kwargs, match in (({"qk_norm": "head"}, "q_norm, k_norm missing"),
                          ({"norm_layout": "sandwich"}, "pre_feedforward_norm"),
                          ({"norm_layout": "post"}, "post_feedforward_norm missing"),
                          ({"activation": "gelu"}, "unknown"),
                          ({"norm_layout": "postnorm"}, "unknown"),
                          ({"rope": -1}, "rope >= 0"),
                          ({"residual_scale": float("inf")}, "residual_scale")):
        with pytest.raises(ValueError, match=match):
            cpu_decode.layer_row(norm, norm, projections, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="input_norm missing"):
        cpu_decode.layer_row(None, norm, projections)


@dataclass
class Step:
    meta: AttentionMeta
    embeddings: torch.Tensor  # [rows, hidden]
    ropes: list[tuple[torch.Tensor, torch.Tensor]]  # cos, sin: [rows, 1, head_dim] float32
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, cached prefixes written


def _rotation(positions: list[int], base: float, factor: float,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    freqs = torch.outer(torch.tensor(positions, dtype=torch.float64) / factor, inv)
    emb = torch.cat([freqs, freqs], dim=-1)  # [rows, head_dim]
    return emb.cos().float().unsqueeze(1), emb.sin().float().unsqueeze(1)


def _step(dtype: torch.dtype, num_layers: int, g: torch.Generator) -> Step:
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    query_lens: list[int] = []
    positions: list[int] = []
    next_block = 0
    for cached, new in SEQS:
        n = -(-(cached + new) // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + n))[::-1])  # blocks out of order
        next_block += n
        seq_lens.append(cached + new)
        query_lens.append(new)
        positions += range(cached, cached + new)
    meta = AttentionMeta.build(tables, seq_lens, query_lens, BLOCK_SIZE)
    caches = []
    for _ in range(num_layers):
        # the prefixes' keys and values (the step's own are written by the layers)
        k = torch.randn(next_block, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        caches.append((k, torch.randn(k.shape, generator=g).to(dtype)))
    rows = len(positions)
    # the default rotation, another base with linear scaling (Gemma 3's global layers),
    # none (a NoPE layer: cos 1, sin 0)
    nope = (torch.ones(rows, 1, HEAD_DIM), torch.zeros(rows, 1, HEAD_DIM))
    ropes = [_rotation(positions, 10000.0, 1.0), _rotation(positions, 1e6, 4.0), nope]
    return Step(meta, torch.randn(rows, HIDDEN, generator=g).to(dtype), ropes, caches)


def _native(layers: list[Layer], configs: list[Config], step: Step,
            ropes: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cpu_decode.run`` over the step: (last MLP output, residual stream before it).
    ``ropes``: the step's rotations as ``run`` gets them (default: all the step's)."""
    table = torch.tensor([_row(layer, c) for layer, c in zip(layers, configs, strict=True)],
                         dtype=torch.int64)
    kv = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in step.caches],
                      dtype=torch.int64)
    ropes = step.ropes if ropes is None else ropes
    rope_table = torch.tensor([[c.data_ptr(), s.data_ptr()] for c, s in ropes],
                              dtype=torch.int64)
    x = step.embeddings.clone()
    n, dtype = x.shape[0], x.dtype
    out = torch.empty_like(x)
    scratch = {name: torch.empty(n, width, dtype=dtype) for name, width in
               (("qkv", Q_SIZE + 2 * KV_SIZE), ("attn", Q_SIZE), ("gate_up", 2 * INTER),
                ("act", INTER), ("tmp", HIDDEN))}
    m = step.meta
    bf16 = dtype == torch.bfloat16
    cos, sin = ropes[0]
    fields = {
        "rows": n, "hidden": HIDDEN, "q_size": Q_SIZE, "kv_size": KV_SIZE, "inter": INTER,
        "num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "block_size": BLOCK_SIZE, "num_cache_slots": step.caches[0][0].shape[0] * BLOCK_SIZE,
        "x": out.data_ptr(), "residual": x.data_ptr(),
        **{name: t.data_ptr() for name, t in scratch.items()},
        "cos": cos.data_ptr(), "sin": sin.data_ptr(),
        "cs_stride": cos.stride(0), "slot_mapping": m.slot_mapping.data_ptr(),
        "block_tables": m.block_tables.data_ptr(), "table_stride": m.block_tables.stride(0),
        "seq_lens": m.seq_lens.data_ptr(), "seq_ids": m.decode_seq_ids.data_ptr(),
        "seq_rows": m.decode_rows.data_ptr(), "num_seqs": m.decode_seq_ids.numel(),
        "query_start_loc": m.query_start_loc.data_ptr(),
        "prefill_ids": m.prefill_seq_ids.data_ptr(), "num_prefill": m.prefill_seq_ids.numel(),
        "seg_first": 0, "seg_len": 0, "seg_slot": 0, "num_segs": 0,
        "first": 1, "bf16": int(bf16),
        "impl": cpu_native.BF16_IMPLS[cpu_native.bf16_impl()] if bf16 else 0,
        "num_threads": torch.get_num_threads(),
        "ropes": rope_table.data_ptr(), "num_ropes": len(ropes),
    }
    cpu_decode.run(table, len(layers), kv, fields, EPS, SCALE)
    return out, x


def _one_by_one(layers: list[Layer], configs: list[Config], step: Step,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layers through the native kernels one call each (``ops``), in the order
    and on the values of the model's layer loop (``decoder.DecoderLayer.forward``)."""
    x = step.embeddings.clone()
    n = x.shape[0]
    residual: torch.Tensor | None = None
    for i, (layer, c) in enumerate(zip(layers, configs, strict=True)):
        if c.norm_layout == "post":  # the stream itself goes in
            residual = x if residual is None else x + residual
            x = residual
        elif residual is None:
            residual = x
            x = ops.rms_norm(x, layer.input_norm, EPS, backend="cpu")
        else:
            x, residual = ops.fused_add_rms_norm(x, residual, layer.input_norm, EPS,
                                                 backend="cpu")
        qkv = cpu_native.skinny_linear(x, layer.weights[0])
        q_norm, k_norm = layer.qk_norms(c.qk_norm)
        if q_norm is not None and k_norm is not None:
            for lo, hi, weight in ((0, Q_SIZE, q_norm), (Q_SIZE, Q_SIZE + KV_SIZE, k_norm)):
                part = qkv[:, lo:hi].reshape(-1, weight.shape[0])
                qkv[:, lo:hi] = ops.rms_norm(part, weight, EPS, backend="cpu").view(n, hi - lo)
        k_cache, v_cache = step.caches[i]
        q = ops.rope_store_kv(qkv, HEADS, KV_HEADS, HEAD_DIM, step.ropes[c.rope], k_cache,
                              v_cache, step.meta.slot_mapping, backend="cpu")
        attn = torch.empty(n, Q_SIZE, dtype=x.dtype)
        ops.paged_attention(q, k_cache, v_cache, step.meta, SCALE,
                            attn.view(-1, HEADS, HEAD_DIM), backend="cpu", window=c.window,
                            softcap=c.softcap)
        x = cpu_native.skinny_linear(attn, layer.weights[1])
        if c.norm_layout == "pre":
            if c.residual_scale != 1.0:
                x = x * c.residual_scale
            x, residual = ops.fused_add_rms_norm(x, residual, layer.post_attention_norm, EPS,
                                                 backend="cpu")
        else:
            x = ops.rms_norm(x, layer.post_attention_norm, EPS, backend="cpu")
            if c.residual_scale != 1.0:
                x = x * c.residual_scale
            if c.norm_layout == "sandwich":
                x, residual = ops.fused_add_rms_norm(x, residual, layer.pre_feedforward_norm,
                                                     EPS, backend="cpu")
            else:
                residual = x + residual
                x = residual
        gate_up = cpu_native.skinny_linear(x, layer.weights[2])
        act = (ops.gelu_and_mul if c.activation == "gelu_pytorch_tanh"
               else ops.silu_and_mul)(gate_up, backend="cpu")
        x = cpu_native.skinny_linear(act, layer.weights[3])
        if c.norm_layout != "pre":
            x = ops.rms_norm(x, layer.post_feedforward_norm, EPS, backend="cpu")
        if c.residual_scale != 1.0:
            x = x * c.residual_scale
    assert residual is not None
    return x, residual


def _both(dtype: torch.dtype, threads: int, configs: list[Config], other: list[Config],
          ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(native, one by one, native with ``other`` configs) over the same layers and step,
    each from the same caches."""
    if not cpu_native.can_skinny(dtype):
        pytest.skip(f"no native skinny GEMM for {dtype} here")
    g = torch.Generator().manual_seed(1)
    layers = [_layer(dtype, g) for _ in configs]
    step = _step(dtype, len(configs), g)
    caches = [(k.clone(), v.clone()) for k, v in step.caches]
    results = []
    with torch_threads(threads):
        for run in (lambda: _native(layers, configs, step),
                    lambda: _one_by_one(layers, configs, step),
                    lambda: _native(layers, other, step)):
            step.caches = [(k.clone(), v.clone()) for k, v in caches]
            results.append(run())
    return tuple(results)


THREADS = pytest.mark.parametrize("threads", [1, 2], ids=["per-kernel", "one-region"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@THREADS
@DTYPES
def test_run_gives_each_layer_its_window_and_softcap(dtype: torch.dtype,
                                                     threads: int) -> None:
    """Each layer's window and soft-cap reach its attention, decode rows and the prefill
    chunk alike, in a region per kernel (1 thread) and in one region for the step (2): the
    outputs are the kernels' called one by one, bit for bit, and differ from the same
    layers without windows and caps."""
    native, apart, plain = _both(dtype, threads, LAYERS, [Config()] * len(LAYERS))
    assert torch.equal(native[0], apart[0]) and torch.equal(native[1], apart[1])
    assert native[0].isfinite().all()
    assert not torch.equal(native[0], plain[0])


@THREADS
@DTYPES
@pytest.mark.parametrize("configs", [FAMILY_LAYERS, FIRST_POST], ids=["mixed", "post-first"])
def test_run_gives_each_layer_its_family_parts(dtype: torch.dtype, threads: int,
                                               configs: list[Config]) -> None:
    """Layers of every family's kinds, one after another (q/k norms per head and over the
    projections, the three norm layouts, GELU, residual multipliers, three rotations, one
    of them none; a "post" layer first, whose stream is the embeddings themselves): the
    outputs and the residual stream are the kernels' called one by one, bit for bit, in a
    region per kernel and in one region, and differ from Llama layers'."""
    native, apart, llama = _both(dtype, threads, configs, [Config()] * len(configs))
    assert torch.equal(native[0], apart[0]) and torch.equal(native[1], apart[1])
    assert native[0].isfinite().all() and native[1].isfinite().all()
    assert not torch.equal(native[0], llama[0])


@pytest.mark.parametrize("field", ["qk_norm", "norm_layout", "activation", "residual_scale",
                                   "rope"])
def test_run_reads_each_field(field: str) -> None:
    """Each field alone changes what the layers compute, and the native call follows it."""
    changed = {"qk_norm": "head", "norm_layout": "sandwich",
               "activation": "gelu_pytorch_tanh", "residual_scale": 0.5, "rope": 1}[field]
    configs = [Config(), replace(Config(), **{field: changed}), Config()]
    native, apart, llama = _both(torch.float32, 1, configs, [Config()] * 3)
    assert torch.equal(native[0], apart[0]) and torch.equal(native[1], apart[1])
    assert not torch.equal(native[0], llama[0])


def test_run_refuses_a_row_the_step_cannot_run() -> None:
    """A row whose rotation is past the step's tables, or a non-"pre" layout without the
    step's scratch, is refused before anything runs (ValueError)."""
    g = torch.Generator().manual_seed(2)
    layers = [_layer(torch.float32, g) for _ in range(2)]
    step = _step(torch.float32, 2, g)
    with pytest.raises(ValueError, match="rope index"):
        _native(layers, [Config(), Config(rope=2)], step, ropes=step.ropes[:2])
    table = torch.tensor([_row(layers[0], Config(norm_layout="post"))], dtype=torch.int64)
    kv = torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in step.caches[:1]],
                      dtype=torch.int64)
    fields = dict.fromkeys(cpu_decode.STEP_FIELDS, 0)
    fields.update(rows=1, num_threads=1, num_cache_slots=4)
    with pytest.raises(ValueError, match="tmp"):
        cpu_decode.run(table, 1, kv, fields, EPS, SCALE)
