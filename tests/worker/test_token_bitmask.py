"""The grammar's token bitmask in the sampler: exact masking, every sampled token allowed."""

from __future__ import annotations

import torch

from pagewarden.sampling_params import SamplingParams
from pagewarden.worker.sampler import Sampler, SamplingRow, TokenBitmask, apply_token_bitmask


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """(C, V) bool -> (C, ceil(V/32)) int32, token t at bit t % 32 of word t // 32."""
    rows, vocab = allowed.shape
    width = (vocab + 31) // 32
    padded = torch.zeros(rows, width * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    words = (padded.view(rows, width, 32) << torch.arange(32)).sum(-1)  # (C, W)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_apply_matches_a_reference_and_leaves_other_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=g)
    allowed = torch.rand(4, 100, generator=g) < 0.2
    allowed[:, 99] = True  # bit 3 of the last word, and bit 31 of some words below
    allowed[:, 31] = True
    allowed[[0, 2]] = False  # rows not listed: their bits are never read
    ref = logits.clone()
    ref[1] = logits[1].masked_fill(~allowed[1], float("-inf"))
    ref[3] = logits[3].masked_fill(~allowed[3], float("-inf"))
    out = apply_token_bitmask(logits.clone(), TokenBitmask(rows=[1, 3], bits=_pack(allowed)))
    assert torch.equal(out, ref)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])


def test_every_sampled_token_is_allowed_for_every_setting():
    vocab = 300
    g = torch.Generator().manual_seed(1)
    settings = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.5, top_k=5),
        SamplingParams(temperature=0.8, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=1.0, presence_penalty=1.0, repetition_penalty=1.3, logprobs=3),
        SamplingParams(temperature=1.0, seed=4),
    ]
    sampler = Sampler(vocab, torch.Generator().manual_seed(2))
    for trial in range(30):
        # logits wider than the vocabulary: padded columns with huge values never win
        logits = torch.randn(len(settings), vocab + 20, generator=g)
        logits[:, vocab:] = 1e4
        allowed = torch.rand(len(settings), vocab, generator=g) < 0.05
        allowed[:, trial] = True
        rows = [SamplingRow(p, [1, 2, 3], [4, trial], p.seed, 2) for p in settings]
        mask = TokenBitmask(rows=list(range(len(settings))), bits=_pack(allowed))
        out = sampler(logits, rows, mask)
        for i, t in enumerate(out.token_ids):
            assert allowed[i, t], (settings[i], t)
        lp = out.logprobs[4]
        assert lp is not None and all(allowed[4, t] or v == float("-inf") for t, v in lp.top)
