"""Builders of tiny random models and adapters, for tests and benchmarks (no hub needed)."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "loraplex serves many adapters from one resident base model",
    "hello world, how are you today? i am fine, thank you",
    "paged attention keeps keys and values in fixed size blocks",
    "tenants upload low rank adapters and call them by name",
    "0123456789 + - * / = ( ) [ ] { } < > : ; , . ! ?",
    "The Quick Brown Fox Jumps Over The Lazy Dog",
]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: str | Path, vocab_size: int = 384) -> Any:
    """Trains a small byte-level BPE locally and saves it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


# Each family's special features switched on in its tiny model: windows shorter than the
# tests' prompts, soft-capping strong enough to bend the scores, q/k norms, partial and
# scaled rotations, NoPE layers, the multipliers.
FAMILY_FEATURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "mistral-window": {"sliding_window": 11},
    "qwen2": {},
    "qwen3": {"use_sliding_window": True, "sliding_window": 9, "layer_types": ["full_attention", "sliding_attention",
                                                   "full_attention"]},
    "gemma2": {"sliding_window": 7, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 3.0,
               "final_logit_softcapping": 4.0,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "gemma3_text": {"sliding_window": 6, "query_pre_attn_scalar": 20,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                    "rope_parameters": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 1000000.0}}},
    "phi3": {"original_max_position_embeddings": 256,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5,
                                 "short_factor": [1.0, 1.3, 2.1, 3.4],
                                 "long_factor": [1.5, 2.0, 4.0, 8.0]}},
    "smollm3": {"no_rope_layers": [1, 0, 1]},
    "olmo2": {},
    "granite": {"embedding_multiplier": 3.0, "attention_multiplier": 0.2,
                "residual_multiplier": 0.6, "logits_scaling": 2.5},
}


def _family_classes(model_type: str) -> tuple[Any, Any]:
    import transformers as t

    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM),
        "mistral": (t.MistralConfig, t.MistralForCausalLM),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM),
        "gemma3_text": (t.Gemma3TextConfig, t.Gemma3ForCausalLM),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM),
        "smollm3": (t.SmolLM3Config, t.SmolLM3ForCausalLM),
        "olmo2": (t.Olmo2Config, t.Olmo2ForCausalLM),
        "granite": (t.GraniteConfig, t.GraniteForCausalLM),
    }[model_type]


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    shard_size: str | None = None,
    tokenizer_vocab_size: int = 384,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Saves a random model of a supported family plus a locally trained tokenizer.

    ``arch``: a key of ``FAMILY_FEATURES`` (a model type, or "mistral-window"): the family's
    special features are switched on (its ``layer_types`` imply the layer count);
    ``config_overrides`` replaces any config field."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, tokenizer_vocab_size)
    if arch not in FAMILY_FEATURES:
        raise ValueError(f"unknown arch {arch!r}")
    features = {**FAMILY_FEATURES[arch], **(config_overrides or {})}
    num_layers = len(features.get("layer_types") or features.get("no_rope_layers")
                     or [None] * num_layers)
    common: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-6,
    )
    common.update(features)
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    model_type = arch.split("-")[0]
    config_cls, model_cls = _family_classes(model_type)
    config = config_cls(**common)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # Gemma's norms multiply by (1 + weight): theirs start near 0, the others' near 1
    norm_base = 0.0 if model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial but well scaled
                p.copy_(norm_base + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:  # biases
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.shape[0] == hidden_size
                        else 0.1 * torch.randn_like(p))
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard_size is not None:
        kwargs["max_shard_size"] = shard_size
    model.save_pretrained(str(out), **kwargs)
    return out


def build_adapter(
    out_dir: str | Path,
    base_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: Sequence[str] | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    weight_scale: float = 0.5,
) -> Path:
    """Saves a PEFT LoRA adapter with random non-zero A and B for the model in base_dir;
    ``target_modules`` None: every linear module of the model's family."""
    import peft
    import transformers

    from loraplex.model.families import lora_modules

    if target_modules is None:
        model_type = json.loads((Path(base_dir) / "config.json").read_text())["model_type"]
        target_modules = list(lora_modules(model_type))

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir),
                                                              dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha,  # type: ignore[arg-type]
                          target_modules=list(target_modules), use_rslora=use_rslora,
                          init_lora_weights=False, lora_dropout=0.0)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * weight_scale / (p.shape[-1] ** 0.5))
    out = Path(out_dir)
    pm.save_pretrained(str(out), safe_serialization=True)
    cfg_path = out / "adapter_config.json"
    data = json.loads(cfg_path.read_text())
    data["base_model_name_or_path"] = str(base_dir)
    cfg_path.write_text(json.dumps(data, indent=2))
    return out


def load_reference(base_dir: str | Path, adapter_dir: str | Path | None = None) -> Any:
    """The oracle: HF transformers (+ PEFT when an adapter is given), float32, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir),
                                                              dtype=torch.float32)
    if adapter_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter_dir))  # type: ignore[assignment]
    return model.eval()


@torch.no_grad()
def reference_greedy(model: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                     adapter_names: Sequence[str] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy token ids (EOS ignored) and the first step's logits [vocab], by the oracle.

    The oracle's own KV cache carries the sequence from step to step.
    """
    kwargs: dict[str, Any] = {"use_cache": True}
    if adapter_names is not None:
        kwargs["adapter_names"] = list(adapter_names)
    result = model(input_ids=torch.tensor([list(prompt_ids)]), **kwargs)
    first_logits = result.logits[0, -1].clone()
    out: list[int] = []
    for step in range(max_new_tokens):
        token = int(result.logits[0, -1].argmax())
        out.append(token)
        if step + 1 < max_new_tokens:
            result = model(input_ids=torch.tensor([[token]]),
                           cache=result.cache, **kwargs)
    return out, first_logits


def reference_processed_logits(logits: torch.Tensor, prompt_ids: Sequence[int],
                               output_ids: Sequence[int], *, presence: float = 0.0,
                               frequency: float = 0.0, repetition: float = 1.0,
                               logit_bias: Sequence[tuple[int, float]] = (),
                               banned_ids: Sequence[int] = ()) -> torch.Tensor:
    """The oracle of the sampler's logit processing, one row ``[vocab]`` at a time, token by
    token from the definitions (float64): min_tokens bans and OpenAI's ``logit_bias``, then
    vLLM's repetition penalty over prompt and output tokens, then OpenAI's frequency and
    presence penalties over output tokens."""
    out = logits.double().clone()
    for token_id, bias in logit_bias:
        out[token_id] += bias
    for token_id in banned_ids:
        out[token_id] = float("-inf")
    for token_id in set(prompt_ids) | set(output_ids):
        value = float(out[token_id])
        out[token_id] = value / repetition if value > 0 else value * repetition
    for token_id in set(output_ids):
        count = list(output_ids).count(token_id)
        out[token_id] -= frequency * count + presence
    return out


def reference_greedy_processed(model: Any, prompt_ids: Sequence[int], max_new_tokens: int,
                               **processing: Any) -> list[int]:
    """Greedy token ids (EOS ignored) by the oracle model, each step's logits processed by
    ``reference_processed_logits`` with ``processing``."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([[*prompt_ids, *out]])).logits[0, -1]
            out.append(int(reference_processed_logits(logits, prompt_ids, out,
                                                      **processing).argmax()))
    return out


TEST_REDIS_URL_ENV = "LORAPLEX_TEST_REDIS_URL"


def redis_url_for_tests() -> str:
    """The real Redis the tests use (``LORAPLEX_TEST_REDIS_URL``, else the local one)."""
    import os

    return os.environ.get(TEST_REDIS_URL_ENV, "redis://127.0.0.1:6379/0")


@contextmanager
def redis_key_prefix(label: str) -> Iterator[str]:
    """A fresh key prefix in the test Redis; every key under it is deleted on exit.

    Fails (never skips) when Redis is not reachable: the limits are tested against it.
    """
    import uuid

    import pytest
    import redis

    url = redis_url_for_tests()
    prefix = f"loraplex:test:{label}:{uuid.uuid4().hex}:"
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.ConnectionError as exc:
        client.close()
        pytest.fail(f"these tests need a real Redis at {url}: {exc}")
    try:
        yield prefix
    finally:
        keys = list(client.scan_iter(match=f"{prefix}*"))
        if keys:
            client.delete(*keys)
        client.close()


def postgres_url_for_tests() -> str:
    """The real PostgreSQL the tests use (``LORAPLEX_TEST_POSTGRES_URL``, else the local one)."""
    import os

    return os.environ.get("LORAPLEX_TEST_POSTGRES_URL",
                          "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def postgres_schema_url(schema: str) -> str:
    """The test database URL with ``schema`` first on the search path."""
    url = postgres_url_for_tests()
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}"


@contextmanager
def postgres_schema(label: str) -> Iterator[str]:
    """A fresh schema in the test PostgreSQL (named with the pid), as a URL that puts it
    first on the search path; dropped on exit.

    Fails (never skips) when PostgreSQL is not reachable: storage is tested against it.
    """
    import os

    import pytest
    import sqlalchemy as sa

    url = postgres_url_for_tests()
    admin = sa.create_engine(url)
    schema = f"loraplex_test_{label}_{os.getpid()}"
    try:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    except sa.exc.OperationalError as exc:
        admin.dispose()
        pytest.fail(f"these tests need PostgreSQL at {url}: {exc.orig}")
    try:
        yield postgres_schema_url(schema)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()


def bootstrap_admin(database_url: str, tenant: str = "ops") -> str:
    """Migrates a registry, creates ``tenant`` with an admin key, and returns the key."""
    from loraplex.registry import db, service

    db.upgrade(database_url)
    engine = db.make_engine(database_url)
    try:
        with db.transaction(db.make_session_factory(engine)) as session:
            row = service.create_tenant(session, tenant)
            _, admin_key = service.create_key(session, row.id, role="admin")
    finally:
        engine.dispose()
    return admin_key


def chi_square_fits(counts: Sequence[int], probs: Sequence[float], p_value: float = 0.001,
                    min_expected: float = 5.0) -> tuple[bool, float, float]:
    """Pearson's goodness-of-fit test of observed ``counts`` against ``probs``: whether the
    fit holds at ``p_value``, the statistic, and its critical value.

    Cells expected fewer than ``min_expected`` times are pooled into one (the chi-square
    approximation needs it); a cell of probability 0 that was observed fails outright. The
    critical value is the Wilson-Hilferty approximation of the chi-square quantile (within
    1% from 3 degrees of freedom on), so no scipy is needed.
    """
    from statistics import NormalDist

    total = sum(counts)
    if any(c and p == 0.0 for c, p in zip(counts, probs, strict=True)):
        return False, math.inf, 0.0
    cells: list[tuple[float, float]] = []
    pooled = [0.0, 0.0]
    for c, p in zip(counts, probs, strict=True):
        if p * total >= min_expected:
            cells.append((c, p * total))
        else:
            pooled[0] += c
            pooled[1] += p * total
    if pooled[1] > 0:
        cells.append((pooled[0], pooled[1]))
    statistic = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    z = NormalDist().inv_cdf(1 - p_value)
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic < critical, statistic, critical


def process_descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc): what a ``ray start --block`` head
    started, for its owner to stop them all (some of its agents outlive it otherwise)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def runner_logits(runner: Any, batch: Any) -> torch.Tensor:
    """One forward of ``runner`` (a ``ModelRunner``) over ``batch``: the logits of each
    sampling sequence's last token, in the batch's order, for comparison with an oracle."""
    hidden, starts = runner._hidden(batch)
    return runner._last_logits(batch, hidden, starts)
