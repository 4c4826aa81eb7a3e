"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, params, lora_request)``."""

from __future__ import annotations

import itertools
import os
import stat
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loraplex.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    PreemptionMode,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
)
from loraplex.engine.engine import LLMEngine
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.request import AdapterRef
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.share import NO_SHARE, Share
from loraplex.engine.stats import EngineStats
from loraplex.errors import AdapterError, InvalidRequestError

# The adapter folders whose digests an LLM keeps (the least recently run dropped first).
_MAX_KNOWN_ADAPTERS = 1024


@dataclass(frozen=True)
class LoRARequest:
    """An adapter folder to run a prompt with; ``name`` is its id in caches and stats."""

    name: str
    path: str

    def to_ref(self) -> AdapterRef:
        from loraplex.adapter_format import folder_digest

        self.signature()
        return AdapterRef(self.name, folder_digest(self.path), self.path)

    def signature(self) -> tuple[int, ...]:
        """What the folder's two files are now by their metadata (device, inode, size,
        modification and change times in ns): any write to either changes it. AdapterError
        where one is missing."""
        from loraplex.adapter_format import CONFIG_FILE, WEIGHTS_FILE

        sig: list[int] = []
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            try:
                st = os.stat(os.path.join(self.path, name))
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise AdapterError(f"missing {name} in {self.path}")
            sig += [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        return tuple(sig)


class LLM:
    def __init__(self, model: str, dtype: str = "float32", max_loras: int = 4,
                 max_lora_rank: int = 64, max_cpu_loras: int = 16, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, device: str | None = None, seed: int = 0,
                 enable_chunked_prefill: bool = True,
                 preemption_mode: PreemptionMode = "recompute", swap_space_blocks: int = 0,
                 max_model_len: int | None = None,
                 speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None,
                 progress: bool = True, scheduling_policy: SchedulingPolicy = "fair",
                 max_kv_fraction: float | None = None, kv_disk_dir: str | None = None,
                 kv_disk_gib: float = 4.0) -> None:
        if speculative_config is not None and not isinstance(speculative_config,
                                                             SpeculativeConfig):
            speculative_config = SpeculativeConfig.from_json(speculative_config)
        self.config = EngineConfig(
            model=ModelConfig(model, dtype, device, seed, max_model_len),  # type: ignore[arg-type]
            cache=CacheConfig(block_size, num_kv_blocks, kv_cache_memory,
                              enable_prefix_caching, swap_space_blocks, kv_disk_dir,
                              kv_disk_gib),
            lora=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                      enable_chunked_prefill, preemption_mode,
                                      policy=scheduling_policy,
                                      max_kv_fraction=max_kv_fraction),
            speculative=speculative_config,
        )
        self.engine = LLMEngine(self.config, progress=progress)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # (name, folder) -> (its files' signature, its ref) of the adapters recently run
        self._refs: OrderedDict[tuple[str, str], tuple[tuple[int, ...], AdapterRef]] = \
            OrderedDict()

    def add_lora(self, lora_request: LoRARequest) -> AdapterRef:
        """Reads an adapter into the host cache now, as vLLM's ``add_lora``: its folder
        hashed for its identity (unless neither file changed since this LLM last did) and
        loaded, or refused with AdapterError. ``generate`` does this for each adapter it is
        given; calling it first takes the reading out of the first generation."""
        ref = self._adapter_ref(lora_request)
        self.engine.adapters.load_now(ref)
        return ref

    def _adapter_ref(self, lr: LoRARequest) -> AdapterRef:
        """``lr.to_ref()``, its digest kept while neither file changes: hashing is reading
        the whole weights file, and a benchmark's run of 20 adapters spent 0.26 s of 14.6
        in it, every call. A file written since (another adapter saved over it) has
        another signature and is hashed again, so its new content gets its new identity."""
        key = (lr.name, lr.path)
        sig = lr.signature()
        known = self._refs.get(key)
        if known is not None and known[0] == sig:
            self._refs.move_to_end(key)
            return known[1]
        ref = lr.to_ref()
        self._refs[key] = (sig, ref)
        self._refs.move_to_end(key)
        while len(self._refs) > _MAX_KNOWN_ADAPTERS:
            self._refs.popitem(last=False)
        return ref

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | None | Sequence[LoRARequest | None] = None,
        cache_salt: str | None | Sequence[str | None] = None,
        arrival_steps: Sequence[int] | None = None,
        share: Share | Sequence[Share] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in the prompts' order.

        ``share`` (one, or one per prompt): whose request each prompt is, when several
        tenants share the engine (``Share(tenant, weight, priority)``); the scheduler is
        fair between them. None: one anonymous tenant.

        ``arrival_steps`` (optional, one per prompt) admits prompt i only after that many
        engine steps, to exercise requests that arrive while others run.

        Prompts that arrive together are queued longest first (by ``max_tokens × n``): when
        more adapters are wanted than there are slots, some requests wait for a slot, and
        the run ends when the last-started long one does; starting the long ones first
        keeps that tail short (the classic longest-job-first rule for a batch's makespan).
        """
        items = _as_prompt_list(prompts)
        n = len(items)
        params = _per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        loras = _per_prompt(lora_request, n, "lora_request")
        salts = _per_prompt(cache_salt, n, "cache_salt")
        shares = _per_prompt(share or NO_SHARE, n, "share")
        # Each adapter folder is hashed (its identity: the whole weights file is read) once
        # while its files stay as they are (_adapter_ref), and loaded once per call,
        # however many prompts name it; it was once per prompt.
        refs: dict[int, AdapterRef] = {}
        by_folder: dict[tuple[str, str], AdapterRef] = {}
        for lr in loras:
            if lr is None or id(lr) in refs:
                continue
            key = (lr.name, lr.path)
            if key not in by_folder:
                by_folder[key] = self.add_lora(lr)  # fails fast, before anything is queued
            refs[id(lr)] = by_folder[key]
        arrivals = list(arrival_steps) if arrival_steps is not None else [0] * n
        if len(arrivals) != n:
            raise InvalidRequestError("arrival_steps must have one entry per prompt")
        outputs: dict[str, RequestOutput] = {}
        order = sorted(range(n), key=lambda i: (arrivals[i],
                                                -params[i].max_tokens * params[i].n))
        pending = list(order)
        ids = [f"offline-{next(self._ids)}" for _ in range(n)]
        step = 0
        try:
            while pending or self.engine.has_unfinished():
                while pending and arrivals[pending[0]] <= step:
                    i = pending.pop(0)
                    token_ids = items[i] if not isinstance(items[i], str) else \
                        self.tokenizer.encode(items[i])
                    lr = loras[i]
                    self.engine.add_request(ids[i], token_ids, params[i],
                                            refs[id(lr)] if lr is not None else None, salts[i],
                                            share=shares[i])
                    outputs[ids[i]] = RequestOutput(
                        ids[i], items[i] if isinstance(items[i], str) else None,
                        list(token_ids),
                        [CompletionOutput(j) for j in range(params[i].n)])
                for delta in self.engine.step():
                    if delta.error is not None:
                        if delta.error_param is not None:  # a grammar that cannot be followed
                            raise InvalidRequestError(delta.error, param=delta.error_param)
                        raise AdapterError(delta.error)
                    outputs[delta.request_id].apply(delta)
                step += 1
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [outputs[rid] for rid in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        """Releases the engine; with a disk tier, its prefix cache is saved there first."""
        self.engine.close(save_cache=True)


def _as_prompt_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts",
                                      param=name)
        return list(value)
    return [value] * n
