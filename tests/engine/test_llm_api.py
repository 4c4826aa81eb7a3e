"""The offline API: sampling controls, stops, logprobs, n, errors."""

from __future__ import annotations

import gc
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.errors import AdapterError, InvalidRequestError, PromptTooLongError
from loraplex.testing import load_reference


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_loras=2, max_lora_rank=16, num_kv_blocks=128,
               progress=False)


PROMPT = [11, 42, 7, 99, 100, 3, 58]


def test_seeded_sampling_ignores_the_rest_of_the_batch(
        llm: LLM, llama_adapters: dict[str, Path]) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12,
                            ignore_eos=True)
    lora = LoRARequest("r4", str(llama_adapters["r4"]))
    alone = llm.generate([PROMPT], params, lora)[0].outputs[0].token_ids
    others = [list(range(5, 5 + i)) for i in range(2, 7)]
    mixed = llm.generate(
        [*others[:3], PROMPT, *others[3:]],
        [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)] * 3 + [params]
        + [SamplingParams(temperature=0.5, seed=i, max_tokens=5) for i in range(2)],
        [None, LoRARequest("r8qv", str(llama_adapters["r8qv"])), lora, lora, None, None],
        arrival_steps=[0, 0, 2, 1, 0, 3])
    assert mixed[3].outputs[0].token_ids == alone
    again = llm.generate([PROMPT], params, lora)[0].outputs[0].token_ids
    assert again == alone


def test_stop_strings_and_token_ids(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate([PROMPT], greedy)[0].outputs[0]
    text, ids = full.text, full.token_ids
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16,
                                                ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[:text.index(stop)]
    kept = llm.generate([PROMPT], SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop],
        include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
    by_id = llm.generate([PROMPT], SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[ids[4]]))[0].outputs[0]
    assert by_id.token_ids == ids[:ids.index(ids[4]) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == ids[4]


def test_logprobs_match_the_reference(llm: LLM, tiny_llama_dir: Path,
                                      llama_adapters: dict[str, Path]) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, logprobs=4,
                                                ignore_eos=True),
                       LoRARequest("r16rs", str(llama_adapters["r16rs"])))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    ref = load_reference(tiny_llama_dir, llama_adapters["r16rs"])
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([PROMPT + out.token_ids])).logits[0]
    for i, (lp, top) in enumerate(out.logprobs):
        ref_lp = torch.log_softmax(logits[len(PROMPT) - 1 + i], -1)
        assert lp == pytest.approx(float(ref_lp[out.token_ids[i]]), abs=1e-4)
        assert [t for t, _ in top] == torch.topk(ref_lp, 4).indices.tolist()
        assert top[0][0] == out.token_ids[i]  # greedy picks the most likely


def test_parallel_samples(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    first = llm.generate([PROMPT], params)[0]
    assert len(first.outputs) == 4
    assert all(len(o.token_ids) == 10 for o in first.outputs)
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    second = llm.generate([PROMPT], params)[0]
    assert [o.token_ids for o in second.outputs] == [o.token_ids for o in first.outputs]
    assert llm.engine.kv.all_free_or_cached()


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    eos = llm.engine.eos_token_ids[0]
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16,
                                                stop_token_ids=[]))[0].outputs[0]
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == eos


def test_bad_requests_are_refused(llm: LLM, tmp_path: Path,
                                  llama_adapters: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(InvalidRequestError, match="out of range"):
        llm.generate([[10**6]], SamplingParams())
    with pytest.raises(PromptTooLongError, match="maximum context length is 512"):
        llm.generate([[5] * 500], SamplingParams(max_tokens=50))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    bad = tmp_path / "bad"
    shutil.copytree(llama_adapters["r4"], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="use_dora"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2), LoRARequest("bad", str(bad)))
    (bad / "adapter_model.bin").write_bytes(b"not really")
    with pytest.raises(AdapterError, match="adapter_model.bin"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2), LoRARequest("bad", str(bad)))
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.all_free_or_cached()


def test_a_request_that_could_never_fit_the_pool_is_refused_at_admission(
        tiny_llama_dir: Path) -> None:
    small = LLM(str(tiny_llama_dir), max_loras=1, max_lora_rank=8, num_kv_blocks=4,
                progress=False)  # 4 blocks x 16 tokens: 64 token slots in all
    try:
        with pytest.raises(PromptTooLongError, match="can never fit the KV cache of 4 blocks"):
            small.generate([[5] * 30], SamplingParams(max_tokens=35, ignore_eos=True))
        assert not small.engine.has_unfinished()
        # One that fits exactly still runs to the end on the same engine.
        out = small.generate([[5] * 30], SamplingParams(max_tokens=34, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 34
        assert small.engine.kv.all_free_or_cached()
    finally:
        small.close()


def test_prompts_arriving_together_start_longest_first(tiny_llama_dir: Path) -> None:
    # One sequence at a time, so the queue order shows in each request's queue time.
    one_at_a_time = LLM(str(tiny_llama_dir), max_loras=1, max_lora_rank=16, num_kv_blocks=64,
                        max_num_seqs=1, progress=False)
    try:
        lengths = [2, 9, 5, 3]
        outs = one_at_a_time.generate(
            [PROMPT] * 4, [SamplingParams(max_tokens=m, ignore_eos=True) for m in lengths])
        assert [len(o.outputs[0].token_ids) for o in outs] == lengths  # prompts' order
        queued = [o.metrics[0].queue_time for o in outs]  # type: ignore[union-attr]
        assert sorted(range(4), key=lambda i: queued[i]) == [1, 2, 3, 0]
    finally:
        one_at_a_time.close()


def test_the_engine_checks_its_kv_cache_when_it_goes_idle(
        llm: LLM, caplog: pytest.LogCaptureFixture) -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with caplog.at_level("ERROR", logger="loraplex.engine.engine"):
        llm.generate([PROMPT], params)
        assert not caplog.records  # a clean run leaves every block free or cached
        # A bug's footprint: blocks held under an id no request of the scheduler has.
        assert llm.engine.kv.allocate_slots("leaked", PROMPT, 0, len(PROMPT), ()) is not None
        try:
            llm.generate([PROMPT], params)
        finally:
            llm.engine.kv.free("leaked")
    assert [r.getMessage() for r in caplog.records] == [
        "KV cache self-check failed with the engine idle: blocks still held with no "
        "request left"]


def test_close_frees_the_engine_without_the_cycle_collector(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> None:
    """After ``close()`` nothing of ours keeps the engine alive: dropping the LLM frees its
    model, KV cache and host adapters at once, not whenever the cycle collector runs."""
    gc.collect()
    gc.disable()
    try:
        llm = LLM(str(tiny_llama_dir), max_loras=2, max_lora_rank=16, num_kv_blocks=32,
                  progress=False)
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3),
                     LoRARequest("r4", str(llama_adapters["r4"])))
        engine = weakref.ref(llm.engine)
        llm.close()
        del llm
        assert engine() is None
    finally:
        gc.enable()


def test_an_adapter_folder_is_hashed_again_only_when_its_files_change(
        llm: LLM, tmp_path: Path, llama_adapters: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An LLM keeps a folder's digest (add_lora, generate) while its files are as they
    were, so a run of many calls reads no weights file to hash it; a file written since,
    even to the same size, is hashed again and served as the new adapter it is."""
    import safetensors
    import safetensors.torch

    from loraplex import adapter_format

    hashed: list[str] = []
    real = adapter_format.file_sha256

    def counting(path: str | Path) -> bytes:
        hashed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(adapter_format, "file_sha256", counting)
    folder = tmp_path / "tenant-adapter"
    shutil.copytree(llama_adapters["r4"], folder)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(path: Path, name: str = "a") -> list[int]:
        return list(llm.generate([PROMPT], params, LoRARequest(name, str(path)))[0]
                    .outputs[0].token_ids)

    ref = llm.add_lora(LoRARequest("a", str(folder)))  # read ahead of the first generation
    assert sorted(hashed) == ["adapter_config.json", "adapter_model.safetensors"]
    hashed.clear()
    first = run(folder)
    assert hashed == []
    assert ref == llm.add_lora(LoRARequest("a", str(folder)))
    assert run(folder) == first
    assert hashed == []
    # the same file, its values doubled: same size, new content
    weights = folder / "adapter_model.safetensors"
    with safetensors.safe_open(str(weights), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    size = weights.stat().st_size
    safetensors.torch.save_file({k: v * 2 for k, v in tensors.items()}, str(weights), metadata)
    assert weights.stat().st_size == size
    doubled = run(folder)
    assert len(hashed) == 2
    fresh = tmp_path / "doubled-elsewhere"
    shutil.copytree(folder, fresh)
    assert run(fresh, "b") == doubled
    # another adapter saved over the folder
    shutil.rmtree(folder)
    shutil.copytree(llama_adapters["r8qv"], folder)
    assert run(folder) == run(llama_adapters["r8qv"], "c")
    assert len({tuple(first), tuple(doubled), tuple(run(folder))}) == 3
    shutil.rmtree(folder)
    with pytest.raises(AdapterError, match="missing adapter_model.safetensors"):
        run(folder)
