"""The one admission check: can a request ever be served by this engine?

The offline API and the server call ``check_request`` when a request is submitted (so the
caller gets the error at once), and the scheduler calls it again when it admits the
request (the pool may have shrunk since: blocks retire after repeated integrity
failures). Both raise the same ``RequestRejected``.

A request's KV never covers its last sampled token (nothing reads it), so it needs at
most ``prompt + max_tokens - 1`` slots: ``max_kv_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagewarden.sampling_params import SamplingParams, SamplingParamsError

__all__ = ["AdmissionLimits", "RequestRejected", "check_request", "max_kv_blocks"]


class RequestRejected(ValueError):
    """A request that can never be served (too long for the model or the pool, an empty
    prompt, a token id outside the vocabulary). ``param`` names the request field to fix
    (``"prompt"``, ``"max_tokens"``, ``"n"``), or None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """What bounds a request: the context length, the pool and the batch."""

    max_model_len: int
    block_size: int
    usable_blocks: int  # blocks a request may hold: all but block 0 and retired ones
    max_num_seqs: int
    vocab_size: int | None = None  # None: token ids are not range-checked


def max_kv_blocks(num_prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request needs at most: its last sampled token is never computed."""
    return (num_prompt_tokens + max_tokens - 1 + block_size - 1) // block_size


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, limits: AdmissionLimits
) -> int:
    """Raise ``RequestRejected`` if the request can never run; else return its resolved
    ``max_tokens`` (``None`` means "up to the context length")."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise RequestRejected("the prompt is empty; give at least one token", "prompt")
    vocab = limits.vocab_size
    if vocab is not None and any(
        not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        for t in prompt_token_ids
    ):
        raise RequestRejected(f"prompt token ids must be integers in [0, {vocab})", "prompt")
    if vocab is not None:
        try:  # top_k, logprobs and stop token ids past the vocabulary would fail a step
            params.check_vocab(vocab)
        except SamplingParamsError as exc:
            raise RequestRejected(str(exc), exc.param) from None
    max_len = limits.max_model_len
    if num_prompt >= max_len:
        raise RequestRejected(
            f"the prompt has {num_prompt} tokens; the context length max_model_len={max_len} "
            "leaves no room to generate; shorten the prompt",
            "prompt",
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_len - num_prompt
    if num_prompt + max_tokens > max_len:
        raise RequestRejected(
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt + max_tokens} exceeds max_model_len={max_len}; "
            "shorten the prompt or lower max_tokens",
            "max_tokens",
        )
    if params.min_tokens > max_tokens:
        raise RequestRejected(
            f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this "
            "request can generate; lower min_tokens",
            "min_tokens",
        )
    blocks = max_kv_blocks(num_prompt, max_tokens, limits.block_size)
    if blocks > limits.usable_blocks:
        raise RequestRejected(
            f"the request needs up to {blocks} KV blocks but the pool has only "
            f"{limits.usable_blocks} usable (block 0 is reserved, retired blocks never "
            "return); lower max_tokens or give the KV cache more memory",
            "max_tokens",
        )
    if params.n > limits.max_num_seqs:
        raise RequestRejected(
            f"n={params.n} exceeds max_num_seqs={limits.max_num_seqs}; lower n", "n"
        )
    return max_tokens
