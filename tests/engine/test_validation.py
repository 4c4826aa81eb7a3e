from __future__ import annotations

import pytest

from loraplex.engine.validation import check_prompt
from loraplex.errors import InvalidRequestError, PromptTooLongError

LIMITS = {"vocab_size": 100, "max_model_len": 10}


def test_a_prompt_that_fits_passes() -> None:
    check_prompt([1, 2, 3], 7, **LIMITS)  # exactly the context length


@pytest.mark.parametrize(("prompt", "max_tokens", "error", "param", "words"), [
    ([], 1, InvalidRequestError, "prompt", "empty"),
    ([1, 100], 1, InvalidRequestError, "prompt", "out of range [0, 100): [100]"),
    ([-1], 1, InvalidRequestError, "prompt", "out of range"),
    ([1] * 10, 1, PromptTooLongError, "prompt",
     "maximum context length is 10 tokens. However, you requested 11 tokens (10 in the "
     "messages, 1 in the completion)"),
    ([1] * 4, 7, PromptTooLongError, "max_tokens",
     "requested 11 tokens (4 in the messages, 7 in the completion)"),
])
def test_what_is_refused_names_its_param(prompt: list[int], max_tokens: int,
                                         error: type[Exception], param: str,
                                         words: str) -> None:
    with pytest.raises(error) as caught:
        check_prompt(prompt, max_tokens, **LIMITS)
    assert isinstance(caught.value, InvalidRequestError) and caught.value.param == param
    assert words in str(caught.value)
