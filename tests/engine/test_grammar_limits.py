"""Grammar compilation with a budget, and grammars that cannot be followed.

The specs here are the ones that took the server down: a schema that panics the grammar
engine, ones that compile for minutes or allocate until the process aborts, ones that
compile but admit no output. Each is refused (or ended) with an error naming its field,
and nothing else stops: the step loop keeps stepping other tenants' requests, measured in
their tokens (never in wall time)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from loraplex.engine.client import EngineClient
from loraplex.engine.grammar_sandbox import GrammarLimits, GrammarSandbox
from loraplex.engine.sampling_params import GrammarSpec, SamplingParams
from loraplex.errors import InvalidRequestError
from loraplex.testing import build_tiny_model

PANIC = {"type": "object", "properties": {"x": {"type": "string", "maxLength": "a" * 96 + "😀"}}}
# CPU-hungry (and, given the CPU, memory-hungry) specs from the hostile-tenant report.
COSTLY: dict[str, Callable[[], GrammarSpec]] = {
    "multipleOf": lambda: GrammarSpec.json_schema({"type": "integer",
                                                   "multipleOf": 1073741824}),
    "dot-star": lambda: GrammarSpec("regex", ".*" * 20000, "guided_regex"),
    "allOf": lambda: GrammarSpec.json_schema({"allOf": [
        {"type": "string", "pattern": f"^(.*a.*){{{i}}}$"} for i in range(1, 30)]}),
}
# Compile, but admit no output (or stop admitting any after a token).
UNFOLLOWABLE: dict[str, Callable[[], GrammarSpec]] = {
    "self-ref": lambda: GrammarSpec.json_schema({"$ref": "#"}),
    "defs-loop": lambda: GrammarSpec.json_schema({
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a"}),
    "million-a": lambda: GrammarSpec.json_schema({"type": "string",
                                                  "pattern": "^a{1000000}$"}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("grammar_limits_model"))


@pytest.fixture(scope="module")
def sandbox(model_dir: Path) -> Iterator[GrammarSandbox]:
    sandbox = GrammarSandbox((model_dir / "tokenizer.json").read_text(), 400, [2])
    yield sandbox
    sandbox.close()


def test_a_panicking_schema_is_a_refusal_naming_its_field(sandbox: GrammarSandbox) -> None:
    with pytest.raises(InvalidRequestError, match="not a char boundary") as info:
        sandbox.compile(GrammarSpec.json_schema(PANIC, "guided_json"))
    assert info.value.param == "guided_json"
    assert sandbox.compile(GrammarSpec("regex", "ab+", "guided_regex"))  # still there


@pytest.mark.parametrize("name", COSTLY)
def test_costly_specs_are_refused_at_the_cpu_limit(sandbox: GrammarSandbox, name: str) -> None:
    spec = COSTLY[name]()
    with pytest.raises(InvalidRequestError, match=r"took more than 1 s of CPU time") as info:
        sandbox.compile(spec)
    assert info.value.param == spec.param
    assert sandbox.compile(GrammarSpec("regex", "[0-9]{3}", "guided_regex"))


def test_memory_past_the_cap_stops_the_worker_only(model_dir: Path) -> None:
    """With time enough, the multipleOf schema allocates past the worker's address space:
    the worker aborts, the spec is refused naming the limit, and the next spec compiles in
    a new worker."""
    limits = GrammarLimits(cpu_s=120, memory_bytes=512 << 20)
    sandbox = GrammarSandbox((model_dir / "tokenizer.json").read_text(), 400, [2], limits)
    try:
        with pytest.raises(InvalidRequestError, match=r"512 MiB of memory") as info:
            sandbox.compile(COSTLY["multipleOf"]())
        assert info.value.param == "response_format"
        assert sandbox.compile(GrammarSpec("regex", "ab+", "guided_regex"))
        assert sandbox.num_workers_started == 2
    finally:
        sandbox.close()


_REGEX_PIECES = st.sampled_from(["a", "b", ".", ".*", "[a-z]", "(ab|c)", "\\d", "x?", "y+",
                                 "{2,5}", "{1000}", "(", ")", "|", "^", "$", "\\", "[^a]",
                                 "(?:a*)*", "é", "😀"])


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(_REGEX_PIECES, min_size=1, max_size=40),
       repeat=st.integers(min_value=1, max_value=3000))
def test_generated_regexes_compile_or_are_refused(sandbox: GrammarSandbox,
                                                  pieces: list[str], repeat: int) -> None:
    """Any regex, however built or repeated: a grammar, or a refusal naming the field.
    Each example is bounded by the sandbox's CPU limit, not by the test."""
    # At most 15,000 characters: 60,000 bytes, under the spec's own cap.
    spec = GrammarSpec("regex", ("".join(pieces) * repeat)[:15000], "guided_regex")
    try:
        assert sandbox.compile(spec)
    except InvalidRequestError as exc:
        assert exc.param == "guided_regex"


_SCHEMAS = st.recursive(
    st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"},
                     {"type": "string", "pattern": "^(a|b)*c{3,9}$"},
                     {"type": "integer", "multipleOf": 7},
                     {"type": "string", "maxLength": 50}, {"enum": ["x", "y", 3]},
                     {"$ref": "#"}, {"type": "string", "format": "date-time"}]),
    lambda inner: st.one_of(
        st.builds(lambda props: {"type": "object", "properties": props,
                                 "required": sorted(props)[:1]},
                  st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3)),
        st.builds(lambda item: {"type": "array", "items": item, "maxItems": 4}, inner),
        st.builds(lambda parts: {"anyOf": parts}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda parts: {"allOf": parts}, st.lists(inner, min_size=1, max_size=3))),
    max_leaves=12)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_SCHEMAS)
def test_generated_schemas_compile_or_are_refused(sandbox: GrammarSandbox,
                                                  schema: dict[str, object]) -> None:
    try:
        assert sandbox.compile(GrammarSpec.json_schema(schema, "guided_json"))
    except InvalidRequestError as exc:
        assert exc.param == "guided_json"


# --- through the engine ------------------------------------------------------------------


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(ModelConfig(str(model_dir)), CacheConfig(num_kv_blocks=64),
                        LoRAConfig(max_loras=2, max_lora_rank=8),
                        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))


async def _tokens(client: EngineClient, prompt: list[int], params: SamplingParams,
                  salt: str, counts: list[int]) -> None:
    async for delta in client.generate(prompt, params, cache_salt=salt):
        counts[0] += len(delta.new_token_ids)


def test_a_costly_grammar_stalls_no_other_request(model_dir: Path) -> None:
    """While tenant B's schema burns its CPU budget, tenant A's stream keeps getting
    tokens; B gets a 400-kind error naming its field; the same schema again from B is
    refused from the cache, from tenant C compiled anew (no answer crosses tenants)."""
    client = EngineClient.from_config(_config(model_dir))
    long_run = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    spec = COSTLY["allOf"]()

    async def main() -> None:
        client.start()
        # A first grammar request loads the compiler and starts its worker.
        async for _ in client.generate([5, 6], SamplingParams(
                max_tokens=2, grammar=GrammarSpec("regex", "[a-c]+", "guided_regex"))):
            pass
        counts = [0]
        stream = asyncio.create_task(_tokens(client, [5, 6, 7], long_run, "tenant-a", counts))
        while counts[0] == 0 and not stream.done():
            await asyncio.sleep(0.01)
        before = counts[0]
        with pytest.raises(InvalidRequestError, match="took more than 1 s of CPU") as info:
            async for _ in client.generate([8, 9], SamplingParams(max_tokens=5, grammar=spec),
                                           cache_salt="tenant-b"):
                pass
        assert info.value.param == "response_format"
        during = counts[0] - before
        compiler = client.engine.grammar_compiler()
        compiles = compiler.num_compiles
        with pytest.raises(InvalidRequestError, match="took more than"):
            async for _ in client.generate([8, 9], SamplingParams(max_tokens=5, grammar=spec),
                                           cache_salt="tenant-b"):
                pass
        assert compiler.num_compiles == compiles  # refused from tenant B's cache
        with pytest.raises(InvalidRequestError, match="took more than"):
            async for _ in client.generate([8, 9], SamplingParams(max_tokens=5, grammar=spec),
                                           cache_salt="tenant-c"):
                pass
        assert compiler.num_compiles == compiles + 1  # nothing of B's reaches C
        assert client.is_alive
        await stream  # A's stream ends as it would have alone
        assert counts[0] == 480
        # A full second of B's compile CPU passed with A's steps running beside it: a
        # stalled step loop would have given A no token at all.
        assert during > 0

    try:
        asyncio.run(main())
    finally:
        client.close()


@pytest.mark.parametrize(("name", "where"), [
    ("self-ref", "no output satisfies it"), ("defs-loop", "no output satisfies it"),
    # admits a first token, then nothing: ended mid-stream
    ("million-a", "the grammar cannot be followed")])
@pytest.mark.parametrize("n", [1, 2])
def test_a_grammar_that_cannot_be_followed_ends_in_an_error(model_dir: Path, name: str,
                                                            where: str, n: int) -> None:
    """Never a "stop" with output the grammar does not admit: refused at admission where
    its first mask is already empty, else an error as soon as it is, naming the field;
    every sequence of the request ended, every block free."""
    client = EngineClient.from_config(_config(model_dir))
    params = SamplingParams(temperature=0.8, seed=1, n=n, max_tokens=30,
                            grammar=UNFOLLOWABLE[name]())

    async def main() -> None:
        client.start()
        with pytest.raises(InvalidRequestError, match=where) as info:
            async for delta in client.generate([5, 6, 7], params):
                assert delta.finish_reason != "stop"
        assert info.value.param == "response_format"
        free = await client.run_in_engine(lambda e: (e.has_unfinished(),
                                                     e.kv.all_free_or_cached()))
        assert free == (False, True)
        # The engine serves on.
        last = [d async for d in client.generate([5, 6], SamplingParams(max_tokens=3))][-1]
        assert last.finish_reason in ("stop", "length")

    try:
        asyncio.run(main())
    finally:
        client.close()
