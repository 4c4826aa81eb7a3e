"""The checks a prompt must pass before any engine admits it, in one place.

Pure Python: the engine calls ``check_prompt`` at admission, and whatever sits in front of
an engine (the gateway, the offline ``LLM``) gets these errors through it, so the rules and
their wording exist once. The messages follow OpenAI's, since the gateway shows them.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import InvalidRequestError, PromptTooLongError


def check_params(params: SamplingParams, *, vocab_size: int) -> None:
    """Raises InvalidRequestError for what only the served model can rule out: token ids
    in ``logit_bias`` or ``stop_token_ids`` outside its vocabulary (ranges that need no
    model are ``SamplingParams``' own checks)."""
    for param, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                       ("stop_token_ids", list(params.stop_token_ids))):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"{param}: token ids out of range [0, {vocab_size}): "
                                      f"{bad[:5]}", param=param)


def check_prompt(prompt_token_ids: Sequence[int], max_tokens: int, *, vocab_size: int,
                 max_model_len: int) -> None:
    """Raises InvalidRequestError for an empty prompt or a token id outside the vocabulary,
    PromptTooLongError (``param="prompt"``) for a prompt that leaves no room for a single
    token, and PromptTooLongError (``param="max_tokens"``) when the prompt plus
    ``max_tokens`` is over the context length."""
    num_prompt = len(prompt_token_ids)
    if not num_prompt:
        raise InvalidRequestError("the prompt is empty once tokenized", param="prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids out of range [0, {vocab_size}): "
                                  f"{bad[:5]}", param="prompt")
    if num_prompt >= max_model_len or num_prompt + max_tokens > max_model_len:
        # vLLM's wording of OpenAI's message, so clients that parse it keep working.
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.", param="prompt" if num_prompt >= max_model_len else "max_tokens")
