import pytest
import torch
from conftest import make_tiny_llama
from transformers import AutoModelForCausalLM

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.models.llama import llama_from_hf
from pagewarden.models.loader import ModelLoadError, load_model

BS = 4


def new_caches(cfg, num_blocks=16):
    return [
        torch.zeros(2, num_blocks, BS, cfg.num_key_value_heads, cfg.head_dim)
        for _ in range(cfg.num_hidden_layers)
    ]


def slots(table, start, n):
    return [table[p // BS] * BS + p % BS for p in range(start, start + n)]


def hf_logits(path, ids):
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


def run_full(lm, ids, table):
    caches = new_caches(lm.config)
    meta = AttentionMetadata.build([len(ids)], [0], [table], slots(table, 0, len(ids)), BS, "cpu")
    h = lm.model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
    return lm.model.compute_logits(h)


def test_full_prompt_matches_transformers(tiny_llama_dir):
    lm = load_model(tiny_llama_dir, torch.float32)
    ids = [5, 17, 99, 3, 250, 7, 8, 9, 11, 400]
    ours = run_full(lm, ids, [5, 2, 7])
    torch.testing.assert_close(ours, hf_logits(tiny_llama_dir, ids), atol=1e-4, rtol=1e-4)


def test_mixed_batch_matches_per_sequence(tiny_llama_dir):
    lm = load_model(tiny_llama_dir, torch.float32)
    g = torch.Generator().manual_seed(1)
    # (context already cached, new tokens this step)
    plan = [(3, 5), (4, 2), (6, 1), (9, 1), (1, 1)]
    seqs = [torch.randint(3, 500, (c + q,), generator=g).tolist() for c, q in plan]
    tables = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10, 11], [12]]
    caches = new_caches(lm.config)
    # Step 1: prefill the cached contexts, all in one batch.
    meta = AttentionMetadata.build(
        [c for c, _ in plan],
        [0] * 5,
        tables,
        sum((slots(t, 0, c) for t, (c, _) in zip(tables, plan)), []),
        BS,
        "cpu",
    )
    ids = sum((s[:c] for s, (c, _) in zip(seqs, plan)), [])
    pos = sum((list(range(c)) for c, _ in plan), [])
    lm.model(torch.tensor(ids), torch.tensor(pos), caches, meta)
    # Step 2: 2 prefill chunks + 3 decodes on top of the cache.
    meta = AttentionMetadata.build(
        [q for _, q in plan],
        [c for c, _ in plan],
        tables,
        sum((slots(t, c, q) for t, (c, q) in zip(tables, plan)), []),
        BS,
        "cpu",
    )
    ids = sum((s[c:] for s, (c, _) in zip(seqs, plan)), [])
    pos = sum((list(range(c, c + q)) for c, q in plan), [])
    logits = lm.model.compute_logits(lm.model(torch.tensor(ids), torch.tensor(pos), caches, meta))
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    start = 0
    for s, (c, q) in zip(seqs, plan):
        with torch.no_grad():
            want = ref(torch.tensor([s])).logits[0, c:]
        torch.testing.assert_close(logits[start : start + q], want, atol=1e-4, rtol=1e-4)
        start += q


def naive_attention(q, cache, query_lens, context_lens, tables, scale):
    """Reference: per sequence, per head, keys read slot by slot, explicit causal mask."""
    n_heads, n_kv = q.shape[1], cache.shape[3]
    flat = cache.view(2, -1, n_kv, cache.shape[4])  # (2, slots, n_kv, D)
    out, start = [], 0
    for ql, cl, table in zip(query_lens, context_lens, tables):
        idx = torch.tensor(slots(table, 0, cl + ql))
        k, v = flat[0][idx].float(), flat[1][idx].float()  # (K, n_kv, D)
        for i in range(ql):
            row = []
            for h in range(n_heads):
                kh, vh = k[: cl + i + 1, h * n_kv // n_heads], v[: cl + i + 1, h * n_kv // n_heads]
                w = torch.softmax(kh @ q[start + i, h].float() * scale, dim=0)  # (keys,)
                row.append(w @ vh)
            out.append(torch.stack(row))
        start += ql
    return torch.stack(out)  # (T, n_heads, D)


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (4, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize(
    "plan",
    [
        [(5, 1), (9, 1), (1, 1), (12, 1)],  # decode, unequal lengths
        [(7, 1), (7, 1), (7, 1)],  # decode, equal lengths (no mask)
        [(8, 1), (8, 1)],  # decode, lengths a multiple of the block size
        [(0, 6), (3, 2), (0, 1), (9, 1)],  # prefill, chunk and decode mixed
        [(0, 5), (0, 5)],  # prefill, equal lengths
        [(0, 3), (4, 1), (0, 5), (0, 3), (2, 4), (6, 1)],  # fresh groups, decodes, chunk
        [(2, 3), (5, 2)],  # chunks over a cached prefix only
    ],
)
@pytest.mark.parametrize("pass_new_kv", [True, False])
def test_paged_attention_matches_naive(n_heads, n_kv, plan, pass_new_kv):
    from pagewarden.kernels.attention import paged_attention, read_new_kv

    g = torch.Generator().manual_seed(3)
    head_dim = 8
    cache = torch.randn(2, 16, BS, n_kv, head_dim, generator=g)
    # Tables may share blocks: nothing is written here, only read.
    tables = [[1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15], [3, 7]][: len(plan)]
    ql, cl = [q for _, q in plan], [c for c, _ in plan]
    t = sum(ql)
    q = torch.randn(t, n_heads, head_dim, generator=g)
    slot_mapping = sum((slots(tb, c, n) for tb, (c, n) in zip(tables, plan)), [])
    meta = AttentionMetadata.build(ql, cl, tables, slot_mapping, BS, "cpu")
    new_kv = read_new_kv(cache, meta.slot_mapping) if pass_new_kv else None
    got = paged_attention(q, cache, meta, 0.3, new_kv=new_kv)
    torch.testing.assert_close(
        got, naive_attention(q, cache, ql, cl, tables, 0.3), atol=1e-5, rtol=1e-5
    )


def test_decode_steps_match_transformers(tiny_llama_dir):
    """Prefill, then decode-only steps with unequal context lengths, token by token."""
    lm = load_model(tiny_llama_dir, torch.float32)
    g = torch.Generator().manual_seed(2)
    lens = [3, 8, 5, 1]
    seqs = [torch.randint(3, 500, (n + 4,), generator=g).tolist() for n in lens]
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    caches = new_caches(lm.config)
    meta = AttentionMetadata.build(
        lens, [0] * 4, tables, sum((slots(t, 0, n) for t, n in zip(tables, lens)), []), BS, "cpu"
    )
    lm.model(
        torch.tensor(sum((s[:n] for s, n in zip(seqs, lens)), [])),
        torch.tensor(sum((list(range(n)) for n in lens), [])),
        caches,
        meta,
    )
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for step in range(4):
        ctx = [n + step for n in lens]
        meta = AttentionMetadata.build(
            [1] * 4, ctx, tables, [slots(t, c, 1)[0] for t, c in zip(tables, ctx)], BS, "cpu"
        )
        assert meta.is_decode
        h = lm.model(
            torch.tensor([s[c] for s, c in zip(seqs, ctx)]), torch.tensor(ctx), caches, meta
        )
        logits = lm.model.compute_logits(h)
        for i, (s, c) in enumerate(zip(seqs, ctx)):
            with torch.no_grad():
                want = ref(torch.tensor([s[: c + 1]])).logits[0, -1]
            torch.testing.assert_close(logits[i], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tie", [False, True])
def test_bf16_weights_float32_compute_matches_native_bf16(tmp_path, tie):
    """Computing in float32 keeps the bf16-rounded weights and the bf16 KV cache."""
    path = make_tiny_llama(tmp_path / "m", tie_word_embeddings=tie)
    native = load_model(path, torch.bfloat16).model
    assert native.use_compute_dtype(torch.bfloat16) == torch.bfloat16
    wide = load_model(path, torch.bfloat16).model
    assert wide.use_compute_dtype(torch.float32) == torch.float32
    assert wide.storage_dtype == torch.bfloat16
    for w in (
        wide.model.layers[0].self_attn.qkv_proj.weight,
        wide.lm_head.weight,
        wide.model.norm.weight,
    ):
        assert w.dtype == torch.float32 and torch.equal(w, w.bfloat16().float())
    ids = [9, 8, 7, 6, 5, 4, 3, 100, 200]
    table = [3, 1, 6]
    meta = AttentionMetadata.build([len(ids)], [0], [table], slots(table, 0, len(ids)), BS, "cpu")
    out = []
    for lm in (native, wide):
        caches = [c.bfloat16() for c in new_caches(lm.config)]
        out.append(lm.compute_logits(lm(torch.tensor(ids), torch.arange(len(ids)), caches, meta)))
        assert caches[0].dtype == torch.bfloat16 and caches[0].abs().sum() > 0
    torch.testing.assert_close(out[1], out[0], atol=0.05, rtol=0.05)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=True),
        dict(num_key_value_heads=1, num_hidden_layers=3),
        dict(num_key_value_heads=4, rope_theta=500.0),
        dict(attention_bias=True),
    ],
)
def test_variants_match_transformers(tmp_path, overrides):
    path = make_tiny_llama(tmp_path / "m", **overrides)
    lm = load_model(path, torch.float32)
    ids = [9, 8, 7, 6, 5, 4, 3, 100, 200]
    torch.testing.assert_close(
        run_full(lm, ids, [3, 1, 6]), hf_logits(path, ids), atol=1e-4, rtol=1e-4
    )


def test_rope_theta_both_spellings():
    base = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    assert (
        llama_from_hf(
            {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
        ).rope_theta
        == 5e5
    )
    assert llama_from_hf({**base, "rope_theta": 1234.0}).rope_theta == 1234.0
    assert llama_from_hf(base).rope_theta == 10000.0
    assert llama_from_hf({**base, "rope_theta": 1234.0}).num_key_value_heads == 2


def test_bad_paths_raise(tmp_path):
    with pytest.raises(ModelLoadError, match="expected"):
        load_model(tmp_path / "nope", torch.float32)
    (tmp_path / "d").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "d", torch.float32)
    (tmp_path / "bad.gguf").write_bytes(b"not gguf")
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_model(tmp_path / "bad.gguf", torch.float32)
