"""Sliding-window attention and logit soft-capping on the plain-torch path.

The torch path (``paged_attention``) against the float64 reference of
``window_reference.py`` within 1e-5 (float32 caches), over random mixes of decodes,
fresh prompts and chunks, GQA and block sizes; the window convention against
transformers' own masks; and the read itself: a sliding layer reads only the blocks of
its window.
"""

from __future__ import annotations

import pytest
import torch

from pagewarden.kernels.attention import paged_attention
from pagewarden.kernels.attention_metadata import window_start
from tests.kernels.kernel_step import make_step
from tests.kernels.window_reference import random_step, reference_attention


@pytest.mark.parametrize("seed", range(24))
@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group", "head_dim"),
    [(4, 2, 2, 16), (16, 1, 4, 8), (8, 3, 1, 32)],
)
def test_torch_path_equals_the_reference(seed, block_size, num_kv_heads, group, head_dim):
    step, window, softcap = random_step(
        seed, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim
    )
    got = paged_attention(
        step.q, step.caches[0], step.meta, 0.3, sliding_window=window, softcap=softcap
    )
    want = reference_attention(step, 0.3, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_off_is_bit_identical_to_today():
    step = make_step([1, 5, 1, 7], [40, 0, 3, 19], block_size=4)
    a = paged_attention(step.q, step.caches[0], step.meta, 0.3)
    b = paged_attention(step.q, step.caches[0], step.meta, 0.3, sliding_window=None, softcap=None)
    assert torch.equal(a, b)


def test_window_wider_than_every_context_changes_nothing():
    step = make_step([1, 5, 1, 7], [40, 0, 3, 19], block_size=4)
    a = paged_attention(step.q, step.caches[0], step.meta, 0.3)
    b = paged_attention(step.q, step.caches[0], step.meta, 0.3, sliding_window=500)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_bfloat16_cache_is_close_to_the_reference():
    step = make_step([1, 9, 1, 12], [50, 0, 6, 21], block_size=8, dtype=torch.bfloat16)
    got = paged_attention(step.q, step.caches[0], step.meta, 0.3, sliding_window=7, softcap=5.0)
    want = reference_attention(step, 0.3, 7, 5.0)
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_a_sliding_layer_reads_only_its_window_blocks():
    """Blocks wholly before every query's window are not in the gathered index: poison
    them with NaN and the output stays finite and equal to the reference."""
    bs, window = 4, 6
    step = make_step([1, 5], [41, 30], block_size=bs)
    cache = step.caches[0]
    for table, ctx in zip(step.tables, [41, 30]):
        for lb in range(window_start(ctx, window) // bs):
            cache[:, table[lb]] = float("nan")
    read = step.meta.windowed("decode", window)
    assert read.first_block == [window_start(41, window) // bs] and read.num_blocks == 2
    got = paged_attention(step.q, cache, step.meta, 0.3, sliding_window=window)
    assert torch.isfinite(got).all()
    want = reference_attention(step, 0.3, window, None)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_window_and_softcap_follow_transformers(arch):
    """transformers' own sliding-window mask (create_sliding_window_causal_mask) and
    Gemma 2's eager attention (softcap before the mask), on one 21-token prompt with a
    window of 5: equal to pagewarden's fresh, chunked-over-cache and decode reads."""
    from transformers import Gemma2Config, MistralConfig
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    n, window, softcap, heads, kv_heads, d = 21, 5, 3.0 if arch == "gemma2" else None, 4, 2, 16
    config_cls = Gemma2Config if arch == "gemma2" else MistralConfig
    config = config_cls(
        hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=d, num_hidden_layers=1, sliding_window=window, vocab_size=8,
    )  # fmt: skip
    config._attn_implementation = "eager"
    mask = create_sliding_window_causal_mask(
        config=config,
        inputs_embeds=torch.zeros(1, n, heads * d),
        attention_mask=torch.ones(1, n, dtype=torch.long),
        cache=None,
        position_ids=torch.arange(n)[None],
    )  # (1, 1, n, n) additive
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    module = torch.nn.Module()
    module.num_key_value_groups, module.head_dim = heads // kv_heads, d
    want, _ = eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        mask, scaling=0.25, softcap=softcap,
    )  # fmt: skip
    want = want[0]  # (n, heads, d)
    for q_lens, ctx in (([n], [0]), ([n - 9], [9]), ([1], [n - 1])):
        step = make_step(q_lens, ctx, block_size=4, num_kv_heads=kv_heads, group=heads // kv_heads,
                         head_dim=d)  # fmt: skip
        for p in range(n):  # this prompt's K/V at its positions
            b, o = step.tables[0][p // 4], p % 4
            step.caches[0][0, b, o], step.caches[0][1, b, o] = k[p], v[p]
        step.q.copy_(q[ctx[0] :])
        got = paged_attention(
            step.q, step.caches[0], step.meta, 0.25, sliding_window=window, softcap=softcap
        )
        torch.testing.assert_close(got, want[ctx[0] :], atol=1e-5, rtol=1e-5)


def test_a_replaced_block_index_is_what_a_windowed_read_uses():
    """A fault injector swaps ``meta.block_index`` for one forward call: the windowed
    read built from the old tensor is not reused, the new index is read."""
    step = make_step([1], [40], block_size=4)
    before = paged_attention(step.q, step.caches[0], step.meta, 0.3, sliding_window=6)
    redirected = step.meta.block_index.clone()
    redirected[9] = redirected[2]  # logical block 9 (positions 36..39, in the window)
    step.meta.block_index = redirected
    after = paged_attention(step.q, step.caches[0], step.meta, 0.3, sliding_window=6)
    step.tables[0][9] = step.tables[0][2]
    torch.testing.assert_close(after.double(), reference_attention(step, 0.3, 6, None))
    assert not torch.equal(before, after)


def test_window_and_cap_arguments_are_checked_and_normalised():
    import numpy as np

    from pagewarden.kernels.attention import check_window_args

    assert check_window_args(np.int64(4096), np.float32(50.0)) == (4096, 50.0)
    assert check_window_args(None, None) == (None, None)
    for bad in (0, -3, True, 2.5, "8"):
        with pytest.raises(ValueError, match="sliding_window"):
            check_window_args(bad, None)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            check_window_args(None, bad)
