"""Frozen, validated configuration dataclasses, one per subsystem.

They are built once (in ``cli.py``, ``LLM`` or ``create_app``) and passed explicitly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal

from loraplex.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]
PreemptionMode = Literal["recompute", "swap"]
SchedulingPolicy = Literal["fair", "fifo"]
# Wall time of a decode token over a prefill token's, on the demo model at a full batch
# (benchmarks/fairness.py measures it; docs/benchmarks.md has the run).
DECODE_TOKEN_COST = 3.0


def _positive(value: float) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """Which base model to load and how."""

    model: str
    dtype: DType = "float32"
    device: str | None = None  # None: cuda if available, else cpu
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        _require(self.dtype in ("float32", "bfloat16", "float16"),
                 f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len > 0,
                 "max_model_len must be positive")
        _require(-(2**63) <= self.seed < 2**64,  # torch.Generator.manual_seed's range
                 f"seed must be a 64-bit integer, got {self.seed}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit count wins over the memory budget
    kv_cache_memory: int | None = None  # bytes; None: a default fraction of free memory
    enable_prefix_caching: bool = True
    swap_space_blocks: int = 0  # host blocks for swap preemption
    # The prefix cache's disk tier (docs/engine.md): evicted blocks kept in this folder,
    # within kv_disk_gib GiB. None: off.
    kv_disk_dir: str | None = None
    kv_disk_gib: float = 4.0
    # Record what the prefix cache stores and evicts (engine/kv_events.py): the Ray
    # replicas turn it on and publish it for the gateways' prefix-aware routing.
    kv_events: bool = False

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two, got {self.block_size}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks > 0,
                 "num_kv_blocks must be positive")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0,
                 "kv_cache_memory must be positive")
        _require(self.swap_space_blocks >= 0, "swap_space_blocks must be >= 0")
        _require(self.kv_disk_gib > 0, f"kv_disk_gib must be positive, got {self.kv_disk_gib}")
        _require(self.kv_disk_dir is None or self.kv_disk_dir != "",
                 "kv_disk_dir must name a folder")
        _require(self.kv_disk_dir is None or self.enable_prefix_caching,
                 "kv_disk_dir needs prefix caching (it keeps the prefix cache's blocks)")


@dataclass(frozen=True)
class LoRAConfig:
    """Adapter slots on the device and the host-memory cache in front of disk."""

    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int = 16
    # Adapters an operator pins keep a device slot and their host copy; they take at most
    # this share of the slots (rounded down), the rest stay for the working set.
    max_pinned_fraction: float = 0.5

    def __post_init__(self) -> None:
        _require(self.max_loras >= 1, "max_loras must be >= 1")
        _require(self.max_lora_rank >= 1, "max_lora_rank must be >= 1")
        _require(self.max_cpu_loras >= self.max_loras,
                 "max_cpu_loras must be >= max_loras")
        _require(0 <= self.max_pinned_fraction < 1,
                 "max_pinned_fraction must be at least 0 and below 1 (the working set "
                 f"keeps a slot), got {self.max_pinned_fraction}")

    @property
    def max_pinned(self) -> int:
        """Device slots pinned adapters may take."""
        return int(self.max_loras * self.max_pinned_fraction)


@dataclass(frozen=True)
class SchedulerConfig:
    """What runs each step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    max_waiting: int = 1024  # admission limit; beyond it the engine reports overload
    # Between tenants (engine/fairness.py): "fair" admits the tenant with the least
    # weighted service first and preempts for one below its share; "fifo" is oldest first.
    policy: SchedulingPolicy = "fair"
    # Service per token, in the counters: a decode token costs more wall time than a
    # prefill token at our batch sizes (measured: docs/benchmarks.md, "Fairness").
    prefill_token_cost: float = 1.0
    decode_token_cost: float = DECODE_TOKEN_COST
    max_batch_wait_s: float = 30.0  # batch-class work waits at most this behind interactive
    max_fair_preemptions: int = 1  # times one request may be preempted to admit another
    max_kv_fraction: float | None = None  # a tenant's cap on the pool, unless its own

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1")
        _require(self.preemption_mode in ("recompute", "swap"),
                 f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        _require(self.max_waiting >= 1, "max_waiting must be >= 1")
        _require(self.policy in ("fair", "fifo"),
                 f"scheduling policy must be 'fair' or 'fifo', got {self.policy!r}")
        _require(_positive(self.prefill_token_cost) and _positive(self.decode_token_cost),
                 "token costs must be finite numbers > 0")
        _require(_positive(self.max_batch_wait_s), "max_batch_wait_s must be > 0")
        _require(self.max_fair_preemptions >= 0, "max_fair_preemptions must be >= 0")
        _require(self.max_kv_fraction is None or (_positive(self.max_kv_fraction)
                                                  and self.max_kv_fraction <= 1),
                 f"max_kv_fraction must be > 0 and <= 1, got {self.max_kv_fraction!r}")


SPECULATIVE_METHODS = ("ngram", "layer_skip", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's spelling where it fits.

    ``ngram``: proposals by prompt lookup: the sequence's last n tokens (n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``) matched against its own earlier
    tokens, and the tokens that followed that match proposed. Speculation is off in a step
    where at least ``disable_by_batch_size`` sequences run (a full batch already uses the
    compute that proposals would take), and paused for a sequence whose recent acceptance
    rate fell below ``min_acceptance_rate`` (it is probed again now and then).

    ``layer_skip``: the target's own first ``num_draft_layers`` layers, its final norm and
    LM head (with the request's adapter) propose greedily, one token per draft forward.
    They share the target's weights and its KV cache: the first layers' KV of accepted
    tokens is exactly what the draft computes, so it needs no cache of its own.

    ``draft_model``: a separate, smaller model (the HuggingFace folder ``model``, with the
    target's tokenizer) proposes greedily, base-only, on its own paged KV cache indexed by
    the target's block tables.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    num_draft_layers: int | None = None  # layer_skip only
    model: str | None = None  # draft_model only: the draft's folder
    # Measured cross-over on 2 quiet CPU cores (docs/benchmarks.md): about 8.
    disable_by_batch_size: int | None = 8
    min_acceptance_rate: float = 0.1

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                 f"got {self.method!r}")
        _require(isinstance(self.num_speculative_tokens, int)
                 and self.num_speculative_tokens >= 1,
                 f"num_speculative_tokens must be an integer >= 1, got "
                 f"{self.num_speculative_tokens!r}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        _require((self.method == "layer_skip") == (self.num_draft_layers is not None),
                 "num_draft_layers is required by the layer_skip method, and only by it")
        _require((self.method == "draft_model") == (self.model is not None),
                 "model (the draft's folder) is required by the draft_model method, and "
                 "only by it")
        _require(self.model is None or (isinstance(self.model, str) and bool(self.model)),
                 f"model must be a path to the draft model's folder, got {self.model!r}")
        _require(self.num_draft_layers is None or (isinstance(self.num_draft_layers, int)
                                                   and self.num_draft_layers >= 1),
                 f"num_draft_layers must be an integer >= 1, got {self.num_draft_layers!r}")
        _require(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
                 "disable_by_batch_size must be >= 1")
        _require(0.0 <= self.min_acceptance_rate <= 1.0,
                 "min_acceptance_rate must be in [0, 1]")

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> SpeculativeConfig:
        """``--speculative-config``: a JSON object (or its mapping) of this class's fields;
        anything else is refused in one line."""
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except ValueError as exc:
            raise ConfigError(f"speculative config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        _require(not unknown, f"speculative config: unknown field(s) {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise ConfigError(f"speculative config: {exc}") from None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, grouped."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        spec = self.speculative
        _require(spec is None or spec.num_speculative_tokens
                 < self.scheduler.max_num_batched_tokens,
                 "num_speculative_tokens must be below max_num_batched_tokens (a step "
                 "verifies the proposals together with the token they follow)")


# The embedded default's registry and store, inside the home.
HOME_DATABASE = "loraplex.db"
HOME_ADAPTERS = "adapters"


def default_home() -> str:
    """Where the embedded default keeps its database, adapters and models."""
    import os

    return os.environ.get("LORAPLEX_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "loraplex")


@dataclass(frozen=True)
class RegistryConfig:
    """Where tenants, keys and adapters are recorded, and where adapter files live.

    ``sweep_grace_s``: crash leftovers in the adapter store (staging folders, folders no row
    names) are removed only once older than this, and staging folders only when no live
    process holds them; it must exceed the longest pause between an upload's store rename
    and its registry commit. ``sweep_interval_s``: how often a server sweeps after its start.
    """

    database_url: str
    adapter_dir: str
    sweep_grace_s: float = 3600.0
    sweep_interval_s: float = 600.0

    def __post_init__(self) -> None:
        _require(self.sweep_grace_s >= 0, "sweep_grace_s must be >= 0")
        _require(self.sweep_interval_s > 0, "sweep_interval_s must be positive")

    @classmethod
    def default(cls) -> RegistryConfig:
        import os

        home = default_home()
        return cls(database_url=f"sqlite:///{os.path.join(home, HOME_DATABASE)}",
                   adapter_dir=os.path.join(home, HOME_ADAPTERS))


MIN_METRICS_TOKEN_LEN = 16
# The environment variables of the gateway's secrets (the static API key also as --api-key,
# as `vllm serve` takes it).
ENV_ADMIN_KEY: Final = "LORAPLEX_ADMIN_KEY"
ENV_API_KEY: Final = "LORAPLEX_API_KEY"
ENV_METRICS_TOKEN: Final = "LORAPLEX_METRICS_TOKEN"


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP gateway."""

    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None  # None: in-process rate limiter
    admin_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 1 << 20
    # Largest max_tokens a request may ask for; None: the served model's context length, as
    # vLLM bounds it.
    max_tokens_limit: int | None = None
    max_n: int = 8
    # Key of the per-tenant prefix-cache salt (HMAC-SHA256 of the tenant id). None: a random
    # secret per process, enough because the prefix cache lives in this process's memory.
    cache_salt_secret: str | None = None
    # Off: every tenant gets its own salt, so no KV block is ever shared between tenants.
    allow_cross_tenant_cache_sharing: bool = False
    rate_limit_window_s: float = 60.0
    rate_limit_key_prefix: str = "loraplex:rl:"
    usage_flush_interval_s: float = 1.0
    # Connections (gateway/connections.py): the request line and headers together at most
    # max_header_bytes and complete within header_timeout_s of the connection (or of the
    # previous response); a body that sends nothing for body_timeout_s is answered 408;
    # an idle keep-alive connection closes after keep_alive_timeout_s; at most
    # max_pending_connections may be waiting for their headers at once.
    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_pending_connections: int = 256
    # A request meets its SLO when its first token came within slo_ttft_ms and its output
    # tokens after that averaged at most slo_tpot_ms (goodput, per tenant in /metrics); a
    # tenant's own SLOs in the registry override these.
    slo_ttft_ms: int = 2000
    slo_tpot_ms: int = 200
    # A bearer token that opens /metrics (only it) besides an admin key, for a Prometheus
    # scrape config; None: admin keys only.
    metrics_token: str | None = None
    # Folders whose adapters a tenant may register by path (/v1/load_lora_adapter); empty:
    # that route is refused.
    allowed_lora_dirs: tuple[str, ...] = ()
    # An upload's answer waits this long for the new version's measured effect (its probe
    # runs on in the background and stores the effect when it ends).
    effect_probe_wait_s: float = 5.0

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        _require(self.slo_ttft_ms >= 1 and self.slo_tpot_ms >= 1, "SLOs must be >= 1 ms")
        _require(self.max_header_bytes >= 1024, "max_header_bytes must be >= 1024")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            _require(getattr(self, name) > 0, f"{name} must be positive")
        _require(self.max_pending_connections >= 1, "max_pending_connections must be >= 1")
        _require(self.max_body_bytes > 0, "max_body_bytes must be positive")
        _require(self.max_tokens_limit is None or self.max_tokens_limit >= 1,
                 "max_tokens_limit must be >= 1")
        _require(self.metrics_token is None or len(self.metrics_token) >= MIN_METRICS_TOKEN_LEN,
                 f"the metrics token (LORAPLEX_METRICS_TOKEN) must be at least "
                 f"{MIN_METRICS_TOKEN_LEN} characters")
        _require(self.max_n >= 1, "max_n must be >= 1")
        _require(self.rate_limit_window_s > 0, "rate_limit_window_s must be positive")
        _require(self.usage_flush_interval_s > 0, "usage_flush_interval_s must be positive")
        _require(self.effect_probe_wait_s >= 0, "effect_probe_wait_s must be >= 0")


@dataclass(frozen=True)
class RayConfig:
    """Engine replicas on Ray Serve (``loraplex serve --backend ray``).

    ``address``: a running cluster (``ray://`` or ``host:port``); None starts a local one on
    loopback. ``max_queued_requests``: requests each gateway holds for busy replicas before
    answering 503; ``delta_window_s``: how long a replica gathers a stream's new tokens into
    one message (each message costs replica CPU).
    """

    address: str | None = None
    replicas: int = 1
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    app_name: str = "loraplex"
    max_queued_requests: int = 256
    delta_window_s: float = 0.015
    # Object store of a local cluster: only control messages cross it.
    object_store_memory: int = 256 << 20
    sync_key_prefix: str = "loraplex:replicas:"
    # Off: adapter requests get Serve's plain load balancing too (to measure what affinity
    # gains; every replica then ends up loading every adapter).
    adapter_affinity: bool = True
    # Route to the replica that caches the longest prefix of the request for its adapter
    # and tenant (engine/prefix_routing.py); off: adapter affinity and load only.
    prefix_routing: bool = True
    # Prefill/decode disaggregation (engine/kv_transfer.py): this many prefill replicas
    # besides the ``replicas`` that decode; 0: every replica does both.
    prefill_replicas: int = 0

    def __post_init__(self) -> None:
        _require(self.replicas >= 1, "replicas must be >= 1")
        _require(self.prefill_replicas >= 0, "prefill_replicas must be >= 0")
        _require(self.replica_cpus > 0, "replica_cpus must be positive")
        _require(self.replica_gpus >= 0, "replica_gpus must be >= 0")
        _require(self.max_queued_requests >= 1, "max_queued_requests must be >= 1")
        _require(0 <= self.delta_window_s <= 1, "delta_window_s must be in [0, 1] seconds")
        _require(bool(self.app_name) and self.app_name.isidentifier(),
                 "app_name must be an identifier")


def check_shared_state(server: ServerConfig, registry: RegistryConfig) -> None:
    """Refuses what cannot be shared by several gateways in front of the same replicas: a
    per-process salt secret (tenants' prefix-cache salts would differ between gateways),
    SQLite, and the in-process rate limiter. One line each."""
    _require(server.cache_salt_secret is not None,
             "the ray backend needs LORAPLEX_CACHE_SALT_SECRET: every gateway must derive "
             "the same prefix-cache salts")
    _require(not registry.database_url.startswith("sqlite"),
             "the ray backend needs a shared registry database (PostgreSQL), not SQLite")
    _require(server.redis_url is not None,
             "the ray backend needs Redis (--redis-url or LORAPLEX_REDIS_URL): rate limits "
             "and replica state are shared through it")
