"""The front end's check that a request can run, before it is sent to the engine core.

The same rules as ``EngineCore.validate`` (which the core still applies on arrival, when
the pool may have shrunk), from the ``EngineInfo`` the core sent at start-up, so the
front end answers 400 at once without a round trip. On top of them, the bounds that
depend on the model: ``top_k``, ``logprobs`` and stop token ids by the vocabulary, and
``min_tokens`` by the room the context leaves.
"""

from __future__ import annotations

import math

from pagewarden.engine.core import RequestRejected
from pagewarden.engine.core_proc import EngineInfo
from pagewarden.sampling_params import SamplingParams, SamplingParamsError


def check_request(info: EngineInfo, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """Raise ``RequestRejected`` (with the parameter's name) if the request can never run."""
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestRejected("the prompt is empty; give at least one token", "prompt")
    vocab = info.vocab_size
    if any(
        isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        for t in prompt_token_ids
    ):
        raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})", "prompt")
    try:
        params.check_vocab(vocab)
    except SamplingParamsError as exc:
        raise RequestRejected(str(exc), exc.param) from None
    room = info.max_model_len - n
    if room < 1:
        raise RequestRejected(
            f"the prompt has {n} tokens; this model's context is {info.max_model_len} "
            "tokens, which leaves no room for output",
            "prompt",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if max_tokens > room:
        raise RequestRejected(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
            f"the context length {info.max_model_len}; lower max_tokens",
            "max_tokens",
        )
    if params.min_tokens > max_tokens:
        raise RequestRejected(
            f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this "
            "request can generate",
            "min_tokens",
        )
    blocks = math.ceil((n + max_tokens) / info.block_size)
    usable = info.num_blocks - 1  # block 0 is reserved
    if blocks > usable:
        raise RequestRejected(
            f"the request needs up to {blocks} KV blocks but the pool has {usable}; "
            "raise kv_cache_memory or lower max_tokens",
            "max_tokens",
        )
