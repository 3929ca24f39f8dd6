"""Turn a step's logits into one token per sampled row, vectorized over the batch.

Order of operations for each row (as vLLM v1 does it)::

    logits[:, :vocab_size]                      drop padded vocab columns
      -> logit_bias (OpenAI's: added to the named tokens' logits)
      -> repetition / presence / frequency penalties
      -> logprobs (log_softmax of the penalized, untempered logits), when asked
      -> greedy rows: the first maximum (kernels/cpu/fused.argmax: max(dim=-1).indices
                      in one pass per row on the CPU)
      -> other rows: / temperature -> top_k -> top_p -> min_p (a truncated row keeps
                     only its candidates, at most a few hundred tokens) -> softmax
                     -> inverse CDF: the first token whose cumulative probability
                        exceeds u * total, one uniform u per row

One uniform per row (not one Exp(1) or Gumbel draw per vocabulary entry: 1.6 M
logarithms per step at batch 32 cost about 30 ms on a 2-core CPU, the two-level
cumulative sum about 1 ms) lets each row own its randomness: a seeded row's u is a pure
function of ``(seed, sample_index)``, so the same request samples the same tokens
whatever else is in the batch, and again after preemption and recomputation. A
truncated row (top_k, top_p, min_p) draws among its candidates only, with a full sort
of the vocabulary only when its cut lies beyond the best 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.kernels.token_bitmask import apply_token_bitmask_
from pagewarden.sampling_params import SamplingParams
from pagewarden.sched.output import TokenLogprobs

_MASK = float("-inf")
_MIX_MULT = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
# Candidates sorted per row for top_p / min_p without a small top_k (truncate_top_k_top_p_min_p).
_CANDIDATES = 256
# Tokens per block of the two-level inverse-CDF draw (see _inverse_cdf).
_CDF_BLOCK = 256


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits.

    ``seed`` already has the child index of ``n > 1`` mixed in; ``None`` means "use the
    sampler's generator". ``sample_index`` is the index of the output token being sampled
    (``len(output_token_ids)``).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int | None
    sample_index: int


@dataclass(frozen=True)
class SamplerOutput:
    """One token per row, and its logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


# ---- structured outputs: the grammar's token bitmask ------------------------------


@dataclass(frozen=True)
class TokenBitmask:
    """Which tokens the constrained rows of a batch may sample (``engine/grammar.py``).

    ``bits`` is (S, ceil(V / 32)) int32, one row per batch row, packed little-endian:
    token ``t`` is allowed in row ``r`` when bit ``t % 32`` of ``bits[r, t // 32]`` is
    set. Only the rows listed in ``rows`` (the constrained ones) are meaningful; the
    others are never read. Token ids past the vocabulary (padding) are never allowed,
    whatever their bits say.
    """

    rows: list[int]
    bits: Tensor


def apply_token_bitmask(logits: Tensor, mask: TokenBitmask) -> Tensor:
    """``logits`` (S, V) with every token a constrained row may not sample at -inf, in
    place (rows not in ``mask.rows`` unchanged); returns ``logits``."""
    apply_token_bitmask_(logits, mask.bits, mask.rows)
    return logits


def mix_seed(seed: int, sample_index: int) -> int:
    """A 63-bit generator seed that is a pure function of ``(seed, sample_index)``."""
    # splitmix64 finaliser over a combination of the two, so nearby inputs diverge.
    z = (seed * _MIX_MULT + sample_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & ((1 << 63) - 1)


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    """Per-row token counts, (S, V) int64; ids outside the vocab are ignored."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.int64, device=device)
    for row, ids in enumerate(token_lists):
        if not ids:
            continue
        t = torch.tensor(ids, dtype=torch.int64, device=device)
        t = t[(t >= 0) & (t < vocab_size)]
        counts[row].scatter_add_(0, t, torch.ones_like(t))
    return counts


def apply_penalties(
    logits: Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    presence_penalty: Tensor,
    frequency_penalty: Tensor,
    repetition_penalty: Tensor,
) -> Tensor:
    """Return penalized logits (a new tensor).

    ``logits`` is (S, V); the penalty tensors are (S,). Repetition penalty uses HF
    semantics over prompt + output tokens (positive logits divided, negative multiplied);
    presence and frequency penalties use OpenAI semantics over output tokens only:
    ``logit -= frequency * count + presence * (count > 0)``.
    """
    num_rows, vocab_size = logits.shape
    assert len(prompt_token_ids) == len(output_token_ids) == num_rows
    out_counts = _token_counts(output_token_ids, vocab_size, logits.device)  # (S, V)
    prompt_counts = _token_counts(prompt_token_ids, vocab_size, logits.device)  # (S, V)
    rep = repetition_penalty.to(logits).unsqueeze(1)  # (S, 1)
    seen = (out_counts > 0) | (prompt_counts > 0)  # (S, V)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = frequency_penalty.to(logits).unsqueeze(1)  # (S, 1)
    pres = presence_penalty.to(logits).unsqueeze(1)  # (S, 1)
    return logits - freq * out_counts.to(logits) - pres * (out_counts > 0).to(logits)


def apply_logit_bias(logits: Tensor, biases: list[dict[int, float] | None]) -> Tensor:
    """Return ``logits`` (S, V) with each row's bias added to its tokens (a new tensor):
    one scatter for the whole batch. Token ids are below V (``check_vocab``)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(biases):
        for token_id, value in (bias or {}).items():
            rows.append(row)
            cols.append(token_id)
            values.append(value)
    if not rows:
        return logits
    device = logits.device
    index = (
        torch.tensor(rows, dtype=torch.long, device=device),  # (B,)
        torch.tensor(cols, dtype=torch.long, device=device),  # (B,)
    )
    return logits.index_put(
        index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True
    )


@dataclass(frozen=True)
class Candidates:
    """Rows ``rows`` (C,) of a batch, truncated: each row's surviving tokens are among
    ``token_ids`` (C, W), with their logits in ``logits`` (C, W) and -inf where a
    candidate was cut. Sampling from ``logits.softmax`` and mapping back through
    ``token_ids`` samples the truncated distribution without touching the rest of the
    vocabulary."""

    rows: Tensor
    token_ids: Tensor
    logits: Tensor


def truncate_top_k_top_p_min_p(
    logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> list[Candidates]:
    """Each row's top_k / top_p / min_p set as candidates, in at most three groups.

    ``logits`` is (S, V) already divided by temperature; ``top_k`` is (S,) int64 with
    ``V`` meaning "off", ``top_p`` and ``min_p`` are (S,) float. The most likely token
    always survives. Rows with nothing to cut are not in any group.

    Only the best tokens of each row are sorted (``topk``), never the whole vocabulary
    when that can be avoided (a full sort of a (32, 49152) batch costs about 60 ms on a
    2-core CPU, a top-256 about 3 ms): the ``max(top_k)`` best when every row has a
    top_k below ``_CANDIDATES``; otherwise the best ``_CANDIDATES``, which decide a row
    when its top_k, top_p or min_p cut falls inside them (every token below them is then
    cut too), and a full sort only for the rows where none does.
    """
    num_rows, vocab_size = logits.shape
    active = (top_k < vocab_size) | (top_p < 1.0) | (min_p > 0.0)  # (S,)
    if not bool(active.any()):
        return []
    rows = active.nonzero().squeeze(1)  # (A,)
    if len(rows) < num_rows:
        logits, top_k, top_p, min_p = logits[rows], top_k[rows], top_p[rows], min_p[rows]
    k_max = int(top_k.max())
    width = min(k_max if k_max <= _CANDIDATES else _CANDIDATES, vocab_size)
    ids, kept, decided = _truncate(logits, top_k, top_p, min_p, width)
    if bool(decided.all()):
        return [Candidates(rows, ids, kept)]
    ok, rest = decided.nonzero().squeeze(1), (~decided).nonzero().squeeze(1)
    groups = [Candidates(rows[ok], ids[ok], kept[ok])] if len(ok) else []
    ids, kept, _ = _truncate(logits[rest], top_k[rest], top_p[rest], min_p[rest], vocab_size)
    return groups + [Candidates(rows[rest], ids, kept)]


def apply_top_k_top_p_min_p(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """``logits`` (S, V) with every token outside the row's top_k / top_p / min_p set
    masked to -inf (see ``truncate_top_k_top_p_min_p``)."""
    out = logits.clone()
    for group in truncate_top_k_top_p_min_p(logits, top_k, top_p, min_p):
        masked = torch.full_like(logits[group.rows], _MASK)  # (C, V)
        out[group.rows] = masked.scatter_(1, group.token_ids, group.logits)
    return out


def _truncate(
    logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, width: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``width`` best tokens of each row (S, W), their logits with the cut ones at
    -inf (S, W), and which rows this decides exactly (S,) bool: those whose cut falls
    inside the candidates.

    A row's probabilities are its top_k-filtered softmax (top_k runs first, so top_p and
    min_p see the renormalised distribution); a row with no top_k cut among the
    candidates uses its full softmax, from the row's logsumexp.
    """
    vocab_size = logits.shape[1]
    if width < vocab_size:
        sorted_logits, sorted_idx = logits.topk(width, dim=-1)  # (S, W), descending
    else:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (S, V)
    ranks = torch.arange(width, device=logits.device).unsqueeze(0)  # (1, W)
    k_inside = top_k <= width  # (S,)
    remove = ranks >= top_k.unsqueeze(1)  # (S, W) top_k
    # Softmax over the kept candidates equals the full softmax renormalised to them.
    probs = sorted_logits.masked_fill(remove, _MASK).softmax(dim=-1)  # (S, W)
    if width < vocab_size and not bool(k_inside.all()):
        full = (sorted_logits - logits.logsumexp(dim=-1, keepdim=True)).exp()  # (S, W)
        probs = torch.where(k_inside.unsqueeze(1), probs, full)
    # top_p: drop a token when the mass strictly before it already reaches top_p.
    cum = probs.cumsum(dim=-1)
    remove |= (cum - probs) >= top_p.unsqueeze(1)
    # min_p: drop tokens with prob < min_p * max prob (max prob is column 0).
    floor = min_p * probs[:, 0]  # (S,)
    remove |= probs < floor.unsqueeze(1)
    remove[:, 0] = False
    decided = k_inside | (cum[:, -1] >= top_p) | (probs[:, -1] < floor)
    return sorted_idx, sorted_logits.masked_fill(remove, _MASK), decided


def compute_logprobs(
    logprobs: Tensor, token_ids: Tensor, num_top: list[int]
) -> list[TokenLogprobs | None]:
    """Logprob of each sampled token and of each row's ``num_top[i]`` best tokens.

    ``logprobs`` is (S, V) log_softmax output; ``num_top[i] < 0`` means "not asked".
    """
    max_top = max(num_top)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()  # (S,)
    top_vals, top_ids = logprobs.topk(max(max_top, 0), dim=-1)  # (S, max_top), sorted
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    tokens = token_ids.tolist()
    result: list[TokenLogprobs | None] = []
    for i, k in enumerate(num_top):
        if k < 0:
            result.append(None)
            continue
        top = list(zip(top_ids_l[i][:k], top_vals_l[i][:k]))
        result.append(TokenLogprobs(token_id=tokens[i], logprob=sampled[i], top=top))
    return result


class Sampler:
    """Samples one token per row of a (S, V) logits tensor.

    Invariant: every returned token id lies in ``[0, vocab_size)``, even when the logits
    carry padded vocab columns.
    """

    def __init__(self, vocab_size: int, generator: torch.Generator | None = None) -> None:
        assert vocab_size >= 1
        self.vocab_size = vocab_size
        self.generator = generator

    def __call__(
        self, logits: Tensor, rows: list[SamplingRow], bitmask: TokenBitmask | None = None
    ) -> SamplerOutput:
        """Sample a token for each row of ``logits`` (S, V >= vocab_size), any float dtype
        (widened to float32 except on the all-greedy fast path). ``bitmask``: the
        grammar's allowed tokens for constrained rows, applied first, in place on
        ``logits`` (so logprobs, as vLLM's, are those of the constrained distribution)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (
            f"logits {tuple(logits.shape)} does not match {len(rows)} rows"
        )
        assert logits.shape[1] >= self.vocab_size, (
            f"logits have {logits.shape[1]} columns, fewer than vocab_size {self.vocab_size}"
        )
        logits = logits[:, : self.vocab_size]  # (S, V)
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        params = [r.params for r in rows]
        if all(
            p.greedy and not _has_penalties(p) and p.logprobs is None and p.logit_bias is None
            for p in params
        ):
            # On the logits' own dtype: widening is exact, so the first maximum is the same.
            greedy_ids = cpu_fused.argmax(logits).tolist()  # (S,) first maximum, as max()
            return SamplerOutput(token_ids=greedy_ids, logprobs=[None] * len(rows))
        logits = logits.float()

        device = logits.device
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, [p.logit_bias for p in params])
        if any(_has_penalties(p) for p in params):
            logits = apply_penalties(
                logits,
                [r.prompt_token_ids for r in rows],
                [r.output_token_ids for r in rows],
                torch.tensor([p.presence_penalty for p in params], device=device),
                torch.tensor([p.frequency_penalty for p in params], device=device),
                torch.tensor([p.repetition_penalty for p in params], device=device),
            )
        # Logprobs come from the penalized logits before temperature/top-k/top-p.
        raw_logprobs = (
            logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
        )

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) < len(rows):
            token_ids = cpu_fused.argmax(logits)  # (S,) correct for greedy rows
        else:
            token_ids = torch.empty(len(rows), dtype=torch.int64, device=device)
        if random_rows:
            token_ids[torch.tensor(random_rows, device=device)] = self._draw(
                logits, [rows[i] for i in random_rows], random_rows, len(rows)
            )

        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            num_top = [-1 if p.logprobs is None else p.logprobs for p in params]
            logprobs = compute_logprobs(raw_logprobs, token_ids, num_top)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _draw(
        self, logits: Tensor, rows: list[SamplingRow], random_rows: list[int], num_rows: int
    ) -> Tensor:
        """Tokens (R,) drawn for the sampled (non-greedy) ``rows``, which are rows
        ``random_rows`` of ``logits`` (num_rows, V): temperature, then top-k / top-p /
        min-p truncation, then the inverse CDF at each row's uniform draw."""
        device = logits.device
        sub = [r.params for r in rows]
        temps = torch.tensor([p.temperature for p in sub], device=device)
        idx = torch.tensor(random_rows, device=device)
        picked = logits if len(random_rows) == num_rows else logits[idx]  # (R, V)
        scaled = picked if bool((temps == 1.0).all()) else picked / temps.unsqueeze(1)
        u = self._uniforms(rows, device)  # (R,) float64
        drawn = torch.empty(len(random_rows), dtype=torch.int64, device=device)  # (R,)
        cut = torch.zeros(len(random_rows), dtype=torch.bool, device=device)  # (R,)
        groups = truncate_top_k_top_p_min_p(
            scaled,
            torch.tensor([p.top_k or self.vocab_size for p in sub], device=device),
            torch.tensor([p.top_p for p in sub], device=device),
            torch.tensor([p.min_p for p in sub], device=device),
        )
        for g in groups:  # truncated rows: draw among their candidates only
            pick = _inverse_cdf(g.logits.softmax(dim=-1), u[g.rows])  # (C,)
            drawn[g.rows] = g.token_ids.gather(1, pick.unsqueeze(1)).squeeze(1)
            cut[g.rows] = True
        if not groups:
            drawn = _inverse_cdf(scaled.softmax(dim=-1), u)
        elif not bool(cut.all()):
            whole = (~cut).nonzero().squeeze(1)  # (R - C,)
            drawn[whole] = _inverse_cdf(scaled[whole].softmax(dim=-1), u[whole])
        return drawn

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> Tensor:
        """One U[0, 1) draw per row, (R,) float64; a seeded row's depends only on
        (seed, sample_index)."""
        u = torch.empty(len(rows), dtype=torch.float64, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.seed is None]
        if unseeded:
            # One draw for all unseeded rows: they are independent anyway.
            draw = torch.rand(
                len(unseeded), dtype=torch.float64, generator=self.generator, device=device
            )
            u[torch.tensor(unseeded, device=device)] = draw
        for i, row in enumerate(rows):
            if row.seed is not None:
                gen = torch.Generator().manual_seed(mix_seed(row.seed, row.sample_index))
                u[i] = float(torch.rand(1, dtype=torch.float64, generator=gen))
        return u


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """For each row of ``probs`` (R, V), the first token whose cumulative probability
    exceeds ``u * total`` (``u`` (R,) in [0, 1)): a draw from the row's distribution.

    Two levels, so a long vocabulary costs one float32 pass and no rounding bias: the
    sums of blocks of ``_CDF_BLOCK`` tokens (float32, each accurate to ~1e-7 of its
    block), a float64 cumsum over the blocks to find the block holding the target, and a
    float32 cumsum inside that block only. Zero-probability tokens are never chosen: each
    search takes the first strictly greater cumulative sum, and a target rounded onto
    the end of its block falls back to the row's best token.
    """
    num_rows, vocab = probs.shape
    pad = -vocab % _CDF_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    blocks = blocks.view(num_rows, -1, _CDF_BLOCK)  # (R, B, C)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)  # (R, B) float64
    target = (u * block_cdf[:, -1]).unsqueeze(1)  # (R, 1)
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks.shape[1] - 1)
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), 0.0)  # (R, 1)
    rows = torch.arange(num_rows, device=probs.device)
    inside = blocks[rows, b.squeeze(1)].cumsum(dim=-1)  # (R, C) float32
    rest = (target - before).to(inside.dtype)  # (R, 1)
    offset = torch.searchsorted(inside, rest, right=True).clamp_(max=_CDF_BLOCK - 1)
    ids = (b * _CDF_BLOCK + offset).squeeze(1).clamp_(max=vocab - 1)  # (R,)
    hit_zero = probs.gather(1, ids.unsqueeze(1)).squeeze(1) <= 0  # (R,)
    if bool(hit_zero.any()):
        ids = torch.where(hit_zero, probs.max(dim=-1).indices, ids)
    return ids
