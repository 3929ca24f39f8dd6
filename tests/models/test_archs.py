"""Every architecture end to end: greedy token ids equal transformers' float32 greedy on a
tiny random checkpoint, through the engine (chunked prefill, prefix-cache hits,
preemption), from an HF directory (sharded too) and from a GGUF, on prompts longer than
the sliding window; and what is not implemented is refused at load."""

from __future__ import annotations

import json

import pytest
import torch

from pagewarden import LLM
from pagewarden.kernels.attention import TorchAttention
from pagewarden.models.loader import ModelLoadError, load_model
from tests.engine.test_llm_vs_hf import hf_greedy, random_prompts, run_engine
from tests.models.tiny_models import ARCHS, WINDOW, make_tiny, write_gguf

MAX_TOKENS = 8
# Models whose layers need sliding windows or soft-capping: the C++ and Triton kernels
# take neither yet, so these run on the torch path whatever backend is asked for.
# Checkpoints a GGUF can express: llama.cpp's qwen2 has no sliding window, and Gemma's
# GGUFs carry no query_pre_attn_scalar (llama.cpp uses head_dim).
GGUF_OVERRIDES = {
    "qwen2": dict(use_sliding_window=False),
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3": dict(query_pre_attn_scalar=16),
}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    """(arch, HF dir, prompts, transformers' greedy tokens for them)."""
    arch = request.param
    path = make_tiny(arch, tmp_path_factory.mktemp(arch))
    prompts = random_prompts(3, 512, 3 * WINDOW, 4 * WINDOW, seed=7)
    prompts.append(list(prompts[0]))  # the same prompt again: a prefix-cache hit
    return arch, path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


def _engine(model, backend: str, **kw) -> LLM:
    args = dict(
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=24,  # 4 prompts of up to 40 tokens: preemption
        max_num_batched_tokens=7,  # chunked prefill
        attention_backend=backend,
    )
    return LLM(model=str(model), **{**args, **kw})


def test_engine_matches_transformers(tiny):
    arch, path, prompts, want = tiny
    llm = _engine(path, "torch")
    assert run_engine(llm, prompts, MAX_TOKENS) == want, arch
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_cpu_backend_matches_transformers(tiny):
    """The default CPU backend, sliding windows and soft-capping included (C++ kernels)."""
    from pagewarden.kernels.cpu.attention import CpuAttention

    arch, path, prompts, want = tiny
    llm = _engine(path, "cpu", num_kv_blocks=64)
    ops = llm.engine.runner.model.model.layers[0].self_attn.ops
    assert isinstance(ops, CpuAttention), arch
    assert run_engine(llm, prompts, MAX_TOKENS) == want, arch


def test_gguf_matches_transformers(tiny, tmp_path):
    """The same weights written as llama.cpp writes them, loaded from the GGUF."""
    arch, path, prompts, want = tiny
    if arch in GGUF_OVERRIDES:  # a checkpoint the GGUF format can express
        path = make_tiny(arch, tmp_path / arch, **GGUF_OVERRIDES[arch])
        want = hf_greedy(path, prompts, MAX_TOKENS)
    gguf_path = write_gguf(path, tmp_path / f"{arch}.gguf")
    llm = _engine(gguf_path, "torch", num_kv_blocks=64)
    assert run_engine(llm, prompts, MAX_TOKENS) == want, arch


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3"])
def test_sharded_hf_dir(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from pagewarden.kernels.attention import AttentionMetadata

    path = make_tiny(arch, tmp_path / arch, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 2
    lm = load_model(path, torch.float32)
    ids = random_prompts(1, 512, 20, 20, seed=3)[0]
    cfg = lm.config
    caches = [
        torch.zeros(2, 8, 4, cfg.num_key_value_heads, cfg.head_dim)
        for _ in range(cfg.num_hidden_layers)
    ]
    table = [3, 1, 6, 2, 7]
    meta = AttentionMetadata.build(
        [20], [0], [table], [table[p // 4] * 4 + p % 4 for p in range(20)], 4
    )
    ours = lm.model.compute_logits(lm.model(torch.tensor(ids), torch.arange(20), caches, meta))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "arch,changes,match",
    [
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("llama", {"hidden_act": "gelu"}, "gelu"),
        ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "not supported"),
        ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}, "Gemma3ForCausalLM"),
        ("qwen2", {"layer_types": ["chunked_attention"] * 3}, "chunked_attention"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, arch, changes, match):
    path = make_tiny(arch, tmp_path / arch)
    _edit_config(path, **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_model(path, torch.float32)


def test_kernels_without_window_are_refused(tmp_path):
    """A backend whose attend takes no sliding_window is refused, and nothing changes."""
    from pagewarden.kernels.backend import AttentionBackendError

    class NoWindow:
        fused_reads = False

        def write_kv(self, cache, k, v, meta):
            raise AssertionError

        def attend(self, q, cache, meta, scale, new_kv=None):
            raise AssertionError

    lm = load_model(make_tiny("mistral", tmp_path / "m"), torch.float32).model
    with pytest.raises(AttentionBackendError, match="sliding_window"):
        lm.set_attention_ops(NoWindow())
    assert all(isinstance(layer.self_attn.ops, TorchAttention) for layer in lm.model.layers)


def test_masked_attention_matches_naive():
    """The torch path's window and softcap against a per-token loop."""
    from pagewarden.kernels.attention import AttentionMetadata, paged_attention

    g = torch.Generator().manual_seed(0)
    bs, n_heads, n_kv, d, window, cap = 4, 4, 2, 8, 5, 2.0
    cache = torch.randn(2, 16, bs, n_kv, d, generator=g)
    plan = [(0, 9), (6, 3), (11, 1)]  # (cached, new)
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]
    ql, cl = [q for _, q in plan], [c for c, _ in plan]
    slots = [t[p // bs] * bs + p % bs for t, (c, n) in zip(tables, plan) for p in range(c, c + n)]
    meta = AttentionMetadata.build(ql, cl, tables, slots, bs)
    q = torch.randn(sum(ql), n_heads, d, generator=g)
    got = paged_attention(q, cache, meta, 0.3, sliding_window=window, softcap=cap)
    flat = cache.view(2, -1, n_kv, d)
    rows, t = [], 0
    for table, (c, n) in zip(tables, plan):
        idx = torch.tensor([table[p // bs] * bs + p % bs for p in range(c + n)])
        k, v = flat[0][idx], flat[1][idx]  # (K, n_kv, D)
        for i in range(n):
            pos, heads = c + i, []
            for h in range(n_heads):
                lo = max(0, pos - window + 1)
                s = k[lo : pos + 1, h // 2] @ q[t, h] * 0.3
                w = torch.softmax(torch.tanh(s / cap) * cap, dim=0)
                heads.append(w @ v[lo : pos + 1, h // 2])
            rows.append(torch.stack(heads))
            t += 1
    torch.testing.assert_close(got, torch.stack(rows), atol=1e-5, rtol=1e-5)


def test_hub_style_configs():
    """Configs as published (transformers 4 spellings) parse to the same features."""
    from pagewarden.models.gemma import gemma3_from_hf
    from pagewarden.models.phi3 import phi3_from_hf
    from pagewarden.models.qwen import qwen2_from_hf

    gemma3 = gemma3_from_hf(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": 262144,
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "hidden_activation": "gelu_pytorch_tanh",
        }
    )
    assert gemma3.layer_types is not None and gemma3.layer_types[5] == "full_attention"
    assert gemma3.layer_types.count("sliding_attention") == 15
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    assert dict(gemma3.rope_scaling or ()) == {"rope_type": "linear", "factor": 8.0}
    assert gemma3.tie_word_embeddings and gemma3.hidden_act == "gelu_tanh"
    phi3 = phi3_from_hf(
        {
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
            "sliding_window": 262144,
        }
    )
    scaling = dict(phi3.rope_scaling or ())
    assert scaling["rope_type"] == "longrope" and scaling["factor"] == 32.0
    assert phi3.max_position_embeddings == 4096 and phi3.sliding_window == 262144
    qwen = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_attention_heads=2)
    qwen25 = qwen2_from_hf(
        {**qwen, "num_hidden_layers": 4, "use_sliding_window": False, "sliding_window": 32768}
    )
    assert qwen25.sliding_window is None and qwen25.attention_bias and not qwen25.o_proj_bias
    windowed = qwen2_from_hf(
        {
            **qwen,
            "num_hidden_layers": 4,
            "use_sliding_window": True,
            "sliding_window": 16,
            "max_window_layers": 2,
        }
    )
    assert windowed.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2
