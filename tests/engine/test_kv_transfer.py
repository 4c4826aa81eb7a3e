"""Prefill/decode transfers between two engines in one process (``kv_transfer.py``): a
prefill engine computes the prompt, its blocks go to a decode engine in the portable form,
and the decode engine's greedy outputs are HF + PEFT's (float32) or its own single-engine
run's (bf16, and seeded sampling with n > 1), having computed only the prompt's tail.
Blocks of another tenant, another adapter version, another model, or damaged on the way
are refused, counted, and recomputed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.kv_blocks import decode_block, encode_block, model_fingerprint
from loraplex.engine.kv_transfer import needs_prefill, prefill_params
from loraplex.engine.request import AdapterRef
from loraplex.model.truncate import save_first_layers
from loraplex.testing import load_reference, reference_greedy

BLOCK = 4
SYSTEM = [(5 * i) % 270 + 9 for i in range(16)]  # 4 full blocks before every tail
DOMAINS: list[tuple[str | None, str | None]] = [
    (None, None), ("r4", "tenant-a"), ("r8qv", "tenant-b"), ("r4", None), (None, "tenant-a")]
MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompt(i: int) -> list[int]:
    return SYSTEM + [13 + i, 29 + i, 41 + i]  # 19 tokens: 4 blocks move, 3 tokens computed


def _llm(model: Path, **kwargs: Any) -> LLM:
    return LLM(str(model), progress=False, max_lora_rank=16, block_size=BLOCK,
               num_kv_blocks=kwargs.pop("num_kv_blocks", 64), **kwargs)


def _ref(adapters: dict[str, Path], name: str | None, path: Path | None = None,
         ) -> AdapterRef | None:
    return None if name is None else LoRARequest(name, str(path or adapters[name])).to_ref()


def _lora(ref: AdapterRef | None) -> LoRARequest | None:
    return None if ref is None else LoRARequest(ref.adapter_id, ref.path)


def _prefill(llm: LLM, prompt: list[int], ref: AdapterRef | None,
             salt: str | None) -> list[bytes]:
    llm.generate([prompt], prefill_params(), _lora(ref), cache_salt=salt)
    return llm.engine.export_prompt_blocks(prompt, ref, salt)


def _decode(llm: LLM, raws: list[bytes], prompt: list[int], ref: AdapterRef | None,
            salt: str | None, params: SamplingParams = GREEDY) -> list[list[int]]:
    llm.engine.import_prompt_blocks(raws, prompt, ref, salt)
    out = llm.generate([prompt], params, _lora(ref), cache_salt=salt)
    return [list(c.token_ids) for c in out[0].outputs]


def _check_idle(*llms: LLM) -> None:
    for llm in llms:
        llm.engine.kv.check_invariants()
        assert llm.engine.kv.all_free_or_cached()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, llama_adapters: dict[str, Path],
             ) -> dict[tuple[Any, int], list[int]]:
    out = {}
    for name in {a for a, _ in DOMAINS}:
        ref = load_reference(tiny_llama_dir, None if name is None else llama_adapters[name])
        for i in range(2):
            out[(name, i)] = reference_greedy(ref, _prompt(i), MAX_TOKENS)[0]
    return out


def test_decode_after_a_transfer_matches_peft_and_computes_only_the_tail(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]]) -> None:
    prefill, decode = _llm(tiny_llama_dir), _llm(tiny_llama_dir)
    for i in range(2):
        for adapter, salt in DOMAINS:
            ref = _ref(llama_adapters, adapter)
            raws = _prefill(prefill, _prompt(i), ref, salt)
            assert len(raws) == 4
            before = decode.engine.stats()
            assert _decode(decode, raws, _prompt(i), ref, salt) == [expected[(adapter, i)]]
            after = decode.engine.stats()
            # every full block came over: the decode engine computed 3 prompt tokens
            assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 16
            # the second prompt of a domain finds the prefix it imported for the first
            assert after.kv_transfer_imported - before.kv_transfer_imported == (4 if i == 0
                                                                                else 0)
    stats = decode.engine.stats()
    assert stats.kv_transfer_refused == 0
    assert stats.kv_transfer_imported == 4 * len(DOMAINS)
    assert prefill.engine.stats().kv_transfer_exported == 8 * len(DOMAINS)
    _check_idle(prefill, decode)


def test_blocks_of_another_tenant_version_or_model_are_refused(
        tiny_llama_dir: Path, tiny_qwen2_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]]) -> None:
    prefill, decode = _llm(tiny_llama_dir), _llm(tiny_llama_dir)
    r4 = _ref(llama_adapters, "r4")
    raws = _prefill(prefill, _prompt(0), r4, "tenant-a")

    def refused_for(blocks: list[bytes], ref: AdapterRef | None, salt: str | None,
                    want: list[int]) -> int:
        before = decode.engine.stats()
        assert _decode(decode, blocks, _prompt(0), ref, salt) == [want]
        after = decode.engine.stats()
        assert after.kv_transfer_imported == before.kv_transfer_imported
        assert after.prefix_cache_hit_tokens == before.prefix_cache_hit_tokens
        decode.engine.kv.drop_cached(lambda keys: True)  # the next case starts cold
        return after.kv_transfer_refused - before.kv_transfer_refused

    # tenant-a's blocks, sent with tenant-b's request or with no salt: none is taken
    assert refused_for(raws, r4, "tenant-b", expected[("r4", 0)]) == 4
    assert refused_for(raws, r4, None, expected[("r4", 0)]) == 4
    # one adapter name, new weights (a new digest): the old version's blocks are not its
    new_r4 = _ref(llama_adapters, "r4", llama_adapters["r8qv"])
    assert refused_for(raws, new_r4, "tenant-a", expected[("r8qv", 0)]) == 4
    # another prompt's blocks (the tokens differ), and blocks out of chain order
    assert refused_for(_prefill(prefill, [SYSTEM[0] + 1, *_prompt(0)[1:]], r4, "tenant-a"),
                       r4, "tenant-a", expected[("r4", 0)]) == 4
    assert refused_for(raws[1:], r4, "tenant-a", expected[("r4", 0)]) == 3
    # another model's fingerprint, with a valid checksum
    transfer = decode.engine.offload.transfer
    layout, fingerprint = transfer.layout, transfer.fingerprint
    foreign = model_fingerprint(tiny_qwen2_dir, layout)
    forged = [encode_block(dataclasses.replace(decode_block(r, fingerprint, layout),
                                               fingerprint=foreign)) for r in raws]
    assert refused_for(forged, r4, "tenant-a", expected[("r4", 0)]) == 4
    _check_idle(prefill, decode)


def test_damaged_blocks_stop_the_chain_and_the_rest_is_recomputed(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]]) -> None:
    prefill, decode = _llm(tiny_llama_dir), _llm(tiny_llama_dir)
    raws = _prefill(prefill, _prompt(0), None, "t")
    damaged = [raws[0], raws[1][: len(raws[1]) // 2], raws[2], raws[3]]
    assert _decode(decode, damaged, _prompt(0), None, "t") == [expected[(None, 0)]]
    stats = decode.engine.stats()
    assert (stats.kv_transfer_imported, stats.kv_transfer_refused) == (1, 3)
    assert stats.prefix_cache_hit_tokens == 4
    raws = _prefill(prefill, _prompt(1), None, "u")
    flipped = raws[2][:-100] + bytes([raws[2][-100] ^ 0x40]) + raws[2][-99:]
    assert _decode(decode, [*raws[:2], flipped, raws[3]], _prompt(1), None, "u") \
        == [expected[(None, 1)]]
    stats = decode.engine.stats()
    assert (stats.kv_transfer_imported, stats.kv_transfer_refused) == (3, 5)
    assert stats.prefix_cache_hit_tokens == 4 + 8
    _check_idle(prefill, decode)


def test_a_deleted_adapter_version_takes_no_blocks(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> None:
    prefill, decode = _llm(tiny_llama_dir), _llm(tiny_llama_dir)
    r4 = _ref(llama_adapters, "r4")
    assert r4 is not None
    decode.add_lora(LoRARequest("r4", r4.path))
    decode.engine.forget_adapter("r4", r4.digest)
    assert decode.engine.import_prompt_blocks(_prefill(prefill, _prompt(0), r4, None),
                                              _prompt(0), r4, None) == 0
    assert decode.engine.stats().kv_transfer_imported == 0
    assert decode.engine.kv.cached_run(_prompt(0), (("adapter", "r4", r4.digest),)) == []
    _check_idle(prefill, decode)


def test_seeded_sampling_and_n_continue_as_on_one_engine(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=3, max_tokens=6,
                            ignore_eos=True)
    single = _llm(tiny_llama_dir)
    r8 = _ref(llama_adapters, "r8qv")
    want = single.generate([_prompt(0)], params, _lora(r8), cache_salt="s")
    prefill, decode = _llm(tiny_llama_dir), _llm(tiny_llama_dir)
    got = _decode(decode, _prefill(prefill, _prompt(0), r8, "s"), _prompt(0), r8, "s", params)
    assert got == [list(c.token_ids) for c in want[0].outputs]
    assert decode.engine.stats().kv_transfer_imported == 4
    _check_idle(single, prefill, decode)


def test_a_speculating_decode_engine_takes_transferred_blocks(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]], tmp_path: Path) -> None:
    """The draft model keeps its own KV: it computes it again over the transferred prefix
    (as over any prefix hit), so it proposes exactly what it proposes on one engine that
    computed the whole prompt (the same tokens accepted), never from slots it never
    filled."""
    draft = save_first_layers(tiny_llama_dir, tmp_path / "draft", 2)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}
    single = _llm(tiny_llama_dir, speculative_config=spec)
    prefill = _llm(tiny_llama_dir)
    decode = _llm(tiny_llama_dir, speculative_config=spec)
    for adapter, salt in DOMAINS:
        ref = _ref(llama_adapters, adapter)
        assert single.generate([_prompt(0)], GREEDY, _lora(ref), cache_salt=salt)[0] \
            .outputs[0].token_ids == expected[(adapter, 0)]
        single.engine.kv.drop_cached(lambda keys: True)  # no prefix hit on this one
        raws = _prefill(prefill, _prompt(0), ref, salt)
        assert _decode(decode, raws, _prompt(0), ref, salt) == [expected[(adapter, 0)]]
    stats, alone = decode.engine.stats(), single.engine.stats()
    assert stats.kv_transfer_imported == 4 * len(DOMAINS)
    assert stats.prefix_cache_hit_tokens == 16 * len(DOMAINS)
    assert alone.prefix_cache_hit_tokens == 0
    assert stats.spec_num_drafts == alone.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens == alone.spec_num_accepted_tokens > 0
    _check_idle(single, prefill, decode)


def test_bf16_transfers_match_its_own_single_engine_run(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> None:
    single = _llm(tiny_llama_dir, dtype="bfloat16")
    want = {(a, s): single.generate([_prompt(0)], GREEDY, _lora(_ref(llama_adapters, a)),
                                    cache_salt=s)[0].outputs[0].token_ids
            for a, s in DOMAINS}
    prefill = _llm(tiny_llama_dir, dtype="bfloat16")
    decode = _llm(tiny_llama_dir, dtype="bfloat16")
    float32 = _llm(tiny_llama_dir)
    for adapter, salt in DOMAINS:
        ref = _ref(llama_adapters, adapter)
        raws = _prefill(prefill, _prompt(0), ref, salt)
        # float32 blocks of the same identity: another layout and fingerprint
        assert float32.engine.import_prompt_blocks(raws, _prompt(0), ref, salt) == 0
        assert _decode(decode, raws, _prompt(0), ref, salt) == [list(want[(adapter, salt)])]
    stats = decode.engine.stats()
    assert (stats.kv_transfer_imported, stats.kv_transfer_refused) == (4 * len(DOMAINS), 0)
    assert float32.engine.stats().kv_transfer_refused == 4 * len(DOMAINS)
    _check_idle(single, prefill, decode, float32)


def test_what_needs_a_prefill() -> None:
    greedy = SamplingParams(temperature=0.0)
    assert not needs_prefill(BLOCK, greedy, BLOCK)  # no full block before the last token
    assert needs_prefill(BLOCK + 1, greedy, BLOCK)
    # prompt logprobs need the whole prompt computed where the request decodes
    assert not needs_prefill(100, SamplingParams(prompt_logprobs=1), BLOCK)
