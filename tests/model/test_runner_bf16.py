"""The runner in bfloat16 (weights, KV cache, GEMMs, native decode attention and LoRA with
float32 sums) against the float32 oracle, HF transformers + PEFT.

bf16 cannot be exact, so logits are compared within a bf16 tolerance, teacher-forced on
the oracle's own greedy continuation (the same positions for both), once per bf16 kernel
implementation this machine runs; free-running greedy agreement with float32 is measured
and bounded below. The model's head size is 64, the one the vectorised kernels take.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import CacheConfig, LoRAConfig, ModelConfig
from loraplex.model.adapter_loader import TargetShapes, load_adapter
from loraplex.model.runner import BatchInputs, ModelRunner, SeqInput
from loraplex.model.sampler import SamplingRow
from loraplex.testing import build_adapter, build_tiny_model, load_reference, runner_logits
from loraplex_kernels import cpu_decode, cpu_native, ops

NUM_NEW = 8
GREEDY = SamplingRow()
NAMES: list[str | None] = [None, "r8", "r16qv", "r8", None, "r16qv", "r8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("bf16_llama"), hidden_size=128,
                            intermediate_size=256, num_heads=2, num_kv_heads=1, seed=3)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16_adapters")
    return {"r8": build_adapter(root / "r8", model_dir, rank=8, alpha=16.0, seed=21),
            "r16qv": build_adapter(root / "r16qv", model_dir, rank=16, alpha=16.0, seed=22,
                                   target_modules=("q_proj", "v_proj"))}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 380) for _ in range(rng.randrange(3, 40))] for _ in NAMES]


@pytest.fixture(scope="module")
def oracle(model_dir: Path, adapters: dict[str, Path],
           prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """Per sequence: the float32 oracle's greedy continuation and its logits at the last
    prompt position and every continuation position but the last, [NUM_NEW, vocab]."""
    refs = {name: load_reference(model_dir, None if name is None else adapters[name])
            for name in set(NAMES)}
    out = []
    for name, prompt in zip(NAMES, prompts, strict=True):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(NUM_NEW):
                ids.append(int(refs[name](input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            logits = refs[name](input_ids=torch.tensor([ids])).logits[0]
        out.append((ids[len(prompt):], logits[len(prompt) - 1:len(ids) - 1]))
    return out


SLOT_OF = {"r8": 2, "r16qv": 0}  # the adapters' slots in the runners below


def _runner(model_dir: Path, adapters: dict[str, Path], dtype: str,
            num_kv_blocks: int) -> ModelRunner:
    """A runner of ``dtype`` with both adapters in their slots (``SLOT_OF``)."""
    runner = ModelRunner(ModelConfig(str(model_dir), dtype=dtype),
                         CacheConfig(num_kv_blocks=num_kv_blocks),
                         LoRAConfig(max_loras=3, max_lora_rank=16, max_cpu_loras=3),
                         progress=False)
    target = TargetShapes.from_model_dir(model_dir)
    for name, slot in SLOT_OF.items():
        runner.set_lora_slot(slot, load_adapter(adapters[name], target, 16, name=name))
    return runner


def _forced_logits(model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
                   continuations: list[list[int]], dtype: str,
                   names: list[str | None] = NAMES) -> torch.Tensor:
    """The runner's logits [num_seqs, NUM_NEW, vocab], fed the given continuations: one
    prefill step, then decode steps of one token each (the native kernels' path)."""
    runner = _runner(model_dir, adapters, dtype, 64)
    slots = [-1 if n is None else SLOT_OF[n] for n in names]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2, 40 + i] for i in range(len(NAMES))]
    steps = [runner_logits(runner, BatchInputs([
        SeqInput(p, 0, t, s, [GREEDY]) for p, t, s in zip(prompts, tables, slots, strict=True)]))]
    for k in range(NUM_NEW - 1):
        steps.append(runner_logits(runner, BatchInputs([
            SeqInput([c[k]], len(p) + k, t, s, [GREEDY])
            for p, c, t, s in zip(prompts, continuations, tables, slots, strict=True)])))
    return torch.stack(steps, dim=1).float()


@pytest.fixture(params=cpu_native.bf16_impls() or ("portable",))
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    name: str = request.param
    monkeypatch.setenv("LORAPLEX_CPU_BF16", "portable" if name == "portable" else "auto")
    return name


# The default (the native skinny GEMM for bf16 decode batches where the CPU has
# AVX512_BF16, oneDNN's packed copy elsewhere), the skinny GEMM in float32 too, oneDNN's
# bf16 GEMM where the CPU has it, and the float32 GEMM over bf16 weights that CPUs without
# it (AVX2 only) take, forced here so every machine runs each it can.
@pytest.mark.parametrize("gemm", ["auto", "skinny", "onednn", "onednn-f32"])
def test_bfloat16_logits_are_close_to_the_float32_oracle(
        model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
        oracle: list[tuple[list[int], torch.Tensor]], impl: str, gemm: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", gemm)
    continuations = [c for c, _ in oracle]
    expected = torch.stack([lg for _, lg in oracle])  # [num_seqs, NUM_NEW, vocab]
    got = _forced_logits(model_dir, adapters, prompts, continuations, "bfloat16")
    scale = expected.abs().amax(dim=-1, keepdim=True)  # per position
    err = ((got - expected).abs() / scale).amax().item()
    # bf16 keeps 8 significant bits (relative step 2^-8 = 0.4 %) in two layers' worth of
    # rounded weights and activations: a few steps' worth, far from a wrong result.
    assert err < 0.05, f"bf16 logits differ from float32 by {err:.3f} of their range"
    # The adapters' deltas are visible in bf16: a LoRA row differs from the base model's
    # own logits for the same tokens by far more than the bf16 error.
    assert err < 0.5 * (expected[1] - expected[0]).abs().amax().item() / scale.max().item()
    # And float32 through the same runner stays exact (the parity oracle's bound).
    exact = _forced_logits(model_dir, adapters, prompts, continuations, "float32")
    assert (exact - expected).abs().max().item() < 1e-4


def test_bfloat16_greedy_agrees_with_float32(model_dir: Path, adapters: dict[str, Path],
                                            prompts: list[list[int]], impl: str) -> None:
    """Free-running greedy decoding, bf16 against float32, through the whole engine:
    most tokens agree (ties in a random tiny model's logits may flip), and the first
    token of every request does."""
    outs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(model_dir), dtype=dtype, progress=False, max_lora_rank=16, max_loras=2)
        loras = [None if n is None else LoRARequest(n, str(adapters[n])) for n in NAMES]
        result = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NUM_NEW,
                                                      ignore_eos=True), loras)
        outs[dtype] = [r.outputs[0].token_ids for r in result]
        llm.close()
    pairs = list(zip(outs["float32"], outs["bfloat16"], strict=True))
    assert all(a[0] == b[0] for a, b in pairs), pairs
    same = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=True))
    assert same >= 0.75 * NUM_NEW * len(NAMES), f"{same} of {NUM_NEW * len(NAMES)} agree"


@pytest.mark.parametrize("dtype,gemm", [("bfloat16", "auto"), ("float32", "skinny")])
@pytest.mark.parametrize("with_lora", [True, False])
def test_native_decode_layers_match_the_layer_by_layer_path(
        model_dir: Path, adapters: dict[str, Path], prompts: list[list[int]],
        oracle: list[tuple[list[int], torch.Tensor]], dtype: str, gemm: str, with_lora: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's layers in one native call (cpu_decode) against the same kernels called
    layer by layer from Python: the same logits, bit for bit, with LoRA rows, base rows and
    steps without adapters, the prompts' prefill step as well as the decode steps."""
    if not cpu_native.can_skinny(getattr(torch, dtype)):
        pytest.skip(f"the skinny GEMM does not run {dtype} on this CPU")
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", gemm)
    continuations = [c for c, _ in oracle]
    calls = []
    run = cpu_decode.run
    monkeypatch.setattr(cpu_decode, "run", lambda *a: calls.append(1) or run(*a))
    names = NAMES if with_lora else [None] * len(NAMES)
    native = _forced_logits(model_dir, adapters, prompts, continuations, dtype, names)
    # every decode step, and the prefill step where its rows fit the skinny GEMM
    prefill_rows = sum(len(p) for p in prompts)
    steps = NUM_NEW - 1 + (prefill_rows <= ops.skinny_max_rows(getattr(torch, dtype)))
    assert len(calls) == steps
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    layered = _forced_logits(model_dir, adapters, prompts, continuations, dtype, names)
    assert len(calls) == steps
    assert torch.equal(native, layered)




# Mixed steps: (slot name, prompt length) per sequence, and the tokens each step computes
# of each: the third's prompt is chunked over the first two steps, the fifth arrives in
# the third (74 rows: past SKINNY_AMX_OWN_ROWS, which the team packs for the tiles together).
MIXED = [(None, 7), ("r16qv", 11), ("r8", 15), ("r8", 9), (None, 70)]
MIXED_PLAN = [{0: 7, 1: 11, 2: 6}, {0: 1, 1: 1, 2: 9, 3: 9}, {0: 1, 1: 1, 2: 1, 3: 1, 4: 70}]


def _mixed_steps(model_dir: Path, adapters: dict[str, Path], dtype: str,
                 ) -> tuple[torch.Tensor, list[tuple[str | None, list[int]]]]:
    """Three steps that mix decode rows and prefill chunks: a first step of two prompts
    and the first chunk of a third; then decode rows, the rest of that chunked prompt (a
    prefill chunk after cached positions) and a new prompt; then decode rows and another
    new prompt, base and LoRA rows in each. Returns the logits of every sampling row, step
    after step [rows, vocab], and per row its adapter and the tokens it has seen."""
    runner = _runner(model_dir, adapters, dtype, 48)
    rng = random.Random(9)
    tokens = [[rng.randrange(3, 380) for _ in range(n + 2)] for _, n in MIXED]
    done = [0] * len(MIXED)  # tokens of each sequence in the cache
    logits, seen = [], []
    for step in MIXED_PLAN:
        seqs = []
        for i, n in step.items():
            name, prompt_len = MIXED[i]
            end = done[i] + n
            samples = [GREEDY] if end >= prompt_len else []
            seqs.append(SeqInput(tokens[i][done[i]:end], done[i], [8 * i + j for j in range(8)],
                                 -1 if name is None else SLOT_OF[name], samples))
            if samples:
                seen.append((name, tokens[i][:end]))
            done[i] = end
        logits.append(runner_logits(runner, BatchInputs(seqs)).float())
    return torch.cat(logits), seen


@pytest.mark.usefixtures("amx_restored")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype,gemm,amx", [("bfloat16", "auto", "auto"), ("bfloat16", "auto", "0"),
                                            ("float32", "skinny", "auto")])
def test_native_layers_take_mixed_steps(
        model_dir: Path, adapters: dict[str, Path], dtype: str, gemm: str, amx: str,
        threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of decode rows and prefill chunks (new prompts, and a prompt's second chunk
    after its cached first) run in one native call each where their rows fit the skinny
    GEMM (in bfloat16 on AMX tiles where the CPU has them, and on its vector kernel), on
    one thread (a parallel region per kernel) and on two (the whole step in one region):
    their logits are bit for bit the layer-by-layer path's and, in float32, the HF + PEFT
    oracle's."""
    if not cpu_native.can_skinny(getattr(torch, dtype)):
        pytest.skip(f"the skinny GEMM does not run {dtype} on this CPU")
    monkeypatch.setenv("LORAPLEX_CPU_GEMM", gemm)
    monkeypatch.setenv("LORAPLEX_CPU_AMX", amx)  # each runner applies it
    calls = []
    run = cpu_decode.run
    monkeypatch.setattr(cpu_decode, "run", lambda *a: calls.append(1) or run(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native, seen = _mixed_steps(model_dir, adapters, dtype)
        # the steps whose rows fit the skinny GEMM as the runner set it up
        steps = sum(sum(p.values()) <= ops.skinny_max_rows(getattr(torch, dtype))
                    for p in MIXED_PLAN)
        assert steps >= 2
        assert len(calls) == steps
        monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
        layered, _ = _mixed_steps(model_dir, adapters, dtype)
        assert len(calls) == steps
    finally:
        torch.set_num_threads(before)
    assert torch.equal(native, layered)
    if dtype == "float32":
        refs = {name: load_reference(model_dir, None if name is None else adapters[name])
                for name in {n for n, _ in seen}}
        with torch.no_grad():
            expected = torch.stack([refs[name](input_ids=torch.tensor([ids])).logits[0, -1]
                                    for name, ids in seen])
        assert (native - expected).abs().max().item() < 1e-4

def _wide_decode_logits(model_dir: Path, adapters: dict[str, Path], rows: int) -> torch.Tensor:
    """A decode step of ``rows`` sequences (base rows and two adapters' rows, interleaved),
    after their prompts' prefill: its logits [rows, vocab]."""
    runner = _runner(model_dir, adapters, "bfloat16", rows + 8)
    rng = random.Random(rows)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(2, 12))] for _ in range(rows)]
    slots = [(-1, 0, 2)[i % 3] for i in range(rows)]
    runner_logits(runner, BatchInputs([SeqInput(p, 0, [i], s, [GREEDY])
                                       for i, (p, s) in enumerate(zip(prompts, slots, strict=True))]))
    return runner_logits(runner, BatchInputs([
        SeqInput([rng.randrange(3, 380)], len(p), [i], s, [GREEDY])
        for i, (p, s) in enumerate(zip(prompts, slots, strict=True))])).float()


@pytest.mark.skipif(not (cpu_native.can_skinny(torch.bfloat16) and cpu_native.skinny_amx()),
                    reason="the bfloat16 skinny GEMM does not run on AMX tiles here")
@pytest.mark.usefixtures("amx_restored")
def test_native_decode_layers_take_amx_sized_batches(
        model_dir: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """On AMX tiles the bfloat16 skinny GEMM takes batches of up to SKINNY_AMX_MAX_ROWS rows
    (ops.skinny_max_rows), and the native decode layers with it: a decode step of 200 rows,
    with LoRA and base rows, runs in one native call, its logits bit for bit the layer by
    layer path's; with AMX off the same step goes layer by layer."""
    monkeypatch.delenv("LORAPLEX_CPU_GEMM", raising=False)
    rows = 200
    assert ops.SKINNY_MAX_ROWS < rows <= ops.SKINNY_AMX_MAX_ROWS
    calls = []
    run = cpu_decode.run
    monkeypatch.setattr(cpu_decode, "run", lambda *a: calls.append(1) or run(*a))
    native = _wide_decode_logits(model_dir, adapters, rows)
    assert len(calls) == 1
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    assert torch.equal(native, _wide_decode_logits(model_dir, adapters, rows))
    assert len(calls) == 1
    monkeypatch.delenv(cpu_decode.ENV_SWITCH)
    monkeypatch.setenv("LORAPLEX_CPU_AMX", "0")  # each runner applies it
    _wide_decode_logits(model_dir, adapters, rows)
    assert len(calls) == 1 and not cpu_native.skinny_amx()


def test_bfloat16_without_avx512_bf16_kernels_is_named(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """bfloat16 without the AVX512_BF16 kernels gains little over float32 (its GEMMs run in
    float32; docs/benchmarks.md, AVX2 EPYC); the runner says so, and only then."""
    for dtype in ("bfloat16", "float32"):
        caplog.clear()
        ModelRunner(ModelConfig(str(model_dir), dtype=dtype), CacheConfig(num_kv_blocks=8),
                    LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1), progress=False)
        warned = any("without AVX512_BF16" in r.getMessage() for r in caplog.records)
        assert warned == (dtype == "bfloat16"
                          and "avx512_bf16" not in cpu_native.bf16_impls()), dtype
