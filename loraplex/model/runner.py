"""The model runner: one batch of sequences at any mix of prefill and decode → tokens.

It owns the resident model, the paged KV cache tensors (plus the host swap pool), the
LoRA slot weights and, for the ``draft_model`` method of speculative decoding, the draft
model with its own KV pool (``model/draft.py``). What to run comes in as ``BatchInputs``; the engine decides it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loraplex.config import CacheConfig, LoRAConfig, ModelConfig
from loraplex.errors import ConfigError, first_line
from loraplex.malloc import keep_freed_memory
from loraplex.model.args import ModelArgs
from loraplex.model.decoder import DecoderLayer
from loraplex.model.draft import DraftModel
from loraplex.model.loader import DTYPES, load_model, load_tokenizer, qk_head_order
from loraplex.model.lora import MODULE_SLICES, LoRALinear, LoRAStep
from loraplex.model.sampler import SampledToken, SamplingRow, sample, verify
from loraplex_kernels import cpu_native
from loraplex_kernels.lora_slots import SlotWeights
from loraplex_kernels.meta import AttentionMeta, SGMVMeta, short_segment_limit
from loraplex_kernels.ops import Backend, argmax_rows, cpu_gemm_choice

if TYPE_CHECKING:
    from loraplex.model.adapter_loader import LoRAAdapter

_CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass(frozen=True, eq=False)
class PreparedLoRA:
    """An adapter as the per-slot layout's slots hold it (``ModelRunner.prepare_lora``):
    per (layer, projection) its tensors, or None where it targets nothing."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], SlotWeights | None]


@dataclass(frozen=True)
class SeqInput:
    """One sequence's share of a step."""

    token_ids: Sequence[int]  # the tokens computed this step
    num_computed: int  # positions already in the KV cache before them
    block_table: Sequence[int]
    lora_slot: int = -1  # -1: base model
    # One row per token to sample from this sequence's last position: empty mid-prefill,
    # several when n > 1 parallel samples start from one prompt.
    samplings: Sequence[SamplingRow] = ()
    # Prompt logprobs: the prompt token each of the first len(prompt_targets) positions
    # computed this step predicts, whose logprob (and num_prompt_top best) is wanted.
    prompt_targets: Sequence[int] = ()
    num_prompt_top: int = 0
    # Speculative decoding: the last len(spec_token_ids) of token_ids are proposals, to be
    # verified against the logits of the positions before them (one sampling row).
    spec_token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class BatchInputs:
    seqs: Sequence[SeqInput]


@dataclass(frozen=True)
class SeqOutput:
    """What one sequence got from a step: its sampled tokens (often none; one per sampling
    row), the prompt logprobs it asked for (``token_id``: the prompt token scored) and, when
    it speculated, the proposals accepted (they come before ``sampled[0]``)."""

    sampled: list[SampledToken]
    prompt_logprobs: list[SampledToken]
    accepted: list[SampledToken] = field(default_factory=list)


def pick_device(device: str | None) -> torch.device:
    """``device``, or CUDA where there is one and else the CPU; ConfigError for a device this
    machine does not have."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: no CUDA device here")
    if chosen.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return chosen


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 lora_config: LoRAConfig, progress: bool = True,
                 kernel_backend: Backend | None = None,
                 draft_model: str | None = None) -> None:
        self.device = pick_device(model_config.device)
        self.dtype = DTYPES[model_config.dtype]
        self.lora_config = lora_config
        self.block_size = cache_config.block_size
        self.kernel_backend = kernel_backend
        if self.device.type == "cpu" and progress:
            # A first build takes tens of seconds (minutes on a busy machine): shown, never
            # a silent wait before the model loads.
            cpu_native.prepare(lambda line: print(f"loraplex kernels: {line}",
                                                  file=sys.stderr, flush=True))
        try:
            # refuse a bad LORAPLEX_CPU_GEMM, _BF16, _AMX or _LORA_READ_AHEAD before
            # loading anything
            cpu_gemm_choice()
            cpu_native.bf16_impl()
            amx = cpu_native.amx_choice()
            read_ahead = cpu_native.read_ahead_choice()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.model, self.args = load_model(
            model_config.model, model_config.dtype, self.device, lora_config.max_loras,
            lora_config.max_lora_rank, model_config.max_model_len, progress)
        self.model.pack_weights()
        self.qk_head_order = qk_head_order(self.args)
        if progress:
            print(f"loraplex model: {self.model.describe()}", file=sys.stderr, flush=True)
        if self.device.type == "cpu":
            keep_freed_memory()  # every step allocates its activations anew
            cpu_native.skinny_amx(amx == "auto")  # bf16 decode GEMMs on AMX tiles
            # decode GEMMs reading their LoRA weights ahead (csrc/lora.h)
            cpu_native.lora_read_ahead("auto" if read_ahead == "auto" else read_ahead == "1")
            if self.dtype == torch.bfloat16 and "avx512_bf16" not in cpu_native.bf16_impls():
                logging.getLogger("loraplex").warning(
                    "bfloat16 runs without AVX512_BF16 kernels here (the CPU lacks the "
                    "instructions or the native kernels are off): its GEMMs compute in "
                    "float32 on widened weights and it gains only from reading half the "
                    "bytes, about 1.2x float32 against 2x with the instructions "
                    "(docs/benchmarks.md, AVX2 EPYC)")
        self.max_model_len = model_config.max_model_len or self.args.max_served_positions
        self.tokenizer = load_tokenizer(model_config.model)
        # Loaded before the KV pools are sized: its weights take memory, and its blocks
        # count in every block's cost.
        self.drafter = (DraftModel(draft_model, self.args, self.tokenizer, self.max_model_len,
                                   model_config.dtype, self.device, progress)
                        if draft_model is not None else None)
        self.num_blocks = self._num_blocks(cache_config)
        shape = (self.num_blocks, self.block_size, self.args.num_kv_heads, self.args.head_dim)
        host_shape = (cache_config.swap_space_blocks,) + shape[1:]
        try:
            # Per layer: K and V, each [num_blocks, block_size, num_kv_heads, head_dim]
            self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                               torch.zeros(shape, dtype=self.dtype, device=self.device))
                              for _ in range(self.args.num_layers)]
            self.host_caches = [(torch.zeros(host_shape, dtype=self.dtype),
                                 torch.zeros(host_shape, dtype=self.dtype))
                                for _ in range(self.args.num_layers)] if host_shape[0] else []
        except (RuntimeError, MemoryError) as exc:  # torch's "can't allocate memory"
            raise ConfigError(
                f"cannot allocate the KV cache ({self.num_blocks} blocks, "
                f"{cache_config.swap_space_blocks} on the host, "
                f"{self.num_blocks * self.block_bytes:,} bytes on the device): "
                f"{first_line(exc)}; lower --num-kv-blocks, --kv-cache-memory or "
                "--swap-space-blocks") from None
        if self.drafter is not None:
            self.drafter.allocate(self.num_blocks, self.block_size,
                                  cache_config.swap_space_blocks, self.device)
        self.slot_ranks = [0] * lora_config.max_loras
        self.lora_scales = torch.zeros(lora_config.max_loras, dtype=torch.float32,
                                       device=self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(model_config.seed)

    @property
    def sliding_window(self) -> int:
        """The window every layer's attention stays within (the target's and a draft
        model's, which read the same block tables), 0 where any layer sees the whole
        context: blocks wholly behind it may be released."""
        windows = [self.args.max_window]
        if self.drafter is not None:
            windows.append(self.drafter.args.max_window)
        return 0 if 0 in windows else max(windows)

    @property
    def block_bytes(self) -> int:
        """What one KV block costs: the target's pool, plus the draft's when there is one
        (both pools hold the same blocks)."""
        a = self.args
        target = (2 * a.num_layers * self.block_size * a.num_kv_heads * a.head_dim
                  * torch.finfo(self.dtype).bits // 8)
        return target + (self.drafter.block_bytes(self.block_size) if self.drafter else 0)

    def _pools(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                              list[tuple[torch.Tensor, torch.Tensor]]]:
        """Every layer's device and host KV tensors: the target's, then the draft's."""
        if self.drafter is None:
            return self.kv_caches, self.host_caches
        return (self.kv_caches + self.drafter.kv_caches,
                self.host_caches + self.drafter.host_caches)

    def _num_blocks(self, cache: CacheConfig) -> int:
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        budget = cache.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.85)
            else:
                budget = _CPU_DEFAULT_KV_BYTES
        num = budget // self.block_bytes
        if num < 1:
            raise ConfigError(f"kv_cache_memory of {budget} bytes holds no block of "
                              f"{self.block_bytes} bytes")
        return int(num)

    # --- LoRA slots -------------------------------------------------------------------

    def _lora_modules(self, layer: int) -> dict[str, LoRALinear]:
        blk: DecoderLayer = self.model.layers[layer]  # type: ignore[assignment]
        return {"qkv_proj": blk.self_attn.qkv_proj, "o_proj": blk.self_attn.o_proj,
                "gate_up_proj": blk.mlp.gate_up_proj, "down_proj": blk.mlp.down_proj}

    def prepare_lora(self, adapter: LoRAAdapter) -> PreparedLoRA | LoRAAdapter:
        """The adapter as its slots will hold it, where the layout allows (the CPU's
        per-slot layout): every projection's tensors in the model's dtype and the kernels'
        layout, built here, off the engine's step loop (the adapter loader's thread), so
        that installing it into a slot copies nothing. Elsewhere the adapter itself (the
        stacked layout copies into its slot)."""
        modules = [self._lora_modules(layer) for layer in range(self.args.num_layers)]
        if any(m.lora.layout != "per_slot" for m in modules[0].values()):
            return adapter
        with torch.no_grad():
            weights = {(layer, name): module.lora.prepare(pairs, adapter.scaling)
                       for layer, by_name in enumerate(modules)
                       for name, (module, pairs) in self._slot_pairs(layer, by_name,
                                                                     adapter).items()}
        return PreparedLoRA(adapter.name, adapter.rank, adapter.scaling, weights)

    def _slot_pairs(self, layer: int, modules: dict[str, LoRALinear], adapter: LoRAAdapter,
                    ) -> dict[str, tuple[LoRALinear, list[tuple[torch.Tensor, torch.Tensor]
                                                          | None]]]:
        """Per projection of ``layer``: its module and each slice's (A, B) of the adapter
        (None: not targeted), in the model's dtype and device."""
        pairs: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {
            name: [None] * len(m.slice_widths) for name, m in modules.items()}
        for peft_name, (ours, slice_idx) in MODULE_SLICES.items():
            w = adapter.weights.get((layer, peft_name))
            if w is not None:
                lora_b = w.lora_b
                if self.qk_head_order is not None and peft_name in ("q_proj", "k_proj"):
                    # the base q/k rows were reordered for a partial rotation (loader)
                    rank = lora_b.shape[1]
                    lora_b = lora_b.view(-1, self.args.head_dim, rank)[
                        :, self.qk_head_order].reshape(-1, rank)
                pairs[ours][slice_idx] = (w.lora_a.to(self.device, self.dtype),
                                          lora_b.to(self.device, self.dtype))
        return {name: (m, pairs[name]) for name, m in modules.items()}

    def set_lora_slot(self, slot: int, adapter: LoRAAdapter | PreparedLoRA | None) -> None:
        """Writes an adapter's weights into a slot (``None`` empties it); a
        ``prepare_lora`` result is installed without copying."""
        if adapter is not None and not isinstance(adapter, PreparedLoRA):
            adapter = self.prepare_lora(adapter)
        with torch.no_grad():
            for layer in range(self.args.num_layers):
                modules = self._lora_modules(layer)
                if isinstance(adapter, PreparedLoRA):
                    for name, module in modules.items():
                        module.lora.install(slot, adapter.weights[layer, name])
                    continue
                if adapter is None:
                    for module in modules.values():
                        module.lora.set(slot, [None] * len(module.slice_widths), 0.0)
                    continue
                for module, pairs in self._slot_pairs(layer, modules, adapter).values():
                    module.lora.set(slot, pairs, adapter.scaling)
        self.slot_ranks[slot] = adapter.rank if adapter else 0
        self.lora_scales[slot] = adapter.scaling if adapter else 0.0

    # --- KV block movement ------------------------------------------------------------

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for k, v in self._pools()[0]:
            k[dst] = k[src]
            v[dst] = v[src]

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies (device block, host block) pairs to the host pool."""
        self._transfer(pairs, to_host=True)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies (host block, device block) pairs back to the device."""
        self._transfer(pairs, to_host=False)

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """The target model's K/V of each block, in the portable form's data layout
        (``engine/kv_blocks.py``): ``[num_layers, 2, block_size, num_kv_heads, head_dim]``
        in the pool's dtype, C order. Reads only (the disk tier saves evicted blocks)."""
        if not block_ids:
            return []
        idx = torch.tensor(list(block_ids), device=self.device)
        # [num_layers, 2, n, block_size, num_kv_heads, head_dim]
        stacked = torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)))
                               for k, v in self.kv_caches]).cpu()
        per_block = stacked.permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, layers, 2, ...]
        raw = per_block.view(torch.uint8).reshape(len(block_ids), -1).numpy()
        return [raw[i].tobytes() for i in range(len(block_ids))]

    def write_blocks(self, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Writes ``(block id, data)`` pairs of ``read_blocks``' layout into the pool."""
        if not blocks:
            return
        a = self.args
        data = torch.stack([torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                            for _, raw in blocks])
        # [n, num_layers, 2, block_size, num_kv_heads, head_dim]
        kv = data.view(self.dtype).reshape(len(blocks), a.num_layers, 2, self.block_size,
                                           a.num_kv_heads, a.head_dim).to(self.device)
        idx = torch.tensor([b for b, _ in blocks], device=self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k[idx] = kv[:, layer, 0]
            v[idx] = kv[:, layer, 1]

    def _transfer(self, pairs: Sequence[tuple[int, int]], to_host: bool) -> None:
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs])
        dst = torch.tensor([b for _, b in pairs])
        device, host = self._pools()
        for (k, v), (hk, hv) in zip(device, host, strict=True):
            if to_host:
                hk[dst] = k[src.to(k.device)].cpu()
                hv[dst] = v[src.to(v.device)].cpu()
            else:
                k[dst.to(k.device)] = hk[src].to(k.device)
                v[dst.to(v.device)] = hv[src].to(v.device)

    # --- one step ---------------------------------------------------------------------

    def execute(self, batch: BatchInputs) -> list[SeqOutput]:
        """Runs one forward; returns what each sequence got, in the batch's order."""
        hidden, starts = self._hidden(batch)
        prompt = [self._prompt_logprobs(hidden, start, s)
                  for s, start in zip(batch.seqs, starts, strict=True)]
        if not any(s.samplings for s in batch.seqs):
            return [SeqOutput([], p) for p in prompt]
        if not any(s.spec_token_ids for s in batch.seqs):
            logits = self._last_logits(batch, hidden, starts)  # [num_sampling_seqs, vocab]
            sampled = iter(self._sample(logits, batch.seqs))
            return [SeqOutput([next(sampled) for _ in s.samplings], p)
                    for s, p in zip(batch.seqs, prompt, strict=True)]
        return self._sample_with_spec(batch, hidden, starts, prompt)

    def _sample(self, logits: torch.Tensor,
                seqs: Sequence[SeqInput]) -> list[SampledToken]:
        """The tokens of ``seqs``' sampling rows, from one row of ``logits`` per sampling
        sequence."""
        rows = [row for s in seqs for row in s.samplings]
        if len(rows) != logits.shape[0]:
            repeat = torch.tensor([len(s.samplings) for s in seqs if s.samplings],
                                  device=logits.device)
            logits = logits.repeat_interleave(repeat, dim=0)  # [num_rows, vocab]
        return sample(logits, rows, self.generator)

    def _sample_with_spec(self, batch: BatchInputs, hidden: torch.Tensor, starts: list[int],
                          prompt: list[list[SampledToken]]) -> list[SeqOutput]:
        """Sampling when some sequences speculated: each scores the positions of its
        proposals too, and keeps what ``verify`` accepts."""
        positions: list[int] = []
        first_row: dict[int, int] = {}  # batch index -> its first logits row
        for i, (s, start) in enumerate(zip(batch.seqs, starts, strict=True)):
            if s.samplings:
                first_row[i] = len(positions)
                end = start + len(s.token_ids)
                positions.extend(range(end - 1 - len(s.spec_token_ids), end))
        logits = self.model.compute_logits(hidden.index_select(
            0, torch.tensor(positions, dtype=torch.int64, device=self.device)))  # [rows, vocab]
        plain = [i for i in first_row if not batch.seqs[i].spec_token_ids]
        sampled = iter(self._sample(
            logits.index_select(0, torch.tensor([first_row[i] for i in plain],
                                                dtype=torch.int64, device=self.device)),
            [batch.seqs[i] for i in plain])) if plain else iter(())
        outputs = []
        for i, (s, p) in enumerate(zip(batch.seqs, prompt, strict=True)):
            if not s.spec_token_ids:
                outputs.append(SeqOutput([next(sampled) for _ in s.samplings], p))
                continue
            num_spec = len(s.spec_token_ids)
            kept = verify(logits[first_row[i]:first_row[i] + num_spec + 1], s.spec_token_ids,
                          s.samplings[0], self.generator)
            tokens = [SampledToken(t, None, None) for t in kept]
            outputs.append(SeqOutput(tokens[-1:], p, tokens[:-1]))
        return outputs

    def _last_logits(self, batch: BatchInputs, hidden: torch.Tensor,
                     starts: list[int]) -> torch.Tensor:
        rows = [start + len(s.token_ids) - 1
                for s, start in zip(batch.seqs, starts, strict=True) if s.samplings]
        return self.model.compute_logits(
            hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=self.device)),
            float32=False)

    def _prompt_logprobs(self, hidden: torch.Tensor, start: int,
                         seq: SeqInput) -> list[SampledToken]:
        if not seq.prompt_targets:
            return []
        num = len(seq.prompt_targets)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[start:start + num]),
                                     dim=-1)  # [num, vocab]
        targets = torch.tensor(seq.prompt_targets, device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top: list[tuple[tuple[int, float], ...]] = [()] * num
        if seq.num_prompt_top > 0:
            values, ids = logprobs.topk(min(seq.num_prompt_top, logprobs.shape[1]), dim=-1)
            top = [tuple(zip(i, v, strict=True))
                   for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        return [SampledToken(t, lp, alts)
                for t, lp, alts in zip(seq.prompt_targets, chosen, top, strict=True)]

    def draft(self, seqs: Sequence[SeqInput], num_tokens: Sequence[int],
              num_layers: int) -> list[list[int]]:
        """Layer-skip proposals: each decode in ``seqs`` (its one last token) runs through
        the first ``num_layers`` layers and the LM head, greedily, ``num_tokens[i]`` times.

        Its KV goes to the slots the scheduler gave the proposals, in those layers only;
        the verifying forward writes the same values there again for every token it keeps.
        """
        proposals: list[list[int]] = [[] for _ in seqs]
        current = list(seqs)
        live = list(range(len(seqs)))
        while live:
            batch = BatchInputs([current[i] for i in live])
            hidden, starts = self._hidden(batch, num_layers)
            logits = self.model.compute_logits(hidden.index_select(
                0, torch.tensor(starts, dtype=torch.int64, device=self.device)))
            for i, token in zip(live, argmax_rows(logits).tolist(), strict=True):
                proposals[i].append(token)
                s = current[i]
                current[i] = SeqInput(token_ids=[token], num_computed=s.num_computed + 1,
                                      block_table=s.block_table, lora_slot=s.lora_slot)
            live = [i for i in live if len(proposals[i]) < num_tokens[i]]
        return proposals

    def propose(self, seqs: Sequence[SeqInput], num_tokens: Sequence[int]) -> list[list[int]]:
        """The draft model's greedy proposals, ``num_tokens[i]`` for ``seqs[i]`` (0: none).

        A sequence's ``token_ids`` are the tokens whose target KV exists, or is computed
        this step, but whose draft KV does not yet (``num_computed`` is where they start;
        the engine keeps their sum within the step's token budget): the draft catches up
        in one forward, which also yields its first proposal (none for a sequence only
        catching up, ``num_tokens[i] == 0``, whose tokens end short of its newest). It then
        feeds its own proposals, one forward each; their KV lands in the slots the scheduler
        gave the proposals, and is overwritten wherever the target rejects them.
        """
        assert self.drafter is not None
        proposals: list[list[int]] = [[] for _ in seqs]
        current = [SeqInput(token_ids=s.token_ids, num_computed=s.num_computed,
                            block_table=s.block_table) for s in seqs]
        live = list(range(len(seqs)))  # the first forward: every sequence catches up
        while live:
            batch = BatchInputs([current[i] for i in live])
            hidden, starts = self._hidden(batch, draft=True)
            wanting = [j for j, i in enumerate(live) if len(proposals[i]) < num_tokens[i]]
            if not wanting:
                break
            rows = [starts[j] + len(batch.seqs[j].token_ids) - 1 for j in wanting]
            logits = self.drafter.model.compute_logits(hidden.index_select(
                0, torch.tensor(rows, dtype=torch.int64, device=self.device)))  # [rows, vocab]
            next_live = []
            for j, token in zip(wanting, logits.argmax(dim=-1).tolist(), strict=True):
                i = live[j]
                proposals[i].append(token)
                # The last proposal is not fed: the target computes it (or rejects it).
                if len(proposals[i]) < num_tokens[i]:
                    s = current[i]
                    current[i] = SeqInput(token_ids=[token],
                                          num_computed=s.num_computed + len(s.token_ids),
                                          block_table=s.block_table)
                    next_live.append(i)
            live = next_live
        return proposals

    def _hidden(self, batch: BatchInputs, num_layers: int | None = None,
                draft: bool = False) -> tuple[torch.Tensor, list[int]]:
        """One forward of the target (through its first ``num_layers`` layers only, if
        given) or, with ``draft``, of the draft model, base-only; the hidden states
        ``[num_tokens, hidden]`` of every token computed, and where each sequence's first
        token is among them."""
        # Sequences of one adapter side by side: each slot's tokens form one contiguous run,
        # which the LoRA step slices instead of gathering and scattering.
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.seqs[i].lora_slot)
        seqs = [batch.seqs[i] for i in order]
        input_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        starts = [0] * len(batch.seqs)
        for i, s in zip(order, seqs, strict=True):
            n = len(s.token_ids)
            starts[i] = len(input_ids)
            input_ids.extend(s.token_ids)
            positions.extend(range(s.num_computed, s.num_computed + n))
            token_slots.extend([s.lora_slot] * n)
        dev = self.device
        meta = AttentionMeta.build(
            [s.block_table for s in seqs], [s.num_computed + len(s.token_ids) for s in seqs],
            [len(s.token_ids) for s in seqs], self.block_size, dev)
        lora = None
        if draft:  # base-only
            assert self.drafter is not None
            self.drafter.record_forward(len(input_ids))
            hidden = self.drafter.model(torch.tensor(input_ids, device=dev),
                                        torch.tensor(positions, device=dev),
                                        self.drafter.kv_caches, meta, None,
                                        self.kernel_backend)  # [num_tokens, hidden]
            return hidden, starts
        if any(slot >= 0 for slot in token_slots):
            lora = LoRAStep(SGMVMeta.build(token_slots, self.slot_ranks, dev,
                                           short_segment_limit(self.dtype, dev)),
                            self.lora_scales, self.kernel_backend)
        hidden = self.model(torch.tensor(input_ids, device=dev),
                            torch.tensor(positions, device=dev), self.kv_caches, meta, lora,
                            self.kernel_backend, num_layers)  # [num_tokens, hidden]
        return hidden, starts

__all__ = ["BatchInputs", "ModelArgs", "ModelRunner", "SeqInput", "SeqOutput", "pick_device"]
