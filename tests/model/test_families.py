"""Every supported family against the oracle (HF transformers + PEFT, float32, CPU): a tiny
random model of the family's own config class with its special features switched on
(``loraplex.testing.FAMILY_FEATURES``: windows shorter than the prompts, soft-capping, q/k
norms, fused projections, partial and scaled rotations, NoPE layers, multipliers) and PEFT
adapters of mixed ranks on every module the family has."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.config import CacheConfig, LoRAConfig, ModelConfig
from loraplex.model.adapter_loader import TargetShapes, load_adapter
from loraplex.model.families import FUSED_MODULES, SPLIT_MODULES, fused_checkpoint
from loraplex.model.runner import BatchInputs, ModelRunner, SeqInput
from loraplex.model.sampler import SamplingRow
from loraplex.testing import (
    build_adapter,
    build_tiny_model,
    load_reference,
    reference_greedy,
    runner_logits,
)
from loraplex_kernels import cpu_decode, cpu_native

FAMILIES = ["mistral-window", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3", "olmo2",
            "granite"]
GREEDY = SamplingRow()
NUM_NEW = 5
BF16_BOUND = 0.05  # of the logits' range, as tests/model/test_runner_bf16.py


def _adapter_specs(model_type: str) -> dict[str, dict[str, Any]]:
    modules = list(FUSED_MODULES if fused_checkpoint(model_type) else SPLIT_MODULES)
    return {"r4": {"rank": 4, "alpha": 8.0, "seed": 21, "target_modules": modules},
            "r16": {"rank": 16, "alpha": 8.0, "seed": 22, "use_rslora": True,
                    "target_modules": modules},
            "r8": {"rank": 8, "alpha": 16.0, "seed": 23, "target_modules": modules[:2]}}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    model_dir = build_tiny_model(root / "model", arch, num_layers=3, seed=7)
    adapters = {name: build_adapter(root / name, model_dir, **spec)
                for name, spec in _adapter_specs(arch.split("-")[0]).items()}
    return model_dir, adapters


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_mixed_batch_matches_the_oracle(family: tuple[Path, dict[str, Path]]) -> None:
    """Base and every adapter in one batch, prompts up to several windows long, greedy
    decode step by step; first-step logits within 1e-4."""
    model_dir, adapters = family
    runner = ModelRunner(ModelConfig(str(model_dir)), CacheConfig(num_kv_blocks=64),
                         LoRAConfig(max_loras=4, max_lora_rank=16, max_cpu_loras=4),
                         progress=False)
    target = TargetShapes.from_model_dir(model_dir)
    names: list[str | None] = [None, *adapters, None]
    slot_of = {name: slot for slot, name in zip((2, 0, 3), adapters, strict=True)}
    for name, slot in slot_of.items():
        runner.set_lora_slot(slot, load_adapter(adapters[name], target, 16, name=name))
    lengths = [1, 37, 16, 29, 45]
    prompts = _prompts(runner.args.vocab_size, lengths, 3)
    blocks = list(range(runner.num_blocks))
    random.Random(5).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(-(-(n + NUM_NEW) // 16))] for n in lengths]
    slots = [-1 if n is None else slot_of[n] for n in names]
    seqs = [SeqInput(p, 0, t, s, [GREEDY]) for p, t, s in zip(prompts, tables, slots,
                                                                  strict=True)]
    first = runner_logits(runner, BatchInputs(seqs))
    generated = [[t] for t in first.argmax(-1).tolist()]
    for _ in range(NUM_NEW - 1):
        seqs = [SeqInput([g[-1]], len(p) + len(g) - 1, t, s, [GREEDY])
                for p, g, t, s in zip(prompts, generated, tables, slots, strict=True)]
        for g, r in zip(generated, runner.execute(BatchInputs(seqs)), strict=True):
            g.append(r.sampled[0].token_id)
    for i, name in enumerate(names):
        ref = load_reference(model_dir, None if name is None else adapters[name])
        ref_ids, ref_logits = reference_greedy(ref, prompts[i], NUM_NEW)
        assert generated[i] == ref_ids, f"{name}: {generated[i]} != {ref_ids}"
        diff = (first[i] - ref_logits).abs().max().item()
        assert diff < 1e-4, f"{name}: first-step logits differ by {diff}"
        logprobs = (first[i].log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max().item()
        assert logprobs < 1e-4, f"{name}: first-step logprobs differ by {logprobs}"


def test_prefill_in_chunks_over_a_cached_prefix(family: tuple[Path, dict[str, Path]]) -> None:
    """A prompt several windows long prefilled in chunks of odd sizes gives the oracle's
    logits on the whole prompt."""
    model_dir, adapters = family
    runner = ModelRunner(ModelConfig(str(model_dir)), CacheConfig(num_kv_blocks=32),
                         LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1),
                         progress=False)
    runner.set_lora_slot(0, load_adapter(adapters["r16"], TargetShapes.from_model_dir(
        model_dir), 16))
    prompt = _prompts(runner.args.vocab_size, [50], 8)[0]
    for slot, table in ((-1, [7, 3, 11, 1]), (0, [20, 21, 4, 30])):
        pos = 0
        for chunk in (17, 1, 14, 18):
            sampling = [GREEDY] if pos + chunk == len(prompt) else []
            logits = runner_logits(runner, BatchInputs([SeqInput(
                prompt[pos:pos + chunk], pos, table, slot, sampling)]))
            pos += chunk
        ref = load_reference(model_dir, adapters["r16"] if slot == 0 else None)
        _, ref_logits = reference_greedy(ref, prompt, 1)
        assert (logits[0] - ref_logits).abs().max().item() < 1e-4


# engine paths: chunked prefill with prefix hits, both preemptions, n = 3
ENGINE_RUNS: dict[str, dict[str, Any]] = {
    "chunked-prefix": {"max_num_batched_tokens": 7, "block_size": 4, "num_kv_blocks": 300},
    "recompute": {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 16},
    "swap": {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 16,
             "preemption_mode": "swap", "swap_space_blocks": 40},
    "n3": {"block_size": 4, "num_kv_blocks": 300, "n": 3},
}


@pytest.mark.parametrize("run", list(ENGINE_RUNS))
def test_engine_paths_match_the_oracle(family: tuple[Path, dict[str, Path]], run: str) -> None:
    model_dir, adapters = family
    rng = random.Random(11)
    system = [rng.randrange(3, 300) for _ in range(23)]  # shared: prefix-cache hits
    names: list[str | None] = [None, *sorted(adapters)]
    prompts, loras, max_tokens = [], [], []
    for i in range(14):
        own = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 20))]
        prompts.append(system + own if i % 2 == 0 else own)
        loras.append(names[i % len(names)])
        max_tokens.append(rng.randrange(4, 14))
    kwargs = dict(ENGINE_RUNS[run])
    n = kwargs.pop("n", 1)
    llm = LLM(str(model_dir), progress=False, max_lora_rank=16, **kwargs)
    outs = llm.generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, n=n)
                  for m in max_tokens],
        [None if a is None else LoRARequest(a, str(adapters[a])) for a in loras],
        arrival_steps=[rng.randrange(0, 12) for _ in prompts])
    refs = {name: load_reference(model_dir, None if name is None else adapters[name])
            for name in names}
    for i, out in enumerate(outs):
        expected = reference_greedy(refs[loras[i]], prompts[i], max_tokens[i])[0]
        assert len(out.outputs) == n
        for seq in out.outputs:
            assert seq.token_ids == expected, f"request {i} ({loras[i]})"
    stats = llm.stats()
    if run == "chunked-prefix":
        assert stats.prefix_cache_hit_tokens > 0
    if run in ("recompute", "swap"):
        assert stats.num_preemptions > 0
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.all_free_or_cached()
    llm.close()


def test_bfloat16_stays_within_the_bound(family: tuple[Path, dict[str, Path]]) -> None:
    """bfloat16 first-step logits of a mixed batch within the bound the Llama family is
    held to (tests/model/test_runner_bf16.py) of the float32 oracle."""
    model_dir, adapters = family
    runner = ModelRunner(ModelConfig(str(model_dir), dtype="bfloat16"),
                         CacheConfig(num_kv_blocks=32),
                         LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1),
                         progress=False)
    runner.set_lora_slot(0, load_adapter(adapters["r4"], TargetShapes.from_model_dir(
        model_dir), 16))
    prompts = _prompts(runner.args.vocab_size, [33, 20], 4)
    logits = runner_logits(runner, BatchInputs([
        SeqInput(prompts[0], 0, [0, 1, 2], 0, [GREEDY]),
        SeqInput(prompts[1], 0, [3, 4], -1, [GREEDY])]))
    for i, adapter in enumerate((adapters["r4"], None)):
        _, ref = reference_greedy(load_reference(model_dir, adapter), prompts[i], 1)
        scale = ref.abs().max().item()
        err = (logits[i].float() - ref).abs().max().item() / scale
        assert err < BF16_BOUND, f"bf16 logits differ by {err:.3f} of their range"


def _prefill_and_decode(model_dir: Path, adapters: dict[str, Path], dtype: str,
                        ) -> tuple[ModelRunner, torch.Tensor]:
    """A prompt with an adapter and one without, prefilled in one step, then a decode step
    of both: the runner and the two steps' logits [4, vocab]."""
    runner = ModelRunner(ModelConfig(str(model_dir), dtype=dtype), CacheConfig(num_kv_blocks=8),
                         LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1),
                         progress=False)
    runner.set_lora_slot(0, load_adapter(adapters["r16"], TargetShapes.from_model_dir(
        model_dir), 16))
    prompts = _prompts(runner.args.vocab_size, [9, 14], 6)
    first = runner_logits(runner, BatchInputs([SeqInput(prompts[0], 0, [0], 0, [GREEDY]),
                                               SeqInput(prompts[1], 0, [1], -1, [GREEDY])]))
    tokens = first.argmax(-1).tolist()
    second = runner_logits(runner, BatchInputs([
        SeqInput([tokens[0]], 9, [0], 0, [GREEDY]), SeqInput([tokens[1]], 14, [1], -1, [GREEDY])]))
    return runner, torch.cat([first, second]).float()


@pytest.mark.skipif(not cpu_decode.available(), reason="no native decode layers here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_family_decodes_in_one_native_call(family: tuple[Path, dict[str, Path]],
                                                 dtype: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every family's steps take the native decode layers (q/k norms, norm layouts, GELU,
    residual multipliers and a rotation per layer are fields of their rows), so the oracle
    tests above hold on that path; its logits, with and without an adapter, are bit for
    bit those of the same kernels called layer by layer."""
    if not cpu_native.can_skinny(getattr(torch, dtype)):
        pytest.skip(f"the skinny GEMM does not run {dtype} on this CPU")
    model_dir, adapters = family
    calls = []
    run = cpu_decode.run
    monkeypatch.setattr(cpu_decode, "run", lambda *a: calls.append(1) or run(*a))
    runner, native = _prefill_and_decode(model_dir, adapters, dtype)
    assert runner.model.native_decode_gap == ""
    assert runner.model.native_decode is not None, runner.model.describe()
    assert "one native call per step" in runner.model.describe()
    assert len(calls) == 2
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    runner, layered = _prefill_and_decode(model_dir, adapters, dtype)
    assert runner.model.native_decode is None and len(calls) == 2
    assert "layer by layer" in runner.model.describe()
    assert torch.equal(native, layered)


def test_an_adapter_for_modules_the_family_lacks_is_refused_by_name(
        tmp_path: Path, llama_adapters: dict[str, Path]) -> None:
    """Phi-3 has fused qkv_proj and gate_up_proj: an adapter of split q_proj ... up_proj
    names no module it has, and the refusal names the modules it does have."""
    from loraplex.errors import AdapterError
    from loraplex.model.adapter_loader import validate_adapter_dir

    phi3 = build_tiny_model(tmp_path / "phi3", "phi3", num_layers=2)
    with pytest.raises(AdapterError) as info:
        validate_adapter_dir(llama_adapters["r4"], TargetShapes.from_model_dir(phi3), 16)
    message = str(info.value)
    assert "map to no supported module of the base model" in message
    assert "modules down_proj, gate_up_proj, o_proj, qkv_proj" in message
    assert "self_attn.q_proj.lora_A" in message


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_windowed_model_holds_blocks_bounded_by_its_window(
        tmp_path: Path, preemption_mode: str) -> None:
    """Mistral with a window of 11: prompts five windows long and long outputs stay exact,
    and no request ever holds more than the window's blocks plus its chunk's (asserted
    from the engine's stats at every step), with prefix hits, n = 2 and preemptions."""
    from loraplex.engine.engine import LLMEngine

    model_dir = build_tiny_model(tmp_path / "m", "mistral-window", num_layers=2, seed=3)
    block, chunk = 4, 8
    llm = LLM(str(model_dir), progress=False, block_size=block, num_kv_blocks=30,
              max_num_batched_tokens=chunk, preemption_mode=preemption_mode,
              swap_space_blocks=30)
    engine: LLMEngine = llm.engine
    assert engine.kv.sliding_window == 11
    rng = random.Random(2)
    shared = [rng.randrange(3, 300) for _ in range(31)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(n)] for n in (25, 1, 17)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=n)
              for n in (1, 2, 1)]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    outputs: dict[tuple[str, int], list[int]] = {}
    per_request = -(-(11 - 1 + chunk) // block) + 1  # window's keys + a chunk, unaligned
    most = 0
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault((delta.request_id, delta.index), []).extend(
                delta.new_token_ids)
        running = engine.scheduler.running
        for r in running:
            most = max(most, engine.kv.num_blocks_held(r.request_id))
            assert engine.kv.num_blocks_held(r.request_id) <= per_request
        assert engine.stats().kv_blocks_used <= per_request * max(1, len(running))
    assert most >= per_request - 1  # the bound is met, not vacuous
    ref = load_reference(model_dir)
    for i, prompt in enumerate(prompts):
        expected = reference_greedy(ref, prompt, 30)[0]
        got = [ids for (rid, _), ids in outputs.items() if rid == str(i)]
        assert len(got) == params[i].n and all(ids == expected for ids in got), f"request {i}"
    engine.kv.check_invariants()
    assert engine.kv.all_free_or_cached()
    assert engine.stats().prefix_cache_hit_tokens > 0
    llm.close()


@pytest.mark.parametrize("method", ["layer_skip", "draft_model"])
def test_speculative_decoding_matches_the_oracle(family: tuple[Path, dict[str, Path]],
                                                 method: str, tmp_path: Path) -> None:
    """The layer-skip proposer (the first layer) and a draft model cut from the target
    (``loraplex draft``) propose; greedy outputs stay the oracle's."""
    from loraplex.model.truncate import save_first_layers

    model_dir, adapters = family
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": 3,
                              "disable_by_batch_size": None}
    if method == "layer_skip":
        config["num_draft_layers"] = 1
    else:
        config["model"] = str(save_first_layers(model_dir, tmp_path / "draft", 1))
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (30, 12, 41)]
    loras = [None, "r4", "r16"]
    llm = LLM(str(model_dir), progress=False, max_lora_rank=16, block_size=4,
              num_kv_blocks=200, speculative_config=config)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=12,
                                                 ignore_eos=True) for _ in prompts],
                        [None if a is None else LoRARequest(a, str(adapters[a]))
                         for a in loras])
    for i, out in enumerate(outs):
        ref = load_reference(model_dir, None if loras[i] is None else adapters[loras[i]])
        assert out.outputs[0].token_ids == reference_greedy(ref, prompts[i], 12)[0]
    stats = llm.stats()
    assert stats.spec_num_draft_tokens > 0
    llm.close()


@pytest.mark.parametrize("base_name,refused", [
    ("google/gemma-2-2b-it", "names a Gemma 2 model; the served model is Llama"),
    ("Qwen/Qwen3-8B", "names a Qwen3 model; the served model is Llama"),
    ("meta-llama/Llama-3.2-1B", None), ("HuggingFaceTB/SmolLM2-135M-Instruct", None),
    ("/data/checkpoints/run-17", None), ("mistral-llama-merge", None)])
def test_an_adapter_trained_on_another_family_is_refused(
        tmp_path: Path, llama_adapters: dict[str, Path], tiny_llama_dir: Path,
        base_name: str, refused: str | None) -> None:
    """Same shapes, but ``base_model_name_or_path`` clearly names another family: its deltas
    were learnt on other weights. Names that name no family (or two) are not judged."""
    import json
    import shutil

    from loraplex.errors import AdapterError
    from loraplex.model.adapter_loader import validate_adapter_dir

    adapter = tmp_path / "a"
    shutil.copytree(llama_adapters["r4"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base_name
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    target = TargetShapes.from_model_dir(tiny_llama_dir)
    if refused is None:
        validate_adapter_dir(adapter, target, 16)
        return
    with pytest.raises(AdapterError, match=refused):
        validate_adapter_dir(adapter, target, 16)


def test_structured_outputs_hold_on_every_family(family: tuple[Path, dict[str, Path]]) -> None:
    """Regex, choice and JSON-schema constraints, with and without an adapter, sampled:
    every finished output is in its language (the grammar masks the family's logits, soft-
    capped or scaled as they are)."""
    import json
    import re

    from loraplex.engine.sampling_params import GrammarSpec

    model_dir, adapters = family
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    grammars = [GrammarSpec("regex", r"[a-f]{3}-[0-9]{2}", "guided_regex"),
                GrammarSpec.choice(["red", "green", "blue"]), GrammarSpec.json_schema(schema)]
    llm = LLM(str(model_dir), progress=False, max_lora_rank=16, block_size=4,
              num_kv_blocks=200)
    prompts = [[5 + i, 9, 40 + 3 * i, 7] for i in range(6)]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=40, grammar=grammars[i % 3])
              for i in range(6)]
    outs = llm.generate(prompts, params, [None if i % 2 else LoRARequest(
        "r4", str(adapters["r4"])) for i in range(6)])
    finished = 0
    for i, out in enumerate(outs):
        seq = out.outputs[0]
        if seq.finish_reason != "stop":
            continue
        finished += 1
        if i % 3 == 0:
            assert re.fullmatch(r"[a-f]{3}-[0-9]{2}", seq.text), seq.text
        elif i % 3 == 1:
            assert seq.text in ("red", "green", "blue"), seq.text
        else:
            assert 0 <= json.loads(seq.text)["n"] <= 99, seq.text
    assert finished >= 4
    llm.close()
