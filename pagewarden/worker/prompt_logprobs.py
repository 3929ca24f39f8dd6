"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

Position ``p`` of a prompt predicts token ``p + 1``, so a chunk computing positions
``[s, e)`` scores prompt tokens ``s + 1 .. min(e, P - 1)`` (``P`` prompt tokens; the last
position's logits are the sampling logits, and the first token has no logprob)::

    prompt    t0   t1   t2   t3   t4          P = 5, chunk positions [0, 3)
    position   0    1    2    3    4
    scores        lp1  lp2  lp3               rows 0..2 of the chunk -> tokens 1..3

Only chunks the scheduler marks ``score_prompt`` are scored, from the raw logits (no
penalties, temperature or bias) in float32, a slice of rows at a time so a long prompt
never holds a (tokens, vocab) float32 tensor at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagewarden.models.llama import LlamaForCausalLM
from pagewarden.sched.output import PromptLogprobs, ScheduledRequest, TokenLogprobs

#: Rows of logits materialized at once (512 x 49152 float32 is 100 MB).
_ROWS_PER_SLICE = 512


def score_prompts(
    model: LlamaForCausalLM,
    hidden: Tensor,
    chunks: list[tuple[ScheduledRequest, int]],
    vocab_size: int,
) -> dict[str, PromptLogprobs]:
    """Prompt logprobs of each ``(chunk, flat start row)`` in ``chunks``; ``hidden`` is
    the step's (T, hidden) output."""
    result: dict[str, PromptLogprobs] = {}
    for req, row in chunks:
        first = req.positions.start
        count = min(req.positions.stop, len(req.prompt_token_ids) - 1) - first
        if count <= 0:
            continue
        k = req.sampling_params.prompt_logprobs or 0
        targets = req.prompt_token_ids[first + 1 : first + 1 + count]
        entries: list[TokenLogprobs] = []
        for lo in range(0, count, _ROWS_PER_SLICE):
            hi = min(lo + _ROWS_PER_SLICE, count)
            logits = model.compute_logits(hidden[row + lo : row + hi], dtype=torch.float32)
            ids = torch.tensor(targets[lo:hi], dtype=torch.long, device=hidden.device)
            entries += token_logprobs(logits[:, :vocab_size], ids, k)
        result[req.req_id] = PromptLogprobs(first + 1, entries)
    return result


def token_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> list[TokenLogprobs]:
    """For rows of ``logits`` (R, V) float32 and ``token_ids`` (R,): each token's logprob,
    its rank and the row's ``k`` best tokens."""
    logprobs = logits.log_softmax(dim=-1)  # (R, V)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # (R, 1)
    ranks = (logprobs > chosen).sum(dim=1) + 1  # (R,)
    top_vals, top_ids = logprobs.topk(k, dim=-1)  # (R, k), best first
    tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
    return [
        TokenLogprobs(token_id=t, logprob=lp, top=top, rank=r)
        for t, lp, top, r in zip(
            token_ids.tolist(), chosen.squeeze(1).tolist(), tops, ranks.tolist()
        )
    ]
