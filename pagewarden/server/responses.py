"""Building blocks of responses: sampling parameters from a body, usage, logprobs, SSE."""

from __future__ import annotations

import json

from pagewarden.engine.outputs import CompletionOutput, RequestOutput
from pagewarden.sampling_params import SamplingParams, SamplingParamsError
from pagewarden.server.context import ServerLimits
from pagewarden.server.errors import APIError
from pagewarden.structured_outputs import StructuredOutputsParams


def sampling_params(
    req,
    max_tokens: int | None,
    logprobs: int | None,
    limits: ServerLimits,
    structured: StructuredOutputsParams | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's ``SamplingParams`` for a body, with the server's limits applied;
    ``structured``: the checked structured-outputs constraint (``structured.py``)."""
    if req.n > limits.max_n:
        raise APIError(400, f"n must be at most {limits.max_n}, got {req.n}", "n")
    if getattr(req, "best_of", None) not in (None, req.n):
        raise APIError(400, "best_of other than n is not supported", "best_of")
    for name, value in (
        ("logprobs" if hasattr(req, "echo") else "top_logprobs", logprobs),
        ("prompt_logprobs", prompt_logprobs),
    ):
        if value is not None and not 0 <= value <= limits.max_logprobs:
            raise APIError(
                400,
                f"{name} must be in [0, {limits.max_logprobs}] (--max-logprobs), got {value}",
                name,
            )
    try:
        return SamplingParams(
            n=req.n,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias(req.logit_bias),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured,
        )
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), exc.param) from None


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (JSON keys: token ids as decimal strings) as token ids;
    ranges and the vocabulary are checked by ``SamplingParams``."""
    if not bias:
        return None
    ids: dict[int, float] = {}
    for key, value in bias.items():
        text = key.strip()
        if not text.isdigit() or len(text) > 10:
            shown = key if len(key) <= 20 else key[:20] + "..."
            raise APIError(400, f"logit_bias keys must be token ids, got {shown!r}", "logit_bias")
        ids[int(text)] = value
    return ids


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


#: What a -inf logprob (a token the grammar forbids) is sent as: JSON has no infinity.
MIN_LOGPROB = -9999.0


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(tok, c: CompletionOutput, start: int, offset: int) -> dict:
    lps = c.logprobs[start:] if c.logprobs else []
    tokens = [tok.decode([lp.token_id]) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(lp.logprob) for lp in lps],
        "top_logprobs": [{tok.decode([t]): _lp(v) for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def echo_logprobs(tok, out: RequestOutput, k: int, generated: dict) -> dict:
    """``generated`` (``completion_logprobs``) with the prompt's tokens before it: the
    prompt's first token has a null logprob and null top logprobs (OpenAI's echo)."""
    tokens = [tok.decode([t]) for t in out.prompt_token_ids]
    scored = list(out.prompt_logprobs or [])[: len(tokens)]
    scored += [None] * (len(tokens) - len(scored))
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens + generated["tokens"],
        "token_logprobs": [lp.logprob if lp else None for lp in scored]
        + generated["token_logprobs"],
        "top_logprobs": [
            {tok.decode([t]): v for t, v in lp.top[:k]} if lp else None for lp in scored
        ]
        + generated["top_logprobs"],
        "text_offset": offsets + generated["text_offset"],
    }


def vllm_prompt_logprobs(tok, out: RequestOutput, k: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else a map from
    token id (string) to ``{logprob, rank, decoded_token}`` holding the prompt's token and
    the ``k`` most likely ones."""

    def entry(t: int, v: float, rank: int | None) -> dict:
        return {"logprob": v, "rank": rank, "decoded_token": tok.decode([t])}

    result: list[dict | None] = []
    for lp in out.prompt_logprobs or []:
        if lp is None:
            result.append(None)
            continue
        d = {str(t): entry(t, v, r) for r, (t, v) in enumerate(lp.top[:k], start=1)}
        d.setdefault(str(lp.token_id), entry(lp.token_id, lp.logprob, lp.rank))
        result.append(d)
    return result


def chat_logprobs(tok, c: CompletionOutput, start: int) -> dict:
    def entry(tid: int, lp: float) -> dict:
        s = tok.decode([tid])
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode())}

    lps = c.logprobs[start:] if c.logprobs else []
    return {
        "content": [
            dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top])
            for lp in lps
        ]
    }
