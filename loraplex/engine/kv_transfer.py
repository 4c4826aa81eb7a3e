"""A prompt's KV moving between engines: prefill/decode disaggregation.

A prefill engine computes a prompt, then ``export_prompt`` gives the full blocks its prefix
cache holds for it (under the request's adapter version and tenant salt), in the portable
form (``kv_blocks.py``). A decode engine verifies them (``verified``) and places them
(``place``) in its own pool as cached blocks (ref count 0, registered under their identity); the
request then runs there as any other: its prefix lookup finds them, checked as every pool
hit is, and only the prompt's tail (the partial last block and the last token) is
computed. The decode engine samples the first token itself, from the request's own seed,
so its output is the single-engine output, whatever the prefill engine sampled.

Import takes a block only if it is this request's: well formed, checksummed, of this
model (fingerprint and layout), its hash made by its parent, tokens and extra keys, and
those equal to the request's own prompt tokens, chain and extra keys. The chain stops at
the first block refused (later blocks need it); the request recomputes from there.

Pure Python (no torch): the engine's runner reads and writes the block data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loraplex.engine.kv_blocks import (
    BlockIdentity,
    BlockRefused,
    KVLayout,
    PortableBlock,
    decode_block,
    encode_block,
)
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.kv_hashing import ExtraKey, prefix_chain
from loraplex.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TransferStats:
    num_exported: int  # blocks handed out by export_prompt
    num_imported: int  # blocks placed in the pool (not those it held already)
    num_refused: int  # blocks refused (see the module docstring), never used


def needs_prefill(num_prompt_tokens: int, params: SamplingParams, block_size: int) -> bool:
    """Whether a prefill engine has anything to hand over: at least one full block before
    the last prompt token, and a request that reads cached blocks at all (one asking for
    prompt logprobs computes its whole prompt where it decodes)."""
    return params.prompt_logprobs is None and (num_prompt_tokens - 1) // block_size > 0


def prefill_params() -> SamplingParams:
    """What the prefill engine runs a prompt with: one greedy token, which nobody reads
    (the decode engine samples the first token itself)."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class KVTransfer:
    """One engine's side of the transfers: counts, and the model identity both sides must
    share (``fingerprint``, ``layout``)."""

    def __init__(self, kv: KVCacheManager, layout: KVLayout, fingerprint: str) -> None:
        self.kv = kv
        self.layout = layout
        self.fingerprint = fingerprint
        self._num_exported = self._num_imported = self._num_refused = 0

    def export_prompt(self, token_ids: Sequence[int], extra_keys: tuple[ExtraKey, ...],
                      read_blocks: Callable[[Sequence[int]], list[bytes]]) -> list[bytes]:
        """The portable bytes of the cached blocks holding the prompt's longest prefix."""
        run = self.kv.cached_run(token_ids, extra_keys)
        data = read_blocks([block_id for block_id, _ in run])
        out = []
        for (block_id, block_hash), raw in zip(run, data, strict=True):
            out.append(encode_block(PortableBlock(BlockIdentity(block_hash,
                                                                *self.kv.block_key(block_id)),
                                                  self.fingerprint, self.layout, raw)))
        self._num_exported += len(out)
        return out

    def verified(self, raws: Sequence[bytes], token_ids: Sequence[int],
                 extra_keys: tuple[ExtraKey, ...]) -> list[PortableBlock]:
        """The leading blocks of ``raws`` that this request may use (module docstring)."""
        blocks: list[PortableBlock] = []
        # The request's own chain: a block's hash is checked against the parent, tokens
        # and keys it carries (decode_block), and here against the request's.
        wanted = prefix_chain(token_ids, self.kv.block_size, extra_keys)
        for raw, (block_hash, _) in zip(raws, wanted, strict=False):  # extras: refused
            try:
                block = decode_block(raw, self.fingerprint, self.layout)
            except BlockRefused:
                break
            if block.identity.block_hash != block_hash:
                break
            blocks.append(block)
        self._num_refused += len(raws) - len(blocks)
        return blocks

    def place(self, blocks: Sequence[PortableBlock]) -> list[tuple[int, bytes]]:
        """Registers verified blocks in the pool: ``(block id, data)`` the caller writes
        (after saving the evictions this made)."""
        placed = self.kv.import_cached([(b.identity.block_hash, b.identity.key)
                                        for b in blocks])
        self._num_imported += len(placed)
        return [(block_id, blocks[index].data) for block_id, index in placed]

    def stats(self) -> TransferStats:
        return TransferStats(self._num_exported, self._num_imported, self._num_refused)
