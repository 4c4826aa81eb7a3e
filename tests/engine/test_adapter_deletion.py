"""An adapter deleted while requests that use it are swapped out, through the whole engine
(tiny Llama, real adapter files; greedy outputs against HF transformers (+ PEFT), float32):
they finish on its weights, which the engine keeps for them; only when those weights are
nowhere to be had (no copy in memory, files gone before the delete) do they fail."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.engine import LLMEngine
from loraplex.engine.outputs import SequenceDelta
from loraplex.engine.request import AdapterRef, RequestStatus
from loraplex.errors import AdapterError
from loraplex.testing import load_reference, reference_greedy


def test_an_adapter_failure_ends_every_sequence_of_its_request(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    """n = 3 on an adapter whose files and host copy are gone (the host cache holds one
    adapter and another took its place) and which is then deleted while all three
    sequences are swapped out: nothing can keep its weights, so the first swap-in fails
    with one error delta for the request, and the other two sequences end in that same
    step rather than each reloading the deleted files at its own swap-in (or running on
    for nobody). The base requests beside them finish with the oracle's tokens and every
    KV block ends free or cached."""
    name, other = sorted(llama_adapters)[:2]
    folder = tmp_path / name
    shutil.copytree(llama_adapters[name], folder)
    # 18 blocks of 4 tokens: the two base requests need 16, so the newest (x's) give way.
    llm = LLM(str(tiny_llama_dir), progress=False, max_lora_rank=16, block_size=4,
              num_kv_blocks=18, max_num_batched_tokens=16, preemption_mode="swap",
              swap_space_blocks=40, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    ref = LoRARequest(name, str(folder)).to_ref()
    # Loaded now, not in the background as the scheduler asks: the steps (which sequences
    # are swapped out when) then do not depend on how fast the files load on a busy machine.
    engine.adapters.load_now(ref)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = {f"base{i}": list(range(3 + 10 * i, 11 + 10 * i)) for i in range(2)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy)
    engine.add_request("x", list(range(40, 48)),
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=3),
                       ref)
    deltas: list[SequenceDelta] = []
    deleted = False
    for _ in range(400):
        step = engine.step()
        deltas.extend(step)
        group = engine._groups.get("x", [])
        if any(d.request_id == "x" and d.error is not None for d in step):
            assert not group, "x's other sequences outlived its error"
        if not deleted and len(group) == 3 \
                and all(r.status == RequestStatus.SWAPPED for r in group):
            shutil.rmtree(folder)
            engine.adapters.load_now(LoRARequest(other, str(llama_adapters[other])).to_ref())
            engine.forget_adapter(ref.adapter_id, ref.digest)
            deleted = True
        if not engine.has_unfinished():
            break
    assert deleted, "x's three sequences were never all swapped out"
    errors = [d for d in deltas if d.request_id == "x" and d.error is not None]
    assert len(errors) == 1 and errors[0].finish_reason == "error"
    assert errors[0].error is not None and "was deleted" in errors[0].error
    assert not engine.has_unfinished()
    engine.kv.check_invariants()
    assert engine.kv.all_free_or_cached()
    oracle = load_reference(tiny_llama_dir)
    for rid, prompt in prompts.items():
        tokens = [t for d in deltas if d.request_id == rid for t in d.new_token_ids]
        assert tokens == reference_greedy(oracle, prompt, 24)[0], rid


def _run(engine: LLMEngine, on_step: object = None, max_steps: int = 600,
         ) -> list[SequenceDelta]:
    deltas: list[SequenceDelta] = []
    for _ in range(max_steps):
        deltas.extend(engine.step())
        if callable(on_step):
            on_step()
        if not engine.has_unfinished():
            return deltas
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_requests_in_flight_on_a_deleted_adapter_finish_on_its_weights(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path], tmp_path: Path,
        mode: str) -> None:
    """The gateway's order: the engine forgets the adapter, then its files go. Its
    requests in flight at that moment, n = 3 with all three sequences out of the batch
    (swapped out, or preempted for recompute) and its slot unpinned, come back on its kept
    weights and finish with the PEFT oracle's tokens; a request for it added afterwards is
    refused; once the last one ends the kept weights and the slot are let go. Its host
    copy is evicted first, so the weights kept are read from its files at the delete."""
    name, other = sorted(llama_adapters)[:2]
    folder = tmp_path / name
    shutil.copytree(llama_adapters[name], folder)
    llm = LLM(str(tiny_llama_dir), progress=False, max_lora_rank=16, block_size=4,
              num_kv_blocks=18, max_num_batched_tokens=16, preemption_mode=mode,
              swap_space_blocks=40 if mode == "swap" else 0, max_loras=1,
              max_cpu_loras=1)
    engine = llm.engine
    ref: AdapterRef = LoRARequest(name, str(folder)).to_ref()
    engine.adapters.load_now(ref)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = {f"base{i}": list(range(3 + 10 * i, 11 + 10 * i)) for i in range(2)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy)
    x_prompt = list(range(40, 48))
    engine.add_request("x", x_prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                     ignore_eos=True, n=3), ref)
    out_of_batch = RequestStatus.SWAPPED if mode == "swap" else RequestStatus.PREEMPTED
    deleted = []

    def delete_when_all_out() -> None:
        group = engine._groups.get("x", [])
        if not deleted and len(group) == 3 and all(r.num_output_tokens > 0 for r in group) \
                and all(r.status == out_of_batch for r in group):
            # Its host copy evicted (the cache holds one): the engine reads the files,
            # still there, to keep its weights.
            engine.adapters.load_now(LoRARequest(other, str(llama_adapters[other])).to_ref())
            engine.forget_adapter(ref.adapter_id, ref.digest)
            shutil.rmtree(folder)
            deleted.append(engine.num_steps)
            with pytest.raises(AdapterError, match="was deleted"):
                engine.add_request("late", x_prompt, greedy, ref)

    deltas = _run(engine, delete_when_all_out)
    assert deleted, f"x's three sequences were never all {out_of_batch.name}"
    assert not [d for d in deltas if d.error is not None]
    engine.kv.check_invariants()
    assert engine.kv.all_free_or_cached()
    assert engine.adapters.num_retained == 0
    assert ref.key not in engine.adapters.stats().slots  # let go once x ended
    oracle = load_reference(tiny_llama_dir)
    for rid, prompt in prompts.items():
        tokens = [t for d in deltas if d.request_id == rid for t in d.new_token_ids]
        assert tokens == reference_greedy(oracle, prompt, 24)[0], rid
    want = reference_greedy(load_reference(tiny_llama_dir, llama_adapters[name]), x_prompt,
                            24)[0]
    for index in range(3):
        tokens = [t for d in deltas if d.request_id == "x" and d.index == index
                  for t in d.new_token_ids]
        assert tokens == want, index
