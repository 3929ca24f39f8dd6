"""The grammar's token bitmask applied to a batch of logits, in place.

Layouts: ``logits`` (S, V), any float dtype, rows may be strided (a column slice of wider
logits); ``bits`` (S, W) int32 with ``W * 32 >= V``, packed little-endian: token ``t`` of
row ``r`` is allowed when bit ``t % 32`` of ``bits[r, t // 32]`` is set. Only the rows
listed in ``rows`` are read and written; the others may hold anything.

On the CPU the work is the fused C++ op (``kernels/cpu/fused.cpp``, ``mask_rows_``:
words of all ones skipped, words of zeros filled whole, on the kernels' pool; about
0.1 ms for 32 rows of 49,152 where xgrammar's kernel took 3.3) or, where it is not
built or the dtype is another, xgrammar's C++ CPU kernel (one pass over each listed
row); elsewhere it is the plain-torch version below, which is also the reference the
tests compare the kernels with.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagewarden.kernels.cpu import fused as cpu_fused

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # (32,)


def apply_token_bitmask_(logits: Tensor, bits: Tensor, rows: list[int]) -> None:
    """Set every token that ``rows`` may not sample to -inf in ``logits`` (in place)."""
    num_rows, vocab_size = logits.shape
    assert bits.dtype == torch.int32 and bits.dim() == 2 and bits.shape[0] >= num_rows
    assert bits.shape[1] * 32 >= vocab_size, "bitmask narrower than the vocabulary"
    if not rows:
        return
    if cpu_fused.mask_rows_(logits, bits, rows):
        return
    if logits.device.type == "cpu" and bits.device.type == "cpu":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(
            logits, bits, vocab_size=vocab_size, indices=rows, backend="cpu"
        )
    else:
        apply_token_bitmask_reference_(logits, bits.to(logits.device), rows)


def apply_token_bitmask_reference_(logits: Tensor, bits: Tensor, rows: list[int]) -> None:
    """``apply_token_bitmask_`` in plain torch: unpack the listed rows' words to bits."""
    vocab_size = logits.shape[1]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # (C,)
    shifts = _BIT_SHIFTS.to(logits.device)
    unpacked = (bits[index].unsqueeze(-1) >> shifts) & 1  # (C, W, 32)
    allowed = unpacked.reshape(len(rows), -1)[:, :vocab_size].bool()  # (C, V)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
