"""An adapter deleted while requests that use it are swapped out, through the whole engine
(tiny Llama, real adapter files; greedy outputs against HF transformers, float32)."""

from __future__ import annotations

import shutil
from pathlib import Path

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.outputs import SequenceDelta
from loraplex.engine.request import RequestStatus
from loraplex.testing import load_reference, reference_greedy


def test_an_adapter_failure_ends_every_sequence_of_its_request(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    """n = 3 on an adapter deleted (files and host copy) while all three sequences are
    swapped out: the first swap-in fails with one error delta for the request, and the
    other two sequences end in that same step rather than each reloading the deleted files
    at its own swap-in (or running on for nobody). The base requests beside them finish
    with the oracle's tokens and every KV block ends free or cached."""
    name = sorted(llama_adapters)[0]
    folder = tmp_path / name
    shutil.copytree(llama_adapters[name], folder)
    # 18 blocks of 4 tokens: the two base requests need 16, so the newest (x's) give way.
    llm = LLM(str(tiny_llama_dir), progress=False, max_lora_rank=16, block_size=4,
              num_kv_blocks=18, max_num_batched_tokens=16, preemption_mode="swap",
              swap_space_blocks=40)
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
            engine.forget_adapter(ref.adapter_id, ref.digest)
            deleted = True
        if not engine.has_unfinished():
            break
    assert deleted, "x's three sequences were never all swapped out"
    errors = [d for d in deltas if d.request_id == "x" and d.error is not None]
    assert len(errors) == 1 and errors[0].finish_reason == "error"
    assert not engine.has_unfinished()
    engine.kv.check_invariants()
    assert engine.kv.all_free_or_cached()
    oracle = load_reference(tiny_llama_dir)
    for rid, prompt in prompts.items():
        tokens = [t for d in deltas if d.request_id == rid for t in d.new_token_ids]
        assert tokens == reference_greedy(oracle, prompt, 24)[0], rid
