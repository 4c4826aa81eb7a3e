"""The engine's incremental detokenizer against the tokenizer decoding the whole output at
once (the oracle), on a locally trained byte-level BPE: random outputs token by token,
partial UTF-8 characters, special tokens, stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from loraplex.engine.detokenizer import Detokenizer
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def _run(detok: Detokenizer, ids: list[int], params: SamplingParams,
         ) -> tuple[Request, list[str], str | None, list[int]]:
    """Feeds `ids` one token at a time, the last one final, as the engine does; returns the
    request, the streamed deltas, the stop string that ended it and, per token, how many
    tokens the next update would decode (its window)."""
    request = Request("r", [1], params)
    deltas: list[str] = []
    windows: list[int] = []
    stop = None
    for i, token in enumerate(ids):
        request.output_token_ids.append(token)
        final = i == len(ids) - 1
        stop = detok.update(request, final=final)
        deltas.append(Detokenizer.take_text_delta(request, final or stop is not None))
        windows.append(len(ids[:i + 1]) - request.detok_prefix_offset)
        if stop is not None:
            break
    return request, deltas, stop, windows


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip_special=st.booleans())
def test_incremental_text_is_the_whole_decode(tokenizer: Any, data: st.DataObject,
                                              skip_special: bool) -> None:
    """Any output, special tokens and byte tokens that end mid-character included: the
    final text is the whole output decoded at once, the streamed deltas add up to it, and
    an update decodes a window of a few tokens, not the whole output (it grows only over
    tokens that add no text yet: a character's first bytes, a skipped special token)."""
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=60))
    params = SamplingParams(skip_special_tokens=skip_special)
    request, deltas, _, windows = _run(Detokenizer(tokenizer), ids, params)
    whole = tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert request.output_text == whole
    assert "".join(deltas) == whole
    assert request.detok_prefix_offset >= 0  # never fell back to decoding everything
    # where every token adds ASCII text (none ends mid-character or decodes to nothing),
    # the window is the last two tokens at most
    if all(tokenizer.decode([i], skip_special_tokens=skip_special).isascii()
           and tokenizer.decode([i], skip_special_tokens=skip_special) for i in ids):
        assert max(windows) <= 2


def test_partial_characters_wait_for_their_last_byte(tokenizer: Any) -> None:
    """A character split over tokens is sent once whole, never as U+FFFD."""
    text = "naïve 日本語 façade"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some token ends mid-character
    request, deltas, _, _ = _run(Detokenizer(tokenizer), ids, SamplingParams())
    assert request.output_text == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_incremental_text(tokenizer: Any, include: bool) -> None:
    """A stop string found in the growing text ends it there, as in the whole decode."""
    ids = tokenizer.encode("hello world, the end is near", add_special_tokens=False)
    params = SamplingParams(stop=["end"], include_stop_str_in_output=include)
    request, deltas, stop, _ = _run(Detokenizer(tokenizer), ids, params)
    assert stop == "end"
    expected = "hello world, the end" if include else "hello world, the "
    assert request.output_text == expected
    assert "".join(deltas) == expected


def test_a_decoder_that_rewrites_across_the_cut_falls_back_to_the_whole_output(
        tiny_llama_dir: Path) -> None:
    """With the tokenizer's clean-up of spaces (" ." becomes "."), a window's text need
    not extend its context's: the sequence then decodes its whole output, and its text is
    still the whole decode. (What was streamed before such a rewrite stays sent: no
    decoder of the text so far could take it back.)"""
    tok = AutoTokenizer.from_pretrained(
        str(tiny_llama_dir), clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    ids = [i for part in ("a b", " ", ".", " c")
           for i in tok.encode(part, add_special_tokens=False)]
    whole = tok.decode(ids)
    assert " ." not in whole  # the clean-up applies to this output
    request, _, _, _ = _run(Detokenizer(tok), ids, SamplingParams())
    assert request.detok_prefix_offset == -1
    assert request.output_text == whole
