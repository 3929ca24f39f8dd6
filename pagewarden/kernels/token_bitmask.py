"""The grammar's token bitmask applied to a batch of logits, in place.

Layouts: ``logits`` (S, V), any float dtype, rows may be strided (a column slice of wider
logits); ``bits`` (S, W) int32 with ``W * 32 >= V``, packed little-endian: token ``t`` of
row ``r`` is allowed when bit ``t % 32`` of ``bits[r, t // 32]`` is set. Only the rows
listed in ``rows`` are read and written; the others may hold anything.

On the CPU a row whose allowed tokens sit in few words (JSON punctuation, keys, enums:
most rows of a JSON-schema batch) is set to -inf whole and its allowed logits put back,
which reads only its nonzero words; the other rows go through xgrammar's C++ kernel
(one pass over each row, no temporaries). Elsewhere it is the plain-torch version below,
which is also the reference the tests compare both with.
"""

from __future__ import annotations

import torch
from torch import Tensor

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # (32,)
#: A row with at most this share of nonzero words takes the sparse path.
SPARSE_WORDS = 1 / 16


def apply_token_bitmask_(logits: Tensor, bits: Tensor, rows: list[int]) -> None:
    """Set every token that ``rows`` may not sample to -inf in ``logits`` (in place)."""
    num_rows, vocab_size = logits.shape
    assert bits.dtype == torch.int32 and bits.dim() == 2 and bits.shape[0] >= num_rows
    assert bits.shape[1] * 32 >= vocab_size, "bitmask narrower than the vocabulary"
    if not rows:
        return
    if logits.device.type == "cpu" and bits.device.type == "cpu":
        index = torch.tensor(rows, dtype=torch.int64)  # (C,)
        words = bits[index]  # (C, W)
        sparse = (words != 0).sum(dim=1) <= words.shape[1] * SPARSE_WORDS  # (C,)
        if bool(sparse.any()):
            _apply_sparse_(logits, words[sparse], index[sparse])
        dense = [r for r, s in zip(rows, sparse.tolist()) if not s]
        if dense:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(
                logits, bits, vocab_size=vocab_size, indices=dense, backend="cpu"
            )
    else:
        apply_token_bitmask_reference_(logits, bits.to(logits.device), rows)


def _apply_sparse_(logits: Tensor, words: Tensor, index: Tensor) -> None:
    """Rows ``index`` (R,) of ``logits`` to -inf but for the tokens set in ``words`` (R, W)."""
    vocab_size = logits.shape[1]
    row, col = words.nonzero(as_tuple=True)  # (K,) each: the nonzero words
    set_ = ((words[row, col].unsqueeze(1) >> _BIT_SHIFTS) & 1).bool()  # (K, 32)
    tokens = (col.unsqueeze(1) * 32 + _BIT_SHIFTS)[set_]  # (N,) allowed token ids
    rows = index[row].unsqueeze(1).expand(-1, 32)[set_]  # (N,) their logits rows
    real = tokens < vocab_size  # padding bits never allow a token
    tokens, rows = tokens[real], rows[real]
    kept = logits[rows, tokens]  # (N,)
    logits.index_fill_(0, index, float("-inf"))
    logits[rows, tokens] = kept


def apply_token_bitmask_reference_(logits: Tensor, bits: Tensor, rows: list[int]) -> None:
    """``apply_token_bitmask_`` in plain torch: unpack the listed rows' words to bits."""
    vocab_size = logits.shape[1]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # (C,)
    shifts = _BIT_SHIFTS.to(logits.device)
    unpacked = (bits[index].unsqueeze(-1) >> shifts) & 1  # (C, W, 32)
    allowed = unpacked.reshape(len(rows), -1)[:, :vocab_size].bool()  # (C, V)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
