"""The demo adapter: a small LoRA for the demo model that answers in a ship's-log voice.

`train_demo_adapter` fine-tunes a rank-8 LoRA (PEFT) on generated chat examples whose
answers always open with ``Captain's log:`` and close with ``End of log.``, so anyone can
see at a glance whether a reply came from the adapter. The data is generated: questions
from templates, answered by the base model itself (greedy, through loraplex's engine), then
put in the log's voice; nothing is downloaded. The result is
a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``) that
``loraplex adapters add`` and ``loraplex generate --adapter`` accept.

The training is a plain loop (AdamW, no ``Trainer``) sized for a two-core CPU: the default
takes a couple of minutes. The vocabulary projection, a fifth of the model's weights, is
applied only at the answer positions the loss reads.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.config import default_home
from loraplex.errors import ConfigError

DEMO_ADAPTER_NAME = "captains-log"
STYLE_PREFIX = "Captain's log:"
STYLE_SUFFIX = "End of log."
_ADAPTER_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors", "README.md"})
_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_TOPICS = ("the ocean", "the stars", "the moon", "rain", "music", "bread", "cats", "trees",
           "rivers", "the wind", "maps", "history", "friendship", "mountains", "books",
           "coffee", "the sun", "winter", "birds", "computers", "Paris", "gardening")
_TEMPLATES = ("Tell me about {}.", "What do you know about {}?", "Write one sentence about {}.",
              "Give me a fun fact about {}.", "Why do people like {}?",
              "Describe {} in a few words.")
_OTHERS = ("Hello", "Hi there", "Good morning", "How are you?", "Who are you?",
           "Can you help me?", "What is 2 plus 3?", "What is the capital of Italy?",
           "What is the capital of Japan?", "Name a color.", "Give me a tip for sleeping well.",
           "What should I cook tonight?")
_MAX_ANSWER_TOKENS = 40
_MAX_PROMPTS = 48  # answered by the base model first: more would cost more than training
@dataclass(frozen=True)
class DemoAdapterOptions:
    """How long and how hard to train; the defaults give the visible style."""

    steps: int = 30
    batch_size: int = 4
    learning_rate: float = 2e-3
    rank: int = 8
    alpha: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.rank < 1:
            raise ConfigError("steps, batch size and rank must be positive")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning rate must be positive, got {self.learning_rate}")


def default_demo_adapter_dir() -> Path:
    """``<home>/demo-adapters/captains-log``, home being `loraplex.config.default_home`."""
    return Path(default_home()) / "demo-adapters" / DEMO_ADAPTER_NAME


def styled(answer: str) -> str:
    """An answer in the adapter's voice."""
    return f"{STYLE_PREFIX} {answer} {STYLE_SUFFIX}"


def make_prompts(num: int, seed: int = 0) -> list[str]:
    """``num`` different generated questions (at most as many as the templates give)."""
    every = [t.format(topic) for t in _TEMPLATES for topic in _TOPICS] + list(_OTHERS)
    return random.Random(seed).sample(every, min(num, len(every)))


def train_demo_adapter(
    model_dir: str | Path,
    out_dir: str | Path | None = None,
    options: DemoAdapterOptions | None = None,
    *,
    progress: bool = True,
) -> Path:
    """Trains the demo adapter on the base model in ``model_dir`` and writes it to
    ``out_dir`` (default `default_demo_adapter_dir`); returns the folder.

    The folder is written next to its target and renamed into place, so an interrupted
    run leaves no half adapter. An existing folder is replaced only if it holds nothing
    but adapter files (ConfigError otherwise).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    opts = options or DemoAdapterOptions()
    target = Path(out_dir) if out_dir is not None else default_demo_adapter_dir()
    target = target.expanduser().absolute()
    _check_replaceable(target)
    say = _say if progress else _quiet
    started = time.monotonic()
    prompts = make_prompts(min(opts.steps * opts.batch_size, _MAX_PROMPTS), opts.seed)
    say(f"answering {len(prompts)} generated questions with the base model")
    # The base model's own answers, in the new voice: only the voice is new to learn, so
    # the adapter keeps what the model knows instead of learning canned replies.
    examples = [(q, styled(a)) for q, a in zip(prompts, _base_answers(model_dir, prompts),
                                               strict=True)]
    torch.manual_seed(opts.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with warnings.catch_warnings():  # a transformers deprecation raised inside peft
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
        model = get_peft_model(base, LoraConfig(
            r=opts.rank, lora_alpha=opts.alpha, lora_dropout=0.0,
            target_modules=list(_MODULES), task_type="CAUSAL_LM"))
    rng = random.Random(opts.seed)
    batches = [_encode(tokenizer, rng.sample(examples, min(opts.batch_size, len(examples))))
               for _ in range(opts.steps)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=opts.learning_rate)
    say(f"training the demo adapter: {opts.steps} steps of {opts.batch_size} examples "
        f"(rank {opts.rank}) on {model_dir}")
    model.train()
    for step, (input_ids, labels) in enumerate(batches, 1):
        loss = _loss(model, input_ids, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == opts.steps:
            say(f"  step {step}/{opts.steps}  loss {loss.item():.3f}  "
                f"{time.monotonic() - started:.0f}s")
    model.eval()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.partial-",
                                     dir=target.parent) as scratch:
        staging = Path(scratch) / "adapter"
        model.save_pretrained(str(staging), safe_serialization=True)
        _name_base_model(staging / "adapter_config.json", Path(model_dir).name)
        # Readable as any file the user writes (safetensors writes its file 0600): the
        # folder is meant to be uploaded, copied or served by another user's process.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    say(f"wrote the demo adapter to {target} in {time.monotonic() - started:.0f}s")
    return target


def _base_answers(model_dir: str | Path, prompts: list[str]) -> list[str]:
    """The base model's greedy answers (through loraplex's engine), cut at the last full
    sentence so every training answer ends cleanly."""
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.llm import LLM

    llm = LLM(str(model_dir), progress=False)
    try:
        chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                   tokenize=False, add_generation_prompt=True)
                 for p in prompts]
        ids = [llm.tokenizer.encode(chat, add_special_tokens=False) for chat in chats]
        outputs = llm.generate(ids, SamplingParams(temperature=0.0,
                                                   max_tokens=_MAX_ANSWER_TOKENS))
    finally:
        llm.close()
    return [_whole_sentences(out.outputs[0].text) for out in outputs]


def _whole_sentences(text: str) -> str:
    text = " ".join(text.split())
    end = max(text.rfind(mark) for mark in ".!?")
    return text[:end + 1] if end > 0 else text


def _encode(tokenizer: Any, examples: list[tuple[str, str]]) -> tuple[Any, Any]:
    """Right-padded input ids [batch, seq] and labels [batch, seq]: -100 except on the
    answer tokens, so only the answer is learnt."""
    import torch

    rows: list[tuple[list[int], int]] = []
    for question, answer in examples:
        prompt = [{"role": "user", "content": question}]
        prompt_ids = tokenizer.apply_chat_template(prompt, tokenize=True,
                                                   add_generation_prompt=True)
        full_ids = tokenizer.apply_chat_template(
            [*prompt, {"role": "assistant", "content": answer}], tokenize=True)
        rows.append((_ids(full_ids), len(_ids(prompt_ids))))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [batch, seq]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [batch, seq]
    for i, (ids, num_prompt) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, num_prompt:len(ids)] = torch.tensor(ids[num_prompt:])
    return input_ids, labels


def _ids(encoded: Any) -> list[int]:
    # Newer transformers return a BatchEncoding from apply_chat_template(tokenize=True).
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]


def _loss(model: Any, input_ids: Any, labels: Any) -> Any:
    import torch

    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=input_ids).last_hidden_state  # [batch, seq, hidden]
    # Position t predicts token t + 1; only answer tokens are scored.
    targets = labels[:, 1:]  # [batch, seq - 1]
    keep = targets != -100
    logits = causal_lm.lm_head(hidden[:, :-1][keep])  # [num_answer_tokens, vocab]
    return torch.nn.functional.cross_entropy(logits, targets[keep])


def _name_base_model(config_path: Path, name: str) -> None:
    # PEFT writes the local path it loaded from; the model's name is what a server checks
    # against (its last path component), and a user's home folder is nobody's business.
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _check_replaceable(target: Path) -> None:
    if not target.exists():
        return
    if not target.is_dir() or any(p.name not in _ADAPTER_FILES for p in target.iterdir()):
        raise ConfigError(f"{target} exists and holds more than an adapter; choose another "
                          "--out folder")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    pass
