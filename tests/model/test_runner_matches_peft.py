"""The runner against the oracle: HF transformers + PEFT, same weights, float32, CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest
from loraplex.config import CacheConfig, LoRAConfig, ModelConfig
from loraplex.model.adapter_loader import TargetShapes, load_adapter
from loraplex.model.runner import BatchInputs, ModelRunner, PreparedLoRA, SeqInput
from loraplex.model.sampler import SamplingRow
from loraplex.testing import build_tiny_model, load_reference, reference_greedy, runner_logits

NUM_NEW = 6
GREEDY = SamplingRow()


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _mixed_batch_matches(model_dir: Path, adapters: dict[str, Path], seed: int) -> None:
    """Base + every adapter in one batch, random order and slot placement, greedy decode."""
    rng = random.Random(seed)
    names: list[str | None] = [None, None, *adapters]
    rng.shuffle(names)
    num_slots = len(adapters) + 1  # one spare slot so placement is not just 0..k-1
    runner = ModelRunner(ModelConfig(str(model_dir)), CacheConfig(num_kv_blocks=96),
                         LoRAConfig(max_loras=num_slots, max_lora_rank=16,
                                    max_cpu_loras=num_slots), progress=False)
    target = TargetShapes.from_model_dir(model_dir)
    slots = rng.sample(range(num_slots), len(adapters))
    slot_of = {}
    for name, slot in zip(adapters, slots, strict=True):
        runner.set_lora_slot(slot, load_adapter(adapters[name], target, 16, name=name))
        slot_of[name] = slot
    lengths = [rng.randrange(1, 40) for _ in names]
    lengths[0] = 1  # a one-token prompt
    lengths[-1] = 32  # exactly two blocks
    prompts = _prompts(runner.args.vocab_size, lengths, seed)
    free_blocks = list(range(runner.num_blocks))
    rng.shuffle(free_blocks)  # block tables point all over the pool
    tables = [[free_blocks.pop() for _ in range(-(-(n + NUM_NEW) // 16))] for n in lengths]

    seqs = [SeqInput(p, 0, t, -1 if n is None else slot_of[n], [GREEDY])
            for p, t, n in zip(prompts, tables, names, strict=True)]
    first_logits = runner_logits(runner, BatchInputs(seqs))
    generated: list[list[int]] = [[] for _ in names]
    tokens = first_logits.argmax(-1).tolist()
    for _ in range(NUM_NEW - 1):
        for g, t in zip(generated, tokens, strict=True):
            g.append(t)
        seqs = [SeqInput([g[-1]], len(p) + len(g) - 1, t, s.lora_slot, [GREEDY])
                for p, g, t, s in zip(prompts, generated, tables, seqs, strict=True)]
        tokens = [r.sampled[0].token_id for r in runner.execute(BatchInputs(seqs))]
    for g, t in zip(generated, tokens, strict=True):
        g.append(t)

    for i, name in enumerate(names):
        ref = load_reference(model_dir, None if name is None else adapters[name])
        ref_ids, ref_logits = reference_greedy(ref, prompts[i], NUM_NEW)
        assert generated[i] == ref_ids, f"{name}: {generated[i]} != {ref_ids}"
        diff = (first_logits[i] - ref_logits).abs().max().item()
        assert diff < 1e-4, f"{name}: first-step logits differ by {diff}"


def test_mixed_batch_llama(tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> None:
    _mixed_batch_matches(tiny_llama_dir, llama_adapters, seed=0)


def test_mixed_batch_qwen2(tiny_qwen2_dir: Path, qwen2_adapters: dict[str, Path]) -> None:
    _mixed_batch_matches(tiny_qwen2_dir, qwen2_adapters, seed=1)


@pytest.mark.parametrize("arch,kwargs", [
    ("mistral", {}),
    ("llama", {"tie_word_embeddings": True, "num_kv_heads": 1}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    ("qwen2", {"shard_size": "40KB"}),
])
def test_architectures_match_reference(tmp_path: Path, arch: str,
                                       kwargs: dict[str, object]) -> None:
    """Mistral, tied embeddings with MQA, llama3 RoPE (past the original context), and a
    checkpoint sharded with an index file."""
    model_dir = build_tiny_model(tmp_path / "m", arch, seed=5, **kwargs)  # type: ignore[arg-type]
    if "shard_size" in kwargs:
        assert (model_dir / "model.safetensors.index.json").is_file()
    runner = ModelRunner(ModelConfig(str(model_dir)), CacheConfig(num_kv_blocks=16),
                         LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1),
                         progress=False)
    prompt = _prompts(runner.args.vocab_size, [45], 3)[0]
    logits = runner_logits(runner, BatchInputs([SeqInput(prompt, 0, [5, 2, 9, 0], -1,
                                                         [GREEDY])]))
    _, ref_logits = reference_greedy(load_reference(model_dir), prompt, 1)
    assert (logits[0] - ref_logits).abs().max().item() < 1e-4


def test_prefill_over_cached_prefix(tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> None:
    """A prompt prefilled in chunks of unaligned sizes (query shorter than keys) gives the
    same logits as the oracle on the whole prompt, with and without an adapter."""
    runner = ModelRunner(ModelConfig(str(tiny_llama_dir)), CacheConfig(num_kv_blocks=32),
                         LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=1),
                         progress=False)
    adapter_dir = llama_adapters["r16rs"]
    runner.set_lora_slot(0, load_adapter(adapter_dir, TargetShapes.from_model_dir(
        tiny_llama_dir), 16))
    prompt = _prompts(runner.args.vocab_size, [50], 7)[0]
    for slot, table in ((-1, [7, 3, 11, 1]), (0, [20, 21, 4, 30])):
        pos = 0
        for chunk in (17, 1, 14, 18):  # crosses block boundaries at odd offsets
            sampling = [GREEDY] if pos + chunk == len(prompt) else []
            logits = runner_logits(runner, BatchInputs([SeqInput(
                prompt[pos:pos + chunk], pos, table, slot, sampling)]))
            pos += chunk
        ref = load_reference(tiny_llama_dir, adapter_dir if slot == 0 else None)
        _, ref_logits = reference_greedy(ref, prompt, 1)
        assert (logits[0] - ref_logits).abs().max().item() < 1e-4


def test_base_rows_get_exactly_zero_delta(tiny_llama_dir: Path,
                                          llama_adapters: dict[str, Path]) -> None:
    """Slot -1 tokens in a batch full of adapter tokens come out bit-identical to a
    base-only batch (a -1 index must never pick the last slot)."""
    runner = ModelRunner(ModelConfig(str(tiny_llama_dir)), CacheConfig(num_kv_blocks=32),
                         LoRAConfig(max_loras=2, max_lora_rank=16, max_cpu_loras=2),
                         progress=False)
    target = TargetShapes.from_model_dir(tiny_llama_dir)
    runner.set_lora_slot(1, load_adapter(llama_adapters["r4"], target, 16))  # the last slot
    prompt = _prompts(runner.args.vocab_size, [20], 9)[0]

    def run(slots: list[int]) -> torch.Tensor:
        return runner_logits(runner, BatchInputs([
            SeqInput(prompt, 0, [2 * i, 2 * i + 1], slot, [GREEDY])
            for i, slot in enumerate(slots)]))

    # Same batch shape, so the base matmuls are identical; only LoRA rows may differ.
    base_only = run([-1, -1, -1])
    mixed = run([1, -1, 1])
    assert torch.equal(mixed[1], base_only[1])
    assert not torch.allclose(mixed[0], base_only[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prepared_adapter_is_installed_without_copying(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path], dtype: str) -> None:
    """The adapter loader lays an adapter out for its slots once (``prepare_lora``, on its
    own thread); installing that only points slots at the tensors: two slots share them,
    compute what the adapter installed from its file's tensors computes, and emptying one
    leaves the other intact. The engine's loader hands such prepared adapters over."""
    runner = ModelRunner(ModelConfig(str(tiny_llama_dir), dtype=dtype),
                         CacheConfig(num_kv_blocks=32),
                         LoRAConfig(max_loras=3, max_lora_rank=16, max_cpu_loras=3),
                         progress=False)
    adapter = load_adapter(llama_adapters["r16rs"], TargetShapes.from_model_dir(tiny_llama_dir),
                           16)
    prepared = runner.prepare_lora(adapter)
    assert isinstance(prepared, PreparedLoRA)
    runner.set_lora_slot(0, adapter)  # laid out afresh from the adapter's tensors
    runner.set_lora_slot(1, prepared)
    runner.set_lora_slot(2, prepared)
    lora = runner.model.layers[0].self_attn.qkv_proj.lora  # type: ignore[union-attr]
    weights = prepared.weights[0, "qkv_proj"]
    assert weights is not None
    read = weights.native or (weights.at, weights.bt)  # what the kernels read
    assert int(lora.at_ptrs[1]) == int(lora.at_ptrs[2]) == read[0].data_ptr()
    assert int(lora.bt_ptrs[1]) == read[1].data_ptr() != int(lora.bt_ptrs[0])
    prompt = _prompts(runner.args.vocab_size, [20], 4)[0]

    def run(slot: int) -> torch.Tensor:  # the same batch shape every time
        return runner_logits(runner, BatchInputs([
            SeqInput(prompt, 0, [2 * i, 2 * i + 1], s, [GREEDY])
            for i, s in enumerate([slot, -1])]))

    copied, base = run(0), run(-1)
    assert not torch.equal(copied[0], base[0])
    assert torch.equal(run(1), copied) and torch.equal(run(2), copied)
    runner.set_lora_slot(1, None)
    assert int(lora.at_ptrs[1]) == 0
    assert torch.equal(run(1), base) and torch.equal(run(2), copied)

    llm = LLM(str(tiny_llama_dir), dtype=dtype, progress=False, max_lora_rank=16)
    ref = LoRARequest("r16rs", str(llama_adapters["r16rs"])).to_ref()
    assert isinstance(llm.engine.adapters.load_now(ref), PreparedLoRA)
    llm.close()
