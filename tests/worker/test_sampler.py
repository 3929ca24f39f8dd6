"""Sampler: greedy, truncation, penalties, seeded determinism, distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagewarden.sampling_params import SamplingParams
from pagewarden.worker.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p_min_p,
    mix_seed,
)

V = 16


def row(
    params: SamplingParams,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    sample_index: int = 0,
) -> SamplingRow:
    return SamplingRow(
        params=params,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        seed=seed,
        sample_index=sample_index,
    )


def random_logits(num_rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=gen) * 3  # (S, V)


def test_greedy_equals_argmax() -> None:
    logits = random_logits(8)
    out = Sampler(V)(logits, [row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ignores_padded_vocab_columns() -> None:
    logits = random_logits(4, vocab=V + 8)
    logits[:, V:] = 100.0  # padding columns must never win
    sampler = Sampler(V)
    greedy = sampler(logits, [row(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert greedy.token_ids == logits[:, :V].argmax(-1).tolist()
    sampled = sampler(logits, [row(SamplingParams(temperature=1.0), seed=i) for i in range(4)])
    assert all(0 <= t < V for t in sampled.token_ids)


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(8)
    rows = [row(SamplingParams(temperature=1.5, top_k=1), seed=i) for i in range(8)]
    assert Sampler(V)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_equals_greedy() -> None:
    logits = random_logits(8)
    rows = [row(SamplingParams(temperature=1.0, top_p=1e-6), seed=i) for i in range(8)]
    assert Sampler(V)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_masks_exactly_k() -> None:
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k_top_p_min_p(
        logits, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0])
    )
    assert torch.isinf(out).tolist() == [[True, False, True, False, True]]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    out = apply_top_k_top_p_min_p(
        logits, torch.tensor([4]), torch.tensor([0.8]), torch.tensor([0.0])
    )
    # 0.5 + 0.3 = 0.8 reaches top_p, so the 0.15 and 0.05 tokens go.
    assert torch.isinf(out).tolist() == [[False, False, True, True]]


def test_min_p_masks_relative_to_max() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_top_k_top_p_min_p(
        probs.log(), torch.tensor([4]), torch.tensor([1.0]), torch.tensor([0.4])
    )
    # threshold 0.4 * 0.5 = 0.2: 0.15 and 0.05 go.
    assert torch.isinf(out).tolist() == [[False, False, True, True]]
    # Sampling with min_p never picks a masked token.
    logits = probs.log().expand(64, 4).contiguous()
    rows = [row(SamplingParams(min_p=0.4), seed=i) for i in range(64)]
    tokens = Sampler(4)(logits, rows).token_ids
    assert set(tokens) <= {0, 1}
    assert set(tokens) == {0, 1}


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0],
            [1.0, 1.0, -1.0, -1.0, 0.0],
        ]
    )
    prompt = [[0, 1], [4]]
    output = [[3, 3, 1], [2]]
    out = apply_penalties(
        logits,
        prompt,
        output,
        presence_penalty=torch.tensor([0.5, 0.0]),
        frequency_penalty=torch.tensor([0.25, 1.0]),
        repetition_penalty=torch.tensor([2.0, 1.0]),
    )
    # Row 0: repetition 2 over {0, 1, 3}; presence 0.5 + frequency 0.25 * count over output.
    #   token 0: 2 / 2 = 1                       (prompt only: no presence/frequency)
    #   token 1: -1 * 2 = -2, then -0.5 - 0.25   = -2.75
    #   token 2: untouched                       = 0.5
    #   token 3: 3 / 2 = 1.5, then -0.5 - 0.5    = 0.5
    #   token 4: untouched                       = -2
    # Row 1: frequency 1 over output {2: 1}; repetition off.
    expected = torch.tensor(
        [
            [1.0, -2.75, 0.5, 0.5, -2.0],
            [1.0, 1.0, -2.0, -1.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected)
    assert logits[0, 0] == 2.0, "apply_penalties must not modify its input"


def test_penalties_change_sampler_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    out = Sampler(4)(logits, [row(params, output=[0])])
    assert out.token_ids == [1]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert Sampler(4)(logits, [row(params, prompt=[0])]).token_ids == [1]


def test_seeded_row_independent_of_batch_composition_and_position() -> None:
    vocab = 64
    target = random_logits(1, vocab, seed=1)[0]
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(vocab, torch.Generator().manual_seed(0))

    def sample_alone(i: int) -> int:
        return sampler(target.unsqueeze(0), [row(params, seed=42, sample_index=i)]).token_ids[0]

    alone = [sample_alone(i) for i in range(20)]
    for position, batch_size in [(0, 3), (2, 3), (5, 6)]:
        tokens = []
        for i in range(20):
            logits = random_logits(batch_size, vocab, seed=100 + i)
            logits[position] = target
            rows = [
                row(SamplingParams(temperature=0.7, top_k=5), seed=None)
                if j % 2
                else row(SamplingParams(temperature=1.0, top_p=0.9), seed=j + 7, sample_index=3)
                for j in range(batch_size)
            ]
            rows[position] = row(params, seed=42, sample_index=i)
            tokens.append(sampler(logits, rows).token_ids[position])
        assert tokens == alone
    assert len(set(alone)) > 1, "a seeded row must still vary across sample_index"


def test_different_seeds_differ() -> None:
    vocab = 64
    logits = torch.zeros(1, vocab)  # uniform
    sampler = Sampler(vocab)
    params = SamplingParams(temperature=1.0)
    a = [sampler(logits, [row(params, seed=1, sample_index=i)]).token_ids[0] for i in range(16)]
    b = [sampler(logits, [row(params, seed=2, sample_index=i)]).token_ids[0] for i in range(16)]
    assert a != b
    assert mix_seed(1, 0) != mix_seed(0, 1)


def test_unseeded_rows_use_sampler_generator() -> None:
    logits = torch.zeros(8, 64)
    rows = [row(SamplingParams(temperature=1.0)) for _ in range(8)]
    a = Sampler(64, torch.Generator().manual_seed(3))(logits, rows).token_ids
    b = Sampler(64, torch.Generator().manual_seed(3))(logits, rows).token_ids
    assert a == b


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("top_k", [0, 4])  # the whole row; candidates from a top_k
def test_distribution_matches_softmax(seeded: bool, top_k: int) -> None:
    vocab = 6
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n = 6000
    logits = base.expand(n, vocab).contiguous()  # (n, V)
    params = SamplingParams(temperature=1.0, top_k=top_k)
    rows = [row(params, seed=(i if seeded else None)) for i in range(n)]
    tokens = torch.tensor(Sampler(vocab, torch.Generator().manual_seed(11))(logits, rows).token_ids)
    observed = torch.bincount(tokens, minlength=vocab).double()
    kept = base.double() if not top_k else base.double().masked_fill(base < 0.0, -math.inf)
    expected = kept.softmax(-1) * n
    assert observed[expected == 0].sum() == 0
    live = expected > 0
    chi2 = float(((observed[live] - expected[live]) ** 2 / expected[live]).sum())
    # <= 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5; deterministic given the seeds anyway.
    assert chi2 < 30.0, (observed.tolist(), expected.tolist())


def test_temperature_sharpens_distribution() -> None:
    vocab = 4
    base = torch.tensor([1.0, 0.0, 0.0, 0.0])
    n = 2000
    logits = base.expand(n, vocab).contiguous()
    sampler = Sampler(vocab)
    cold = sampler(logits, [row(SamplingParams(temperature=0.2), seed=i) for i in range(n)])
    hot = sampler(logits, [row(SamplingParams(temperature=5.0), seed=i) for i in range(n)])
    assert cold.token_ids.count(0) > 0.95 * n
    assert hot.token_ids.count(0) < 0.5 * n


def test_logprobs_sorted_and_match_log_softmax() -> None:
    logits = random_logits(4)
    rows = [
        row(SamplingParams(temperature=1.0, logprobs=5), seed=1),
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logprobs=3)),
    ]
    out = Sampler(V)(logits, rows)
    ref = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    assert out.logprobs[1] is not None and out.logprobs[1].top == []
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, ref[i, lp.token_id].item(), abs_tol=1e-5)
        k = rows[i].params.logprobs
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        expected_ids = ref[i].topk(k).indices.tolist() if k else []
        assert [t for t, _ in lp.top] == expected_ids
        for t, v in lp.top:
            assert math.isclose(v, ref[i, t].item(), abs_tol=1e-5)
    assert out.token_ids[1] == logits[1].argmax().item()


def test_logprobs_are_after_penalties() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=1, presence_penalty=2.0)
    out = Sampler(3)(logits, [row(params, output=[0])])
    penalized = torch.tensor([[1.0, 1.0, 0.0]]).log_softmax(-1)
    lp = out.logprobs[0]
    assert lp is not None
    assert math.isclose(lp.logprob, penalized[0, lp.token_id].item(), abs_tol=1e-5)


def test_empty_batch() -> None:
    out = Sampler(V)(torch.empty(0, V), [])
    assert out.token_ids == [] and out.logprobs == []


def _truncate_one_row(logits: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """Reference for one (V,) row: sort all, keep k, then top_p and min_p over them."""
    order = logits.argsort(descending=True).tolist()
    kept = order[:k]
    probs = torch.softmax(logits[kept], dim=0)
    keep, mass = [], 0.0
    for rank, tok in enumerate(kept):
        if rank > 0 and (mass >= p or probs[rank] < min_p * probs[0]):
            continue
        keep.append(tok)
        mass += float(probs[rank])
    out = torch.full_like(logits, float("-inf"))
    out[keep] = logits[keep]
    return out


@pytest.mark.parametrize("top_ks", [[3, 5, 1, 7], [3, V, 2, 5]])  # topk path, full-sort path
def test_truncation_matches_per_row_reference(top_ks: list[int]) -> None:
    logits = random_logits(4, seed=11)
    top_p = [0.9, 0.5, 1.0, 0.7]
    min_p = [0.0, 0.1, 0.0, 0.05]
    got = apply_top_k_top_p_min_p(
        logits, torch.tensor(top_ks), torch.tensor(top_p), torch.tensor(min_p)
    )
    for i in range(4):
        want = _truncate_one_row(logits[i], top_ks[i], top_p[i], min_p[i])
        assert torch.equal(got[i].isinf(), want.isinf()), f"row {i}"
        torch.testing.assert_close(got[i][~got[i].isinf()], want[~want.isinf()])


def test_greedy_picks_first_of_tied_maxima() -> None:
    logits = torch.zeros(2, V)
    logits[0, [4, 9]] = 5.0
    logits[1, [0, V - 1]] = 5.0
    out = Sampler(V)(logits, [row(SamplingParams(temperature=0.0))] * 2)
    assert out.token_ids == [4, 0]


def test_truncation_over_candidates_matches_reference_and_falls_back() -> None:
    """A vocabulary wider than the sorted candidates: rows whose cut falls inside them,
    rows that need the full sort (a flat row with top_p near 1, a top_k above the
    candidate count), and a row with nothing to cut, all equal the per-row reference."""
    vocab = 2000
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab, generator=gen)
    logits[0] *= 8.0  # peaked: top_p 0.9 is decided by a few tokens
    logits[1] *= 0.1  # nearly flat: top_p 0.99 needs most of the vocabulary
    top_ks = [vocab, vocab, 300, vocab, vocab, 40]
    top_p = [0.9, 0.99, 1.0, 1.0, 1.0, 0.5]
    min_p = [0.0, 0.0, 0.0, 0.2, 0.0, 0.0]
    got = apply_top_k_top_p_min_p(
        logits, torch.tensor(top_ks), torch.tensor(top_p), torch.tensor(min_p)
    )
    for i in range(6):
        want = _truncate_one_row(logits[i], top_ks[i], top_p[i], min_p[i])
        assert torch.equal(got[i].isinf(), want.isinf()), f"row {i}"
        torch.testing.assert_close(got[i][~got[i].isinf()], want[~want.isinf()])
    assert int((~got[1].isinf()).sum()) > 256, "the flat row must have used the full sort"
    assert torch.equal(got[4], logits[4]), "a row with nothing to cut passes through"


def test_inverse_cdf_never_draws_a_masked_token() -> None:
    from pagewarden.worker.sampler import _inverse_cdf

    probs = torch.zeros(3, 8)
    probs[:, 2] = 0.25
    probs[:, 5] = 0.75
    u = torch.tensor([0.0, 0.5, 1.0 - 2.0**-53], dtype=torch.float64)
    assert _inverse_cdf(probs, u).tolist() == [2, 5, 5]
    probs = torch.zeros(1, 8)
    probs[0, 0] = 1.0  # all mass on the first token, zeros after: the last u must not
    assert _inverse_cdf(probs, torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)).tolist() == [0]


def test_inverse_cdf_stratified_draws_hit_each_token_in_proportion() -> None:
    """Evenly spaced u over [0, 1) must land on each token about p * N times (within 1):
    the two-level search (block sums, then inside one block) loses no mass at block
    edges, including the padded last block of a vocabulary that is not a block multiple."""
    from pagewarden.worker.sampler import _inverse_cdf

    vocab, draws = 1000, 20000
    gen = torch.Generator().manual_seed(2)
    probs = torch.rand(vocab, generator=gen) ** 4
    probs[torch.randperm(vocab, generator=gen)[:300]] = 0.0  # masked tokens
    probs /= probs.sum()
    u = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    ids = _inverse_cdf(probs.expand(draws, vocab), u)
    counts = torch.bincount(ids, minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    assert (counts - probs.double() * draws).abs().max() <= 1.0 + 1e-6


def test_bfloat16_logits_sample_as_their_float32_widening() -> None:
    """The greedy fast path runs on the logits' own dtype; every other path widens them."""
    logits = random_logits(8, seed=4).to(torch.bfloat16)
    logits[0, [3, 9]] = 7.0  # a tie: the first maximum either way
    wide = logits.float()
    greedy = [row(SamplingParams(temperature=0.0))] * 8
    assert Sampler(V)(logits, greedy).token_ids == Sampler(V)(wide, greedy).token_ids
    assert Sampler(V)(logits, greedy).token_ids[0] == 3
    seeded = [row(SamplingParams(temperature=0.9, top_k=5), seed=i) for i in range(8)]
    assert Sampler(V)(logits, seeded).token_ids == Sampler(V)(wide, seeded).token_ids
