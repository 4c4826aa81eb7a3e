"""The prefix cache's disk tier, end to end on the tiny Llama: a pool far too small for the
workload evicts every shared prefix, later requests load it back from disk, and greedy
outputs stay those of HF + PEFT; tenants and adapter versions never see each other's
blocks; damaged, cut and foreign files are refused and recomputed; a restart finds the
tier again."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest
from servers import wait_until

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.cli_engine import add_engine_args, engine_config_from_args
from loraplex.config import CacheConfig
from loraplex.engine.kv_blocks import (
    BlockRefused,
    KVLayout,
    decode_block,
    encode_block,
    model_fingerprint,
    read_header,
)
from loraplex.engine.kv_hashing import extra_keys_for, hash_block
from loraplex.errors import ConfigError
from loraplex.model.truncate import save_first_layers
from loraplex.testing import load_reference, reference_greedy

BLOCK = 4
SYSTEM = [(7 * i) % 290 + 5 for i in range(16)]  # 4 full blocks shared by every prompt
# (adapter, salt) domains: each keeps its own copy of the shared prefix
DOMAINS: list[tuple[str | None, str | None]] = [
    (None, None), ("r4", "tenant-a"), ("r8qv", "tenant-b"), ("r4", None), (None, "tenant-a")]
MAX_TOKENS = 4


def _prompt(i: int) -> list[int]:
    return SYSTEM + [11 + i, 23 + i, 37 + i]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path, llama_adapters: dict[str, Path]) -> dict[tuple[Any, int], list[int]]:
    out: dict[tuple[Any, int], list[int]] = {}
    refs: dict[str | None, Any] = {}
    for name in {a for a, _ in DOMAINS}:
        refs[name] = load_reference(tiny_llama_dir,
                                    None if name is None else llama_adapters[name])
        for i in range(len(DOMAINS) + 2):
            out[(name, i)] = reference_greedy(refs[name], _prompt(i), MAX_TOKENS)[0]
    return out


def _llm(model: Path, disk: Path, **kwargs: Any) -> LLM:
    # 10 blocks of 4 tokens: one request holds 6, so every domain's prefix is evicted
    # by the next two requests
    return LLM(str(model), progress=False, max_lora_rank=16, block_size=BLOCK,
               num_kv_blocks=10, kv_disk_dir=str(disk), kv_disk_gib=0.01, **kwargs)


def _run(llm: LLM, adapters: dict[str, Path], adapter: str | None, salt: str | None,
         i: int, path: Path | None = None) -> list[int]:
    lora = None if adapter is None else LoRARequest(adapter, str(path or adapters[adapter]))
    out = llm.generate([_prompt(i)], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True),
                       lora, cache_salt=salt)
    return list(out[0].outputs[0].token_ids)


def _check_idle(llm: LLM, disk: Path) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.all_free_or_cached()
    assert llm.engine.disk is not None
    llm.engine.disk.flush()
    assert not [p for p in disk.rglob("*") if p.name.endswith(".tmp")]


def _files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("*.kvb"))


def _run_all(llm: LLM, adapters: dict[str, Path], expected: dict[tuple[Any, int], list[int]],
             i: int) -> None:
    for adapter, salt in DOMAINS:
        assert _run(llm, adapters, adapter, salt, i) == expected[(adapter, i)], (adapter, salt)


def test_disk_hits_match_peft_and_survive_a_restart(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]], tmp_path: Path) -> None:
    llm = _llm(tiny_llama_dir, tmp_path)
    _run_all(llm, llama_adapters, expected, 0)
    first = llm.engine.stats()
    assert first.kv_disk_writes + first.kv_disk_blocks > 0
    _run_all(llm, llama_adapters, expected, 1)  # same prefixes, other suffixes
    stats = llm.engine.stats()
    # every domain after the first pass found its 16-token prefix on disk
    assert stats.kv_disk_hit_tokens >= 16 * len(DOMAINS)
    assert stats.kv_disk_refused == 0
    _check_idle(llm, tmp_path)
    llm.engine.close()

    again = _llm(tiny_llama_dir, tmp_path)
    assert again.engine.stats().kv_disk_blocks > 0  # the index rebuilt from the folder
    _run_all(again, llama_adapters, expected, 2)
    stats = again.engine.stats()
    assert stats.kv_disk_hit_tokens >= 16 * len(DOMAINS)
    assert stats.prefix_cache_hit_tokens == 0 or stats.kv_disk_hit_tokens > 0
    _check_idle(again, tmp_path)
    again.engine.close()


def _evict_everything(llm: LLM, adapters: dict[str, Path]) -> None:
    for j in range(3):  # 3 x 6 blocks through a pool of 10
        _run(llm, adapters, None, f"filler-{j}", 5)


def test_tenants_and_adapter_versions_never_share_disk_blocks(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]], tmp_path: Path) -> None:
    llm = _llm(tiny_llama_dir, tmp_path)
    assert _run(llm, llama_adapters, None, "tenant-a", 0) == expected[(None, 0)]
    _evict_everything(llm, llama_adapters)
    hits = llm.engine.stats().kv_disk_hit_tokens
    # same tokens, another tenant: nothing from a's blocks
    assert _run(llm, llama_adapters, None, "tenant-b", 0) == expected[(None, 0)]
    assert llm.engine.stats().kv_disk_hit_tokens == hits
    # a's own request finds them
    _evict_everything(llm, llama_adapters)
    hits = llm.engine.stats().kv_disk_hit_tokens
    assert _run(llm, llama_adapters, None, "tenant-a", 0) == expected[(None, 0)]
    assert llm.engine.stats().kv_disk_hit_tokens == hits + 16

    # one adapter name, new weights (a new digest): the old version's blocks stay unseen
    assert _run(llm, llama_adapters, "r4", "t", 1) == expected[("r4", 1)]
    _evict_everything(llm, llama_adapters)
    hits = llm.engine.stats().kv_disk_hit_tokens
    assert _run(llm, llama_adapters, "r4", "t", 1,
                path=llama_adapters["r8qv"]) == expected[("r8qv", 1)]
    assert llm.engine.stats().kv_disk_hit_tokens == hits

    # forgetting a version deletes its files
    ref = llm.add_lora(LoRARequest("r4", str(llama_adapters["r4"])))
    tag = ["adapter", "r4", ref.digest]

    def of_r4() -> list[Path]:
        return [p for p in _files(tmp_path)
                if tag in [list(k) for k in read_header(p.read_bytes()).identity.extra_keys]]

    llm.engine.disk.flush()  # type: ignore[union-attr]
    assert of_r4()
    llm.engine.forget_adapter("r4", ref.digest)
    assert not of_r4()
    _check_idle(llm, tmp_path)
    llm.engine.close()


def test_a_queued_request_has_its_disk_blocks_read_ahead(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]], tmp_path: Path) -> None:
    """A request that arrives while another runs (the pool holds one of them) has its
    blocks read and verified on the reader thread; its lookups take them from memory."""
    llm = _llm(tiny_llama_dir, tmp_path)
    assert _run(llm, llama_adapters, "r4", "tenant-a", 0) == expected[("r4", 0)]
    _evict_everything(llm, llama_adapters)
    engine, disk = llm.engine, llm.engine.disk
    assert disk is not None
    disk.flush()
    before = engine.stats()
    ref = llm.add_lora(LoRARequest("r4", str(llama_adapters["r4"])))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("runs", _prompt(6), params, cache_salt="filler-x")
    engine.add_request("waits", _prompt(1), params, adapter=ref, cache_salt="tenant-a")
    disk._reader.submit(lambda: None).result()  # the reads are done before any step
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for d in engine.step() if d.request_id == "waits"
                   for t in d.new_token_ids]
    assert tokens == expected[("r4", 1)]
    after = engine.stats()
    # (a preempted request may find its own blocks on disk too, read there)
    assert after.kv_disk_hit_tokens - before.kv_disk_hit_tokens >= 16
    assert after.kv_disk_read_ahead - before.kv_disk_read_ahead == 4
    assert after.kv_disk_refused == before.kv_disk_refused
    # alone, a request has no step to overlap: nothing is read ahead
    _evict_everything(llm, llama_adapters)
    assert _run(llm, llama_adapters, "r4", "tenant-a", 0) == expected[("r4", 0)]
    assert engine.stats().kv_disk_read_ahead == after.kv_disk_read_ahead
    # a file the reader refuses is counted and deleted at its lookup; the rest recomputes
    _evict_everything(llm, llama_adapters)
    disk.flush()
    first = hash_block(None, tuple(_prompt(0)[:BLOCK]),
                       extra_keys_for(("r4", ref.digest), "tenant-a"))
    path = disk.dir / f"{first.hex()}.kvb"
    raw = path.read_bytes()
    path.write_bytes(raw[:-100] + bytes([raw[-100] ^ 0x40]) + raw[-99:])
    engine.add_request("runs-2", _prompt(6), params, cache_salt="filler-y")
    engine.add_request("waits-2", _prompt(2), params, adapter=ref, cache_salt="tenant-a")
    disk._reader.submit(lambda: None).result()
    tokens = []
    while engine.has_unfinished():
        tokens += [t for d in engine.step() if d.request_id == "waits-2"
                   for t in d.new_token_ids]
    assert tokens == expected[("r4", 2)]
    assert engine.stats().kv_disk_refused == after.kv_disk_refused + 1
    disk.flush()
    assert not path.exists()
    _check_idle(llm, tmp_path)
    llm.engine.close()


def test_damaged_cut_and_foreign_files_are_refused_and_recomputed(
        tiny_llama_dir: Path, tiny_qwen2_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]], tmp_path: Path) -> None:
    llm = _llm(tiny_llama_dir, tmp_path)
    _run_all(llm, llama_adapters, expected, 0)
    disk = llm.engine.disk
    assert disk is not None
    disk.flush()
    files = _files(tmp_path)
    assert len(files) >= 3
    layout = disk.layout
    foreign = model_fingerprint(tiny_qwen2_dir, layout)
    assert foreign != disk.fingerprint
    for n, path in enumerate(files):
        raw = path.read_bytes()
        if n % 3 == 0:  # a flipped byte in the KV data
            path.write_bytes(raw[:-100] + bytes([raw[-100] ^ 0x40]) + raw[-99:])
        elif n % 3 == 1:  # cut short
            path.write_bytes(raw[: len(raw) // 2])
        else:  # a block of another model, same identity, valid checksum
            block = decode_block(raw, disk.fingerprint, layout)
            path.write_bytes(encode_block(dataclasses.replace(block, fingerprint=foreign)))
    _run_all(llm, llama_adapters, expected, 1)
    refused = llm.engine.stats().kv_disk_refused
    assert refused >= 3
    _check_idle(llm, tmp_path)
    llm.engine.close()

    # what is left damaged is refused at start (cut, foreign) or on first use (flipped);
    # none of it is ever served
    again = _llm(tiny_llama_dir, tmp_path)
    _run_all(again, llama_adapters, expected, 0)
    _run_all(again, llama_adapters, expected, 1)
    _check_idle(again, tmp_path)
    assert again.engine.stats().kv_disk_refused > 0
    # cut and foreign files went at start; a flipped one no lookup reached may wait for
    # its first use, where its checksum refuses it
    for path in _files(tmp_path):
        try:
            decode_block(path.read_bytes(), disk.fingerprint, layout)
        except BlockRefused as exc:
            assert exc.reason == "checksum", path
    again.engine.close()


def test_a_crash_leftover_is_removed_at_start(tiny_llama_dir: Path, tmp_path: Path) -> None:
    llm = _llm(tiny_llama_dir, tmp_path)
    assert llm.engine.disk is not None
    folder = llm.engine.disk.dir
    llm.engine.close()
    (folder / ".deadbeef.kvb.123.tmp").write_bytes(b"half a block")
    again = _llm(tiny_llama_dir, tmp_path)
    assert not list(folder.glob("*.tmp"))
    assert again.engine.stats().kv_disk_blocks == 0
    again.engine.close()


# Writes the disk tier for as long as it lives: every domain's prompts, then fillers that
# push their prefixes out of the 10-block pool, round after round.
_WRITER = """
import json, sys
sys.path[:0] = [{tests!r}, {tests!r} + "/.."]
from test_kv_disk import DOMAINS, _llm, _run
from pathlib import Path
model, disk, adapters = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
llm = _llm(Path(model), disk)
adapters = {{k: Path(v) for k, v in adapters.items()}}
for r in range(10 ** 6):
    for i, (adapter, salt) in enumerate(DOMAINS):
        _run(llm, adapters, adapter, salt, (r + i) % 4)
        _run(llm, adapters, None, f"filler-{{r}}-{{i}}", 5)
"""


@pytest.mark.server
def test_kill_9_while_writing_leaves_nothing_a_restart_uses(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]], tmp_path: Path) -> None:
    """A process writing the tier is killed (SIGKILL) three times, at 2, 6 and 12 files:
    the restart finds no temporary file, refuses nothing (a block file has its final name
    only once whole), serves disk hits with HF + PEFT's outputs and ends with every block
    free or cached."""
    script = _WRITER.format(tests=str(Path(__file__).resolve().parent))
    adapters = json.dumps({k: str(v) for k, v in llama_adapters.items()})
    for target in (2, 6, 12):
        proc = subprocess.Popen([sys.executable, "-c", script, str(tiny_llama_dir),
                                 str(tmp_path), adapters], stderr=subprocess.PIPE)
        try:
            wait_until(lambda n=target: len(_files(tmp_path)) >= n, proc,
                       f"the writer (to {target} block files)")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
        assert proc.returncode == -signal.SIGKILL
    llm = _llm(tiny_llama_dir, tmp_path)
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    start = llm.engine.stats()
    assert start.kv_disk_refused == 0 and start.kv_disk_blocks >= 12
    for i in range(4):
        _run_all(llm, llama_adapters, expected, i)
    stats = llm.engine.stats()
    assert stats.kv_disk_hit_tokens >= 16 * len(DOMAINS)
    assert stats.kv_disk_refused == 0
    _check_idle(llm, tmp_path)
    llm.engine.close()


def test_bad_disk_settings_are_one_line_config_errors(tiny_llama_dir: Path,
                                                      tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for gib in ("0", "-1"):
        args = parser.parse_args(["--kv-disk-dir", str(tmp_path), "--kv-disk-gib", gib])
        with pytest.raises(ConfigError, match="kv_disk_gib must be positive"):
            engine_config_from_args(args, str(tiny_llama_dir))
    args = parser.parse_args([])
    assert engine_config_from_args(args, str(tiny_llama_dir)).cache.kv_disk_dir is None
    with pytest.raises(ConfigError, match="prefix caching"):
        CacheConfig(enable_prefix_caching=False, kv_disk_dir=str(tmp_path))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError) as info:
        _llm(tiny_llama_dir, blocker / "kv")
    assert "\n" not in str(info.value) and "--kv-disk-dir" in str(info.value)


def test_layout_is_the_pools(tiny_llama_dir: Path, tmp_path: Path) -> None:
    llm = _llm(tiny_llama_dir, tmp_path)
    disk = llm.engine.disk
    assert disk is not None
    a = llm.engine.runner.args
    assert disk.layout == KVLayout(a.num_layers, a.num_kv_heads, a.head_dim, BLOCK, "float32")
    # the runner's bytes round-trip through the pool
    runner = llm.engine.runner
    data = array("f", range(disk.layout.data_bytes // 4)).tobytes()
    runner.write_blocks([(3, data)])
    assert runner.read_blocks([3]) == [data]
    llm.engine.close()


def _outputs(llm: LLM, adapters: dict[str, Path], rounds: int) -> dict[tuple[Any, ...], list[int]]:
    return {(adapter, salt, i): _run(llm, adapters, adapter, salt, i)
            for i in range(rounds) for adapter, salt in DOMAINS}


def test_bf16_disk_hits_match_its_own_single_engine_run(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path], tmp_path: Path) -> None:
    """bf16 cannot match the float32 oracle exactly, so its oracle is the same bf16 engine
    with a pool that holds every prefix and no disk tier: its prefixes are pool hits, the
    disk engine's are loaded back from disk, and greedy outputs are identical. A float32
    block file (the same block hash: hashes do not depend on the dtype) is refused by the
    bf16 engine, at start and on a lookup, and counted."""
    single = LLM(str(tiny_llama_dir), dtype="bfloat16", progress=False, max_lora_rank=16,
                 block_size=BLOCK, num_kv_blocks=256)
    want = _outputs(single, llama_adapters, 3)
    assert single.engine.stats().prefix_cache_hit_tokens >= 16 * len(DOMAINS) * 2
    assert single.engine.stats().kv_disk_max_bytes == 0
    single.engine.close()

    llm = _llm(tiny_llama_dir, tmp_path, dtype="bfloat16")
    disk = llm.engine.disk
    assert disk is not None
    assert disk.layout.dtype == "bfloat16"
    assert _outputs(llm, llama_adapters, 3) == want
    stats = llm.engine.stats()
    # rounds 1 and 2: every domain's 16-token prefix came back from disk
    assert stats.kv_disk_hit_tokens >= 16 * len(DOMAINS) * 2
    assert stats.kv_disk_refused == 0
    _check_idle(llm, tmp_path)
    bf16_files = {p.name: p for p in disk.dir.glob("*.kvb")}
    assert bf16_files
    for path in bf16_files.values():  # bf16 bytes on disk: half of float32's data
        assert read_header(path.read_bytes()).data_len == disk.layout.data_bytes
    llm.engine.close()

    # float32 blocks of the same prefixes, in float32's own folder, every one on disk
    f32 = _llm(tiny_llama_dir, tmp_path)
    _outputs(f32, llama_adapters, 1)
    _evict_everything(f32, llama_adapters)
    assert f32.engine.disk is not None and f32.engine.disk.dir != disk.dir
    f32.engine.disk.flush()
    f32_layout, f32_fp = f32.engine.disk.layout, f32.engine.disk.fingerprint
    assert f32_layout.data_bytes == 2 * disk.layout.data_bytes
    f32_files = {p.name: p for p in f32.engine.disk.dir.glob("*.kvb")}
    f32.engine.close()
    # The first block of each domain's prefix (no parent): refusing it recomputes the whole
    # prompt, as the single engine computed it, so outputs stay bit for bit its outputs.
    firsts = sorted(name for name in set(f32_files) & set(bf16_files)
                    if read_header(bf16_files[name].read_bytes()).identity.parent_hash is None)
    assert len(firsts) == len(DOMAINS)
    raw = f32_files[firsts[0]].read_bytes()
    with pytest.raises(BlockRefused) as info:
        decode_block(raw, disk.fingerprint, disk.layout)
    assert info.value.reason == "fingerprint"
    # Into the bf16 folder under their block hashes: one as float32 wrote it, one claiming
    # bf16's fingerprint with float32's layout (checksum valid). Both refused at start.
    (disk.dir / firsts[0]).write_bytes(raw)
    forged = dataclasses.replace(decode_block(f32_files[firsts[1]].read_bytes(), f32_fp,
                                              f32_layout), fingerprint=disk.fingerprint)
    (disk.dir / firsts[1]).write_bytes(encode_block(forged))
    again = _llm(tiny_llama_dir, tmp_path, dtype="bfloat16")
    assert again.engine.disk is not None
    assert again.engine.stats().kv_disk_refused == 2
    again.engine.disk.flush()
    assert not (disk.dir / firsts[0]).exists() and not (disk.dir / firsts[1]).exists()
    # The rest, indexed as bf16, replaced by float32's: refused by the lookups that read them.
    for name in firsts[2:]:
        (disk.dir / name).write_bytes(f32_files[name].read_bytes())
    assert _outputs(again, llama_adapters, 3) == want
    stats = again.engine.stats()
    assert stats.kv_disk_refused == len(DOMAINS)
    # the recomputed first blocks went back to disk in bf16 and served later rounds
    assert stats.kv_disk_hit_tokens >= 16 * len(DOMAINS) * 2
    _check_idle(again, tmp_path)
    again.engine.close()


def test_a_draft_model_computes_its_own_kv_over_disk_hits(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]], tmp_path: Path) -> None:
    """The tier keeps the target's KV only; the draft model computes its own again over a
    prefix loaded from disk (as over any prefix hit), so it proposes what it proposes
    where the whole prompt was computed: the same tokens accepted."""
    draft = save_first_layers(tiny_llama_dir, tmp_path / "draft", 2)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}
    plain = LLM(str(tiny_llama_dir), progress=False, max_lora_rank=16, block_size=BLOCK,
                num_kv_blocks=10, speculative_config=spec, enable_prefix_caching=False)
    llm = _llm(tiny_llama_dir, tmp_path / "tier", speculative_config=spec)
    for i in range(2):
        for adapter, salt in DOMAINS:
            assert _run(plain, llama_adapters, adapter, salt, i) == expected[(adapter, i)]
            assert _run(llm, llama_adapters, adapter, salt, i) == expected[(adapter, i)]
    stats, alone = llm.engine.stats(), plain.engine.stats()
    assert stats.kv_disk_hit_tokens >= 16 * len(DOMAINS)  # the second round's prefixes
    assert stats.spec_num_accepted_tokens == alone.spec_num_accepted_tokens > 0
    _check_idle(llm, tmp_path / "tier")
    llm.engine.close()
    plain.engine.close()


def test_a_clean_stop_saves_the_pool_for_the_restart(
        tiny_llama_dir: Path, llama_adapters: dict[str, Path],
        expected: dict[tuple[Any, int], list[int]], tmp_path: Path) -> None:
    """Blocks still in the pool at a clean stop (never evicted) go to the tier, so the
    restarted engine finds them, for their own tenant and adapter version only."""
    llm = _llm(tiny_llama_dir, tmp_path)
    assert _run(llm, llama_adapters, "r4", "tenant-a", 0) == expected[("r4", 0)]
    assert llm.engine.stats().kv_disk_writes == 0  # nothing was evicted
    llm.close()
    assert len(_files(tmp_path)) >= 4
    again = _llm(tiny_llama_dir, tmp_path)
    assert _run(again, llama_adapters, "r4", "tenant-b", 1) == expected[("r4", 1)]
    assert again.engine.stats().kv_disk_hit_tokens == 0
    assert _run(again, llama_adapters, "r4", "tenant-a", 1) == expected[("r4", 1)]
    assert again.engine.stats().kv_disk_hit_tokens == 16
    _check_idle(again, tmp_path)
    again.engine.close()
