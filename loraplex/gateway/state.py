"""What every route needs, held in one object on ``app.state.gateway``."""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection

from loraplex.config import RegistryConfig, ServerConfig
from loraplex.engine.backend import EngineBackend
from loraplex.engine.grammar import GrammarCompiler
from loraplex.errors import InvalidRequestError
from loraplex.gateway.fields import check_text
from loraplex.gateway.metrics import GatewayMetrics
from loraplex.gateway.pins import PinSync
from loraplex.gateway.ratelimit import RateLimiter
from loraplex.gateway.tools import CALL_OPEN
from loraplex.gateway.usage import UsageMeter
from loraplex.registry.store import AdapterStore


class Tokenizers:
    """The gateway's own copies of the served model's tokenizer.

    The engine decodes with its tokenizer while the gateway encodes: a fast tokenizer
    shared across threads can fail with "Already borrowed", so the gateway loads its own
    from the model description's tokenizer source. Encoding (maybe a long prompt) runs in worker threads under a
    lock; per-token decoding for logprobs runs on the event loop with a second copy.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._encoder = copy.deepcopy(tokenizer)
        self._decoder = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._lock:
            return list(self._encoder.encode(text, add_special_tokens=add_special_tokens))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt, tokenized as the offline ``LLM`` does."""
        return await run_in_threadpool(self._encode, text, add_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """The chat template uses ``tools`` (Llama 3's, Qwen's do; the demo model's does
        not): tools, calls and tool results are then its to render."""
        return "tools" in str(getattr(self._encoder, "chat_template", None) or "")

    @property
    def bare_tool_calls(self) -> bool:
        """The model writes a call as Llama 3's bare JSON: its template renders ``tools``
        and names no ``<tool_call>`` block (Hermes/Qwen's format, also the fallback's)."""
        template = str(getattr(self._encoder, "chat_template", None) or "")
        return self.renders_tools and CALL_OPEN not in template

    def _render_chat(self, messages: Sequence[dict[str, Any]],
                     tools: list[dict[str, Any]] | None) -> list[int]:
        with self._lock:
            if not getattr(self._encoder, "chat_template", None):
                raise InvalidRequestError("this model has no chat template: use "
                                          "/v1/completions", param="messages")
            try:
                text = self._encoder.apply_chat_template(list(messages), tools=tools,
                                                         tokenize=False,
                                                         add_generation_prompt=True)
            except Exception as exc:  # jinja's TemplateError, or raise_exception() in it
                raise InvalidRequestError(f"the chat template refused the messages: {exc}",
                                          param="messages") from None
            check_text("messages", text)  # a lone surrogate decoded from JSON inside them
            return list(self._encoder.encode(text, add_special_tokens=False))

    async def encode_chat(self, messages: Sequence[dict[str, Any]],
                          tools: list[dict[str, Any]] | None) -> list[int]:
        """Token ids of the messages (and tools) rendered by the model's chat template,
        ready for the assistant's reply."""
        return await run_in_threadpool(self._render_chat, messages, tools)

    def _decode(self, token_ids: Sequence[int]) -> str:
        with self._lock:
            return str(self._encoder.decode(list(token_ids)))

    async def decode(self, token_ids: Sequence[int]) -> str:
        """A prompt given as token ids, as text (for ``echo``)."""
        return await run_in_threadpool(self._decode, token_ids)

    def _token_strs(self, token_ids: Sequence[int]) -> list[str]:
        with self._lock:
            return [str(t) for t in self._encoder.convert_ids_to_tokens(list(token_ids))]

    async def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each token as the tokenizer spells it (``/tokenize``'s ``token_strs``, as vLLM
        gives them), off the event loop: a long prompt has many."""
        return await run_in_threadpool(self._token_strs, token_ids)

    def token_text(self, token_id: int) -> str:
        """One token as text (event loop only)."""
        return str(self._decoder.decode([token_id]))


@dataclass
class Gateway:
    """The app's shared state; built by ``create_app``, started by its lifespan."""

    config: ServerConfig
    registry: RegistryConfig
    db_engine: Engine
    sessions: sessionmaker[Session]
    backend: EngineBackend
    store: AdapterStore
    metrics: GatewayMetrics
    meter: UsageMeter
    tokenizers: Tokenizers
    served_model_name: str
    salt_secret: bytes
    # Checks schemas that reach no engine (tools' parameters), in its sandbox's process.
    grammars: GrammarCompiler
    pins: PinSync  # applies the registry's pinned adapters to the engine
    limiter: RateLimiter | None = None  # made in the lifespan, on the serving event loop

    @property
    def max_tokens_limit(self) -> int:
        """The largest max_tokens a request may ask for: the operator's cap, else the
        model's context length."""
        return self.config.max_tokens_limit or self.backend.description.max_model_len

    @property
    def rate_limiter(self) -> RateLimiter:
        if self.limiter is None:
            raise RuntimeError("the gateway is not started (lifespan did not run)")
        return self.limiter


def gateway(conn: HTTPConnection) -> Gateway:
    """The gateway state of the app serving ``conn``."""
    state: Gateway = conn.app.state.gateway
    return state
