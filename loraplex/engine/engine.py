"""The engine: admission, one step (schedule → run → update), outputs. Single-threaded;
``EngineClient`` runs it on a background thread."""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from loraplex.config import EngineConfig
from loraplex.engine.backend import ModelDescription
from loraplex.engine.detokenizer import Detokenizer
from loraplex.engine.grammar import Constraint, GrammarCompiler, MaskFiller
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_events import KVEventLog
from loraplex.engine.kv_hashing import extra_keys_for
from loraplex.engine.kv_offload import KVOffload, kv_identity, make_disk_tier
from loraplex.engine.outputs import RequestMetrics, SequenceDelta
from loraplex.engine.request import AdapterKey, AdapterRef, Request, RequestStatus
from loraplex.engine.sampling_params import GrammarSpec, SamplingParams
from loraplex.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from loraplex.engine.share import NO_SHARE, Share
from loraplex.engine.slot_cache import AdapterSlotCache, deleted_error
from loraplex.engine.spec_step import SpecStep
from loraplex.engine.stats import EngineStats
from loraplex.engine.validation import check_params, check_prompt
from loraplex.errors import (
    AdapterError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
)
from loraplex.model.adapter_loader import LoRAAdapter, TargetShapes, load_adapter
from loraplex.model.args import ModelArgs
from loraplex.model.runner import BatchInputs, ModelRunner, PreparedLoRA, SeqInput, SeqOutput
from loraplex.model.sampler import SampledToken, SamplingRow, bias_tensors, id_tensor

logger = logging.getLogger(__name__)


def model_description(config: EngineConfig, args: ModelArgs) -> ModelDescription:
    """What an engine of ``config`` serves, from the model's architecture facts alone (no
    weights): a gateway in front of remote replicas computes it to check theirs."""
    model = config.model.model
    return ModelDescription(model=model, tokenizer=model,
                            max_model_len=config.model.max_model_len
                            or args.max_served_positions,
                            vocab_size=args.vocab_size,
                            max_lora_rank=config.lora.max_lora_rank,
                            target_shapes=TargetShapes.from_model_dir(model),
                            architecture=args.family,
                            max_pinned=config.lora.max_pinned)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True,
                 max_adapter_wait_s: float = 2.0) -> None:
        self.config = config
        spec = config.speculative
        self.runner = ModelRunner(config.model, config.cache, config.lora, progress=progress,
                                  draft_model=spec.model if spec is not None else None)
        self.tokenizer = self.runner.tokenizer
        self.detokenizer = Detokenizer(self.tokenizer)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = self._eos_ids()
        a = self.runner.args
        identity = functools.cache(functools.partial(kv_identity, config, a.num_layers,
                                                     a.num_kv_heads, a.head_dim))
        self.disk = make_disk_tier(config, identity)
        # What a router follows (the Ray replicas publish it): every block cached or evicted.
        self.kv_events = (KVEventLog(config.cache.block_size)
                          if config.cache.kv_events and config.cache.enable_prefix_caching
                          else None)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching,
                                 config.cache.swap_space_blocks, self.runner.sliding_window,
                                 lower_tier=self.disk, events=self.kv_events)
        # What leaves the pool: the disk tier, and blocks moved to or from another engine.
        self.offload = KVOffload(self.kv, self.runner, self.disk, identity)
        self.target_shapes = TargetShapes.from_model_dir(config.model.model)
        self.adapters = AdapterSlotCache(config.lora.max_loras, config.lora.max_cpu_loras,
                                       self._load_adapter, self.runner.set_lora_slot,
                                       config.lora.max_pinned)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.adapters,
                                   max_adapter_wait_s)
        self._grammar: GrammarCompiler | None = None  # made on the first grammar request
        self._grammar_lock = threading.Lock()
        self._grammar_failed: set[str] = set()  # groups a grammar error ended this step
        self._masks: MaskFiller | None = None
        # One thread computes a step's grammar masks while the forward pass runs.
        self._mask_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="loraplex-masks")
        self.spec = (SpecStep(spec, self.runner, self.kv, self.max_model_len,
                              config.scheduler.max_num_batched_tokens)
                     if spec is not None else None)
        self._groups: dict[str, list[Request]] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.num_steps = 0

    def export_prompt_blocks(self, token_ids: Sequence[int], adapter: AdapterRef | None,
                             cache_salt: str | None) -> list[bytes]:
        """The portable form of the blocks this engine's prefix cache holds for the prompt
        under the adapter version and salt (after a prefill, ``kv_transfer.py``)."""
        return self.offload.export_prompt(
            token_ids, extra_keys_for(adapter.key if adapter else None, cache_salt))

    def import_prompt_blocks(self, raws: Sequence[bytes], token_ids: Sequence[int],
                             adapter: AdapterRef | None, cache_salt: str | None) -> int:
        """Places another engine's blocks for this prompt in the prefix cache (before the
        request is added, so its lookup finds them): how many were usable. Refused ones
        are counted (``kv_transfer.py``); a deleted adapter version takes none."""
        if adapter is not None and self.adapters.is_deleted(adapter.key):
            return 0
        return self.offload.import_prompt(
            raws, token_ids, extra_keys_for(adapter.key if adapter else None, cache_salt))

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.runner.args.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def _load_adapter(self, ref: AdapterRef) -> LoRAAdapter | PreparedLoRA:
        """Reads and checks an adapter (on the adapter manager's loader thread, or at
        admission) and lays it out for its slots there (``ModelRunner.prepare_lora``), so
        an install on the step loop copies nothing where the layout allows."""
        adapter = load_adapter(ref.path, self.target_shapes, self.config.lora.max_lora_rank,
                               name=ref.adapter_id)
        if adapter.digest != ref.digest:
            raise AdapterError(f"adapter {ref.adapter_id!r}: file digest {adapter.digest[:12]} "
                               f"does not match the registered {ref.digest[:12]}")
        return self.runner.prepare_lora(adapter)

    @property
    def vocab_size(self) -> int:
        return self.runner.args.vocab_size

    def describe(self) -> ModelDescription:
        """The served model, as the engine boundary reports it."""
        return model_description(self.config, self.runner.args)

    def close(self, *, save_cache: bool = False) -> None:
        """Releases the engine's threads and files. ``save_cache`` (a clean stop, between
        steps: every cached block computed) first hands the prefix cache's blocks to the
        disk tier, so that a restart finds them there too."""
        self.adapters.close()
        self.offload.close(save_cache)
        self._mask_thread.shutdown(wait=True)
        with self._grammar_lock:
            if self._grammar is not None:
                self._grammar.close()

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler (reading the tokenizer takes about a second, so
        only an engine that gets a grammar request pays it). Any thread."""
        with self._grammar_lock:
            if self._grammar is None:
                backend = copy.copy(self.tokenizer.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                self._masks = MaskFiller(self.vocab_size)
                self._grammar = GrammarCompiler(backend.to_str(), self.vocab_size,
                                                self.eos_token_ids)
            return self._grammar

    def grammar_constraint(self, spec: GrammarSpec, tenant: str = "") -> Constraint:
        """A sequence's parser state for ``spec``, compiled under the sandbox's limits and
        cached per ``tenant`` (InvalidRequestError naming the field when it cannot be).
        Safe from any thread: the engine client compiles off the step thread and hands the
        result to ``add_request``."""
        return self.grammar_compiler().constraint(spec, tenant)

    def forget_adapter(self, adapter_id: str, digest: str) -> None:
        """Drops a deleted adapter version: its cached prefix blocks, its host copy, and its
        slot. Every request already here on it (running, queued, preempted or swapped out)
        finishes on its weights, kept until the last of them ends (read now if no copy is
        in memory: the caller removes the files only after this returns); one added after
        this is refused (AdapterError saying the version was deleted)."""
        key = (adapter_id, digest)
        tag = ("adapter", adapter_id, digest)
        self.kv.drop_cached(lambda keys: tag in keys)
        if self.disk is not None:
            self.disk.drop(lambda keys: tag in keys)
            self.disk.flush()  # its files are gone once this returns
        in_flight = next((r.adapter for r in self._unfinished()
                          if r.adapter is not None and r.adapter.key == key), None)
        self.adapters.forget(key, in_flight)

    def _unfinished(self) -> Iterator[Request]:
        for group in self._groups.values():
            for request in group:
                if not request.status.is_finished:
                    yield request

    def _release_deleted(self) -> None:
        """Lets go of a deleted adapter's kept weights once none of its requests is left."""
        if self.adapters.num_retained:
            self.adapters.release_deleted({r.adapter.key for r in self._unfinished()
                                           if r.adapter is not None})

    # --- admission ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, adapter: AdapterRef | None = None,
                    cache_salt: str | None = None, arrival_time: float | None = None, *,
                    constraint: Constraint | None = None, share: Share = NO_SHARE) -> None:
        """Queues a request, or raises an error that names what is wrong with it.
        ``constraint``: the grammar's parser state when the caller compiled it already
        (``grammar_constraint``, off this thread); else it is compiled here. ``share``:
        whose request it is, for fair scheduling between tenants."""
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                      param="request_id")
        if adapter is not None and self.adapters.is_deleted(adapter.key):
            raise deleted_error()
        prompt = [int(t) for t in prompt_token_ids]
        check_prompt(prompt, params.max_tokens, vocab_size=self.vocab_size,
                     max_model_len=self.max_model_len)
        check_params(params, vocab_size=self.vocab_size)
        total = len(prompt) + params.max_tokens
        if not self.kv.can_fit(total):
            raise PromptTooLongError(
                f"prompt plus max_tokens ({total} tokens) can never fit the KV cache of "
                f"{self.kv.num_blocks} blocks x {self.kv.block_size} tokens", param="prompt")
        request = Request(request_id=request_id, prompt_token_ids=prompt, params=params,
                          adapter=adapter, cache_salt=cache_salt,
                          arrival_time=(arrival_time if arrival_time is not None
                                        else time.monotonic()),
                          group_id=request_id, sample_index=0,
                          eos_token_ids=self.eos_token_ids, share=share)
        cap = self.scheduler.kv_cap(request)
        if cap is not None and self.kv.blocks_for(total) > cap:
            raise PromptTooLongError(
                f"prompt plus max_tokens ({total} tokens) needs {self.kv.blocks_for(total)} "
                f"KV blocks, over this tenant's cap of {cap}", param="prompt")
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and len(prompt) > sched.max_num_batched_tokens:
            raise PromptTooLongError(
                f"prompt ({len(prompt)} tokens) exceeds max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) with chunked prefill off", param="prompt")
        if params.n > sched.max_num_seqs:
            raise InvalidRequestError(f"n ({params.n}) exceeds max_num_seqs "
                                      f"({sched.max_num_seqs})", param="n")
        if self.scheduler.num_unfinished >= sched.max_waiting:
            raise EngineOverloadedError(f"engine queue is full ({sched.max_waiting} requests)")
        # Compiled here, before the request is queued: a grammar that cannot compile is
        # refused with the field that holds it.
        if params.grammar is not None and constraint is None:
            constraint = self.grammar_constraint(params.grammar, cache_salt or "")
        request.constraint = constraint
        request.arrival_step = self.num_steps
        if self.scheduler.has_unfinished() and not request.needs_prompt_logits:
            # It waits at least a step: its disk blocks are read meanwhile, off this thread.
            self.offload.read_ahead(prompt, request.extra_keys)
        self._groups[request_id] = [request]
        self.scheduler.add(request)

    def _generator(self, seq_id: str, sample_index: int,
                   params: SamplingParams) -> torch.Generator | None:
        """The sequence's own RNG when it has a seed: its draws never depend on the batch."""
        if params.seed is None or params.is_greedy:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=self.runner.device)
            # Sample i of n gets its own stream, derived from the seed alone.
            gen.manual_seed(params.seed if sample_index == 0
                            else hash((params.seed, sample_index)) & 0x7FFF_FFFF_FFFF)
            self._generators[seq_id] = gen
        return gen

    def abort(self, request_id: str) -> list[SequenceDelta]:
        """Ends every sequence of the request and frees what they hold."""
        deltas = []
        for request in self._groups.get(request_id, []):
            if not request.status.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                deltas.append(self._delta(request, [], []))
        self._forget_finished(request_id)
        if deltas and not self.scheduler.has_unfinished():
            self._check_quiescent()
        return deltas

    def has_unfinished(self) -> bool:
        """Requests to run, or pinned adapters a step is still to install."""
        return self.scheduler.has_unfinished() or self.adapters.has_pinned_to_install()

    def set_pinned_adapters(self, refs: Sequence[AdapterRef]) -> None:
        """Makes ``refs`` the operator's pinned adapters (replacing the previous set): each
        keeps its host copy and, once read, a device slot no other adapter takes, so its
        requests never wait for a load. AdapterError past ``LoRAConfig.max_pinned``."""
        self.adapters.set_pinned(list(refs))

    # --- the step ----------------------------------------------------------------------

    def step(self) -> list[SequenceDelta]:
        if self.adapters.has_pinned_to_install():
            self.adapters.install_pinned()
        plan = self.spec.plan(self.scheduler.running) if self.spec is not None else None
        out = self.scheduler.schedule(plan.num_tokens if plan is not None else None)
        self.offload.save_evicted()
        deltas = [self._error_delta(r, e) for r, e in out.failed]
        if out.is_empty:
            self.offload.load_pending()
            self._end_siblings(out.failed)
            return deltas
        self.num_steps += 1
        for seq in out.scheduled:
            if seq.request.first_scheduled_step is None:
                seq.request.first_scheduled_step = self.num_steps
        self.runner.swap_out(out.swap_out)
        self.runner.copy_blocks(out.block_copies)
        self.runner.swap_in(out.swap_in)
        self.offload.load_pending()
        spec_ids = (self.spec.proposals(out, plan)
                    if self.spec is not None and plan is not None else {})
        masks = self._start_masks([s.request for s in out.scheduled if s.samples])
        batch = BatchInputs([self._seq_input(s, spec_ids, masks) for s in out.scheduled])
        results = self.runner.execute(batch)
        deltas.extend(self._update(out, results))
        self._end_siblings(out.failed)
        if not self.scheduler.has_unfinished():
            self._check_quiescent()
        return deltas

    def _end_siblings(self, failed: list[tuple[Request, AdapterError]]) -> None:
        """A sequence whose adapter failed ends its whole request (its error delta ends
        every sequence of it for the consumer): its siblings (n > 1) stop at this step's end,
        as an abort stops them, rather than running on to max_tokens for nobody."""
        for request, _ in failed:
            self.abort(request.group_id or request.request_id)

    def _check_quiescent(self) -> None:
        """With no request left, every KV block must be free or cached and the block
        manager's counts consistent (O(blocks), so only when the engine goes idle). A
        failure is a bug that would leak blocks or mix sequences' KV: logged, not raised,
        so the engine keeps serving."""
        try:
            self.kv.check_invariants()
            assert self.kv.all_free_or_cached(), "blocks still held with no request left"
        except AssertionError as exc:
            logger.error("KV cache self-check failed with the engine idle: %s", exc)

    def _start_masks(self, sampling: list[Request]) -> dict[str, Callable[[], torch.Tensor]]:
        """Starts computing the grammar masks of this step's constrained sequences (on the
        mask thread, while the forward pass runs); each one's mask, when it is needed."""
        constrained = [r for r in sampling if r.constraint is not None]
        if not constrained:
            return {}
        assert self._masks is not None  # made with the compiler of their grammars
        future = self._mask_thread.submit(self._masks.fill,
                                          [r.constraint for r in constrained])
        return {r.request_id: functools.partial(lambda i: future.result()[i], i)
                for i, r in enumerate(constrained)}

    def _sampling_rows(self, request: Request,
                       allowed: Callable[[], torch.Tensor] | None = None) -> list[SamplingRow]:
        p = request.params
        # The prompt's last position samples all n sequences' first tokens at once.
        starts_group = (p.n > 1 and request.num_output_tokens == 0
                        and len(self._groups[request.group_id or request.request_id]) == 1)
        seq_ids = [request.request_id] + ([self._child_id(request, i) for i in range(1, p.n)]
                                          if starts_group else [])
        top_k = p.top_k if p.top_k > 0 else 0
        cache = request.sampling_cache
        banned = None
        if request.num_output_tokens < p.min_tokens:
            if "banned" not in cache:
                ids = p.stop_token_ids + (() if p.ignore_eos else request.eos_token_ids)
                cache["banned"] = id_tensor(ids) if ids else None
            banned = cache["banned"]
        if p.logit_bias and "bias" not in cache:
            cache["bias"] = bias_tensors(p.logit_bias)
        bias = cache.get("bias")
        # Penalties read the sequence's own token lists; the n samples of one prompt all
        # start from the same (empty) output.
        prompt_ids, output_ids = ((request.prompt_token_ids, request.output_token_ids)
                                  if p.has_penalties else ((), ()))
        return [SamplingRow(temperature=0.0 if p.is_greedy else p.temperature, top_k=top_k,
                            top_p=p.top_p, min_p=p.min_p,
                            generator=self._generator(
                                seq_id, i if starts_group else request.sample_index, p),
                            num_logprobs=p.logprobs, presence_penalty=p.presence_penalty,
                            frequency_penalty=p.frequency_penalty,
                            repetition_penalty=p.repetition_penalty, logit_bias=bias,
                            banned_ids=banned, prompt_token_ids=prompt_ids,
                            output_token_ids=output_ids, allowed=allowed,
                            full_distribution=(p.first_token_distribution
                                               and request.num_output_tokens == 0))
                for i, seq_id in enumerate(seq_ids)]

    def _seq_input(self, s: ScheduledSeq, spec_ids: dict[str, list[int]],
                   masks: dict[str, Callable[[], torch.Tensor]]) -> SeqInput:
        """One scheduled sequence's share of the step, for the runner."""
        request_id = s.request.request_id
        prompt_targets, num_prompt_top = self._prompt_targets(s.request, s.num_new_tokens)
        return SeqInput(
            token_ids=s.token_ids + spec_ids.get(request_id, []),
            num_computed=s.request.num_computed_tokens,
            block_table=self.kv.block_table(request_id), lora_slot=s.lora_slot,
            samplings=(self._sampling_rows(s.request, masks.get(request_id))
                       if s.samples else ()),
            prompt_targets=prompt_targets, num_prompt_top=num_prompt_top,
            spec_token_ids=spec_ids.get(request_id, ()))

    @staticmethod
    def _prompt_targets(request: Request, num_new: int) -> tuple[list[int], int]:
        """The prompt tokens this step's positions predict, while prompt logprobs are
        wanted: position i scores prompt token i + 1."""
        if not request.needs_prompt_logits:
            return [], 0
        start = request.num_computed_tokens
        end = min(start + num_new, request.num_prompt_tokens - 1)
        return request.prompt_token_ids[start + 1:end + 1], request.params.prompt_logprobs or 0

    @staticmethod
    def _child_id(request: Request, index: int) -> str:
        return f"{request.group_id}#{index}"

    def _update(self, out: SchedulerOutput, results: list[SeqOutput]) -> list[SequenceDelta]:
        now = time.monotonic()
        deltas: list[SequenceDelta] = []
        for sched, result in zip(out.scheduled, results, strict=True):
            request = sched.request
            if result.prompt_logprobs:
                # A recomputed prompt (after preemption) scores positions it already has.
                done = len(request.prompt_logprobs) - request.num_computed_tokens
                request.prompt_logprobs.extend((t.logprob or 0.0, t.top_logprobs or ())
                                               for t in result.prompt_logprobs[max(done, 0):])
            if sched.num_spec_tokens:
                deltas.append(self._update_speculated(sched, result, now))
                continue
            request.num_computed_tokens += sched.num_new_tokens
            tokens = result.sampled
            if not tokens:
                continue
            if len(tokens) > 1:
                deltas.extend(self._fork_children(request, tokens[1:], now))
            deltas.append(self._append_tokens(request, tokens[:1], now))
        for group_id in self._grammar_failed:
            self.abort(group_id)  # the error delta already ends it for the consumer
        self._grammar_failed.clear()
        for group_id in {d.request_id for d in deltas if d.finished}:
            self._forget_finished(group_id)
        return deltas

    def _update_speculated(self, sched: ScheduledSeq, result: SeqOutput,
                           now: float) -> SequenceDelta:
        """A verify step: the accepted proposals and the target's own token are appended
        (up to a stop), after ``SpecStep.verified`` has kept their KV."""
        request = sched.request
        assert self.spec is not None
        self.spec.verified(sched, len(result.accepted),
                           "" if request.adapter is None else _identity(request.adapter.key))
        return self._append_tokens(request, [*result.accepted, *result.sampled], now)

    def _fork_children(self, parent: Request, tokens: list[SampledToken],
                       now: float) -> list[SequenceDelta]:
        deltas = []
        for i, token in enumerate(tokens, start=1):
            child = Request(request_id=self._child_id(parent, i),
                            prompt_token_ids=parent.prompt_token_ids, params=parent.params,
                            adapter=parent.adapter, cache_salt=parent.cache_salt,
                            arrival_time=parent.arrival_time, group_id=parent.group_id, sample_index=i,
                            eos_token_ids=parent.eos_token_ids, share=parent.share)
            child.num_computed_tokens = parent.num_computed_tokens
            # The blocks it shares with its parent hold the parent's draft KV.
            child.num_draft_computed_tokens = parent.num_draft_computed_tokens
            child.prompt_logprobs = parent.prompt_logprobs  # complete, never appended to
            if parent.constraint is not None:  # the parent has not taken its own token yet
                child.constraint = parent.constraint.fork()
            child.first_scheduled_time = parent.first_scheduled_time
            self.kv.fork(parent.request_id, child.request_id)
            slot = -1 if child.adapter is None else self.adapters.acquire(child.adapter)
            self.scheduler.add_running(child, slot)
            self._groups[parent.group_id or parent.request_id].append(child)
            deltas.append(self._append_tokens(child, [token], now))
        return deltas

    def _append_tokens(self, request: Request, tokens: Sequence[SampledToken],
                       now: float) -> SequenceDelta:
        """Appends tokens in order until one ends the sequence; the rest are dropped (a
        verify step may keep tokens past a stop)."""
        new_ids: list[int] = []
        new_logprobs: list[Any] = []
        distribution = tokens[0].distribution if tokens and not request.output_token_ids \
            else None
        for token in tokens:
            if request.constraint is not None and request.constraint.error is not None:
                return self._grammar_error(request)  # its mask was meaningless: no token
            request.output_token_ids.append(token.token_id)
            new_ids.append(token.token_id)
            if request.params.logprobs is not None:
                entry = (token.logprob or 0.0, token.top_logprobs or ())
                request.output_logprobs.append(entry)
                new_logprobs.append(entry)
            if request.first_token_time is None:
                request.first_token_time = now
                request.first_token_step = self.num_steps
            status = self._check_stop(request, token.token_id)
            if request.constraint is not None and status is None:
                request.constraint.advance(token.token_id)
                if request.constraint.error is not None:  # the token cannot be followed
                    request.output_token_ids.pop()
                    if request.params.logprobs is not None:
                        request.output_logprobs.pop()
                        new_logprobs.pop()
                    new_ids.pop()
                    return self._grammar_error(request)
                if request.constraint.is_finished:  # the grammar admits nothing more
                    status, request.stop_reason = RequestStatus.FINISHED_STOPPED, None
            stop_string = self.detokenizer.update(request, final=status is not None)
            if stop_string is not None:
                status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_string
            if status is not None:
                self.scheduler.finish(request, status)
                break
        return self._delta(request, new_ids,
                           new_logprobs if request.params.logprobs is not None else None,
                           distribution if new_ids else None)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        p = request.params
        if request.num_output_tokens < p.min_tokens:
            return None  # the sampler kept EOS and stop ids out; nothing else ends it yet
        if not p.ignore_eos and token_id in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in p.stop_token_set:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= p.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _delta(self, request: Request, new_ids: list[int], new_logprobs: list[Any] | None,
               distribution: tuple[float, ...] | None = None) -> SequenceDelta:
        finished = request.status.is_finished
        metrics = None
        if finished:
            e2e = (request.finish_time or time.monotonic()) - request.arrival_time
            metrics = RequestMetrics(arrival_time=request.arrival_time,
                                     queue_time=request.queue_time, ttft=request.ttft,
                                     tpot=request.tpot, e2e=e2e,
                                     num_preemptions=request.num_preemptions,
                                     queue_steps=request.queue_steps,
                                     ttft_steps=request.ttft_steps)
            self._generators.pop(request.request_id, None)
        # The first token's delta carries the prompt's logprobs (the first prompt token
        # has none: nothing precedes it).
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and new_ids \
                and request.num_output_tokens == 1:
            prompt_logprobs = [None, *request.prompt_logprobs]
        return SequenceDelta(
            request_id=request.group_id or request.request_id, index=request.sample_index,
            new_token_ids=new_ids, text_delta=self.detokenizer.take_text_delta(request, finished),
            new_logprobs=new_logprobs, finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens, metrics=metrics,
            prompt_logprobs=prompt_logprobs, distribution=distribution)

    def _grammar_error(self, request: Request) -> SequenceDelta:
        """Ends a request whose grammar cannot be followed (an unsatisfiable schema, a
        regex the lexer cannot take, the grammar engine failing on it): an error that
        names the field, never a "stop" with text the grammar does not allow. Its
        siblings (n > 1) end with it, at this step's end."""
        assert request.constraint is not None and request.constraint.error is not None
        param = request.constraint.param
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._grammar_failed.add(request.group_id or request.request_id)
        return self._ended_in_error(
            request, f"the grammar cannot be followed: {request.constraint.error}", param)

    def _error_delta(self, request: Request, error: AdapterError) -> SequenceDelta:
        request.status = RequestStatus.FINISHED_ABORTED
        request.finish_time = time.monotonic()
        self._forget_finished(request.group_id or request.request_id)
        return self._ended_in_error(request, str(error), None, num_output_tokens=0)

    @staticmethod
    def _ended_in_error(request: Request, error: str, param: str | None,
                        num_output_tokens: int | None = None) -> SequenceDelta:
        """The last delta of a request that ended in an error (no new tokens)."""
        return SequenceDelta(
            request_id=request.group_id or request.request_id, index=request.sample_index,
            new_token_ids=[], text_delta="", new_logprobs=None, finish_reason="error",
            stop_reason=None, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=(request.num_output_tokens if num_output_tokens is None
                               else num_output_tokens), error=error, error_param=param)

    def _forget_finished(self, group_id: str) -> None:
        group = self._groups.get(group_id)
        if group is None or not all(r.status.is_finished for r in group):
            return
        # Children appear at the prompt's first sample; a group that ended before it
        # (aborted, or its adapter failed) never gets them.
        if len(group) >= group[0].params.n or group[0].status == RequestStatus.FINISHED_ABORTED:
            del self._groups[group_id]
            for r in group:
                self._generators.pop(r.request_id, None)
            self._release_deleted()

    # --- figures -----------------------------------------------------------------------

    def take_kv_events(self) -> list[list[Any]]:
        """The KV events since the last call (``kv_events.py``); none unless turned on."""
        if self.kv_events is None:
            return []
        return self.kv_events.drain(self.kv.registered_blocks)

    def resync_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.resync()

    def stats(self) -> EngineStats:
        """The engine's figures now, as replica 0 (a deployment sets its own ordinal)."""
        kv = self.kv.stats()
        ad = self.adapters.stats()
        sched = self.scheduler
        return EngineStats(
            replica=0,
            num_preemptions=kv.num_preemptions,
            num_swap_outs=sched.num_swap_outs,
            prefix_cache_queried_tokens=kv.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=kv.prefix_cache_hit_tokens,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
            kv_blocks_total=kv.num_blocks_total,
            kv_blocks_used=kv.num_blocks_used,
            kv_blocks_free=kv.num_blocks_free,
            kv_blocks_cached_free=kv.num_blocks_cached_free,
            kv_pool_usage=(kv.num_blocks_used / kv.num_blocks_total
                           if kv.num_blocks_total else 0.0),
            kv_utilization=kv.kv_utilization,
            host_blocks_total=kv.num_host_blocks_total,
            host_blocks_used=kv.num_host_blocks_used,
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_swapped=len(sched.swapped),
            num_unfinished=len(self._groups),
            num_steps=self.num_steps,
            adapter_slot_loads=ad.num_slot_loads,
            adapter_slot_evictions=ad.num_slot_evictions,
            adapter_disk_loads=ad.num_disk_loads,
            adapter_load_seconds=ad.total_load_seconds,
            max_loras=self.adapters.max_loras,
            max_cpu_loras=self.adapters.max_cpu_loras,
            adapter_slots=tuple(None if k is None else _identity(k) for k in ad.slots),
            host_adapters=tuple(_identity(k) for k in ad.host),
            pinned_adapters=tuple(_identity(k) for k in ad.held),
            running_adapters=_adapters_of(sched.running),
            waiting_adapters=_adapters_of([*sched.waiting, *sched.swapped]),
            tenants=sched.tenant_stats(),
            kv_disk_hit_tokens=kv.lower_tier_hit_tokens,
            **self.offload.stats(),
            **(self.spec.stats() if self.spec is not None else {}),
        )


def _identity(key: AdapterKey) -> str:
    """How stats spell an adapter version: short enough to read, digest enough to tell
    versions apart."""
    return f"{key[0]}@{key[1][:12]}"


def _adapters_of(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({_identity(r.adapter.key) for r in requests if r.adapter is not None}))
