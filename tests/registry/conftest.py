"""Fixtures of the registry tests: every database test runs on SQLite and on PostgreSQL.

PostgreSQL is the shared database ``test``; each test session works in its own schema
(named with the process id, dropped at the end), so runs are repeatable and never touch
other modules' tables. Set LORAPLEX_TEST_POSTGRES_URL to point elsewhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from safetensors.numpy import save_file
from sqlalchemy.orm import Session, sessionmaker

from loraplex.registry import db
from loraplex.testing import postgres_schema_url, postgres_url_for_tests

POSTGRES_URL = postgres_url_for_tests()
TABLES_CHILD_FIRST = ("usage", "adapter_routes", "adapters", "api_keys", "tenants")

# A tiny Llama: adapters are validated against these shapes by the engine's loader.
HIDDEN, INTERMEDIATE, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS = 32, 64, 2, 4, 2
HEAD_DIM = HIDDEN // NUM_HEADS
MODULE_SHAPES = {  # module -> (parent, in_features, out_features)
    "q_proj": ("self_attn", HIDDEN, NUM_HEADS * HEAD_DIM),
    "k_proj": ("self_attn", HIDDEN, NUM_KV_HEADS * HEAD_DIM),
    "v_proj": ("self_attn", HIDDEN, NUM_KV_HEADS * HEAD_DIM),
    "o_proj": ("self_attn", NUM_HEADS * HEAD_DIM, HIDDEN),
    "gate_proj": ("mlp", HIDDEN, INTERMEDIATE),
    "up_proj": ("mlp", HIDDEN, INTERMEDIATE),
    "down_proj": ("mlp", INTERMEDIATE, HIDDEN),
}


def _postgres_admin() -> sa.Engine:
    engine = sa.create_engine(POSTGRES_URL)
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as exc:
        engine.dispose()
        pytest.skip(f"PostgreSQL not reachable at {POSTGRES_URL}: {exc.orig}")
    return engine


@pytest.fixture(scope="session")
def make_postgres_schema() -> Iterator[Callable[[str], str]]:
    """Creates fresh schemas on demand (name suffixed with the pid); drops them at the end."""
    admin: sa.Engine | None = None
    made: list[str] = []

    def make(label: str) -> str:
        nonlocal admin
        if admin is None:
            admin = _postgres_admin()
        schema = f"loraplex_test_registry_{label}{len(made)}_{os.getpid()}"
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        made.append(schema)
        return postgres_schema_url(schema)

    yield make
    if admin is not None:
        with admin.begin() as conn:
            for schema in made:
                conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path,
                 make_postgres_schema: Callable[[str], str]) -> str:
    """A URL of a database with nothing in it, per test."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty' / 'registry.db'}"
    return make_postgres_schema("empty")


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           make_postgres_schema: Callable[[str], str]) -> str:
    """A database migrated to head, shared by the session's tests on that backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'registry.db'}"
    else:
        url = make_postgres_schema("main")
    db.upgrade(url)
    return url


@pytest.fixture(scope="session")
def _engines() -> Iterator[dict[str, sa.Engine]]:
    engines: dict[str, sa.Engine] = {}
    yield engines
    for engine in engines.values():
        engine.dispose()


@pytest.fixture
def engine(db_url: str, _engines: dict[str, sa.Engine]) -> Iterator[sa.Engine]:
    """The migrated database's engine; every table is emptied after each test."""
    if db_url not in _engines:
        _engines[db_url] = db.make_engine(db_url)
    eng = _engines[db_url]
    yield eng
    with eng.begin() as conn:
        for table in TABLES_CHILD_FIRST:
            conn.exec_driver_sql(f"DELETE FROM {table}")


@pytest.fixture
def session_factory(engine: sa.Engine) -> sessionmaker[Session]:
    return db.make_session_factory(engine)


@pytest.fixture
def session(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session in an open transaction; tests may commit, the tables are emptied after."""
    with session_factory() as s:
        yield s
        s.rollback()


# --- adapter folders ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base model folder with only config.json: all adapter validation reads."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS, "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS, "vocab_size": 128,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    }))
    return path


def write_adapter(out: Path, *, seed: int = 0, rank: int = 4, alpha: float = 8.0,
                  modules: tuple[str, ...] = ("q_proj", "v_proj"), use_rslora: bool = False,
                  extra_config: dict[str, object] | None = None) -> Path:
    """Writes a PEFT-style LoRA folder for the tiny Llama without importing peft."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(NUM_LAYERS):
        for module in modules:
            parent, fan_in, fan_out = MODULE_SHAPES[module]
            stem = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{stem}.lora_A.weight"] = rng.standard_normal((rank, fan_in), np.float32)
            tensors[f"{stem}.lora_B.weight"] = rng.standard_normal((fan_out, rank), np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config: dict[str, object] = {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
        "target_modules": list(modules), "lora_dropout": 0.0, "bias": "none",
        "task_type": "CAUSAL_LM", "base_model_name_or_path": "tiny-llama",
    }
    config.update(extra_config or {})
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture
def make_adapter(tmp_path: Path) -> Callable[..., Path]:
    """``make_adapter(name, **kw)`` writes an adapter folder under the test's tmp dir."""

    def make(name: str = "adapter", **kwargs: object) -> Path:
        return write_adapter(tmp_path / "src" / name, **kwargs)  # type: ignore[arg-type]

    return make
