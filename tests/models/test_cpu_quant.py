"""kernels/cpu/quant: the GGUF block decoders and the quantized GEMM against the gguf
package's dequantize followed by a float32 matmul; the default model kept quantized.

Error bound (stated here, asserted below): the kernel multiplies bf16 activations by the
bf16-rounded weights with float32 sums and rounds the output to bf16, so against the
float32 product of the exactly dequantized weights
    max |out - ref| <= 0.01 * max |ref|
(measured about 0.002-0.004 at K = 512: half a bf16 ulp of the output plus bf16 weights);
a wrong decode (a nibble, scale or sign off) gives errors of the order of |ref| itself.
The scalar decoder must match gguf's dequantize bit for bit.

The int8 kernel (``kernel="int8"``) quantizes each block of 32 activations to int8 (scale
max|x| / 127, round to nearest even) and uses the weights exactly, so
    against the same float32 product with x replaced by its int8 rounding (``q8_round``):
        |out - ref| <= |ref| / 256 + 1e-4 * max |ref|   (bf16 output rounding, float32 sums)
    against the float32 product of the bf16 activations:
        max |out - ref| <= 0.03 * max |ref|   (measured 0.3-1.0%, SiLU*up up to 2%)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewarden.kernels.cpu import quant as cpu_quant
from pagewarden.kernels.cpu.quant import KERNEL_TYPES, QuantWeight

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="quant extension not built")

TYPES = {name: code for code, (name, _, _) in KERNEL_TYPES.items()}
BOUND = 0.01


def random_weight(name: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """gguf.quants.quantize of random normals where the package quantizes the type; else
    random bytes with small valid scales (K-quants: every nibble, sub-scale and high bit
    pattern occurs)."""
    rng = np.random.default_rng(seed)
    code = TYPES[name]
    _, per_block, block_bytes = KERNEL_TYPES[code]
    try:
        blocks = gguf.quants.quantize(
            rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType(code)
        )
    except NotImplementedError:
        raw = rng.integers(0, 256, (n, k // per_block, block_bytes), dtype=np.uint8)
        scales = rng.uniform(0.002, 0.02, raw.shape[:2]).astype(np.float16)
        halves = np.frombuffer(scales.tobytes(), np.uint8).reshape(*raw.shape[:2], 2)
        if name == "Q6_K":
            raw[..., 208:210] = halves
        else:  # d, dmin
            raw[..., 0:2] = halves
            raw[..., 2:4] = halves
        blocks = raw.reshape(n, -1)
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks)), code, (n, k))


def reference(w: QuantWeight) -> torch.Tensor:
    arr = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType(w.qtype))
    return torch.from_numpy(np.asarray(arr, dtype=np.float32).reshape(w.shape))


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref).abs().max().item()
    assert err <= BOUND * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("name", sorted(TYPES))
def test_scalar_decoder_matches_gguf_bit_for_bit(name):
    w = random_weight(name, 24, 512)
    assert torch.equal(w.dequantize(), reference(w))


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("m", [1, 3, 9])  # decode-in-register (<= 4 rows) and scratch paths
@pytest.mark.parametrize("portable", [False, True])
def test_gemm_matches_float32_matmul(name, m, portable):
    w = random_weight(name, 40, 512, seed=m)
    ref_w = reference(w)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).bfloat16()
    residual = torch.randn(m, 40, generator=g).bfloat16()
    ref = x.float() @ ref_w.T
    kw = {"portable": portable, "kernel": "bf16"}
    assert_close(cpu_quant.gemm(x, w, **kw), ref)
    assert_close(cpu_quant.gemm(x, w, residual=residual, **kw), ref + residual.float())
    silu = torch.nn.functional.silu(ref[:, :20]) * ref[:, 20:]
    assert_close(cpu_quant.gemm(x, w, silu_mul=True, **kw), silu)
    head = QuantWeight(w.data, w.qtype, w.shape, float_out=True)
    out = cpu_quant.gemm(x, head, **kw)
    assert out.dtype == torch.float32
    # float32 outputs: only bf16 weights and activations remain
    assert (out - ref).abs().max() <= 0.005 * ref.abs().max()


@pytest.fixture
def direct_max_rows():
    """Sets the rows up to which bf16 x decodes in registers (above: quant_tiles.cpp) for
    one test, then restores it."""
    ext = cpu_quant.load()
    old = ext.set_direct_max_rows(4)
    ext.set_direct_max_rows(old)
    yield ext.set_direct_max_rows
    ext.set_direct_max_rows(old)


@pytest.mark.skipif(
    not (cpu_quant.available() and cpu_quant.load().has_vector_kernel()), reason="no AVX512-BF16"
)
@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("m", [2, 5, 17, 70])  # row counts not multiples of the 4-row blocks
def test_tiles_path_is_the_bf16_weight_product(name, m, direct_max_rows):
    """Both bf16-decode paths (in registers; packed tiles decoded once per call) multiply
    by exactly the bf16-rounded dequantized weights: float32 outputs equal the float32
    product of bf16 x and those weights up to summation order (1e-5 of the largest), with
    N = 200 (12.5 tiles of 16: a short tile and a short group), gate/up halves of 100
    and x / residual rows strided. GELU-tanh(gate) * up is fused in the tiles' epilogue
    (``gemv_gated``, the rows a prefill sends there); in registers it is not (None)."""
    n, k = 200, 768
    w = random_weight(name, n, k, seed=m)
    wb = reference(w).bfloat16().float()
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k + 64, generator=g).bfloat16()[:, 32 : 32 + k]
    residual = torch.randn(m, n + 8, generator=g).bfloat16()[:, :n]
    exact = x.float() @ wb.T
    head = QuantWeight(w.data, w.qtype, w.shape, float_out=True)
    outs = []
    for rows in (10**6, 0):  # every call in registers, then every call through tiles
        direct_max_rows(rows)
        out = cpu_quant.gemm(x, head, kernel="bf16")
        assert out.dtype == torch.float32
        assert (out - exact).abs().max() <= 1e-5 * exact.abs().max()
        # bf16 outputs: one rounding of the float32 sum (+ residual)
        with_res = cpu_quant.gemm(x, w, residual=residual, kernel="bf16").float()
        want = exact + residual.float()
        assert ((with_res - want).abs() <= want.abs() / 256 + 1e-5 * want.abs().max()).all()
        outs.append(cpu_quant.gemm(x, w, silu_mul=True, kernel="bf16").float())
        gelu = cpu_quant.gemv_gated(x, w, "gelu_tanh")
        assert (gelu is None) == (rows > 0), rows  # in registers: no fused GELU
    silu = torch.nn.functional.silu(exact[:, :100]) * exact[:, 100:]
    for out in outs:  # SiLU: std::exp in registers, gemm.cpp's polynomial exp in tiles
        assert ((out - silu).abs() <= silu.abs() / 128 + 1e-4 * silu.abs().max()).all()
    want = torch.nn.functional.gelu(exact[:, :100], approximate="tanh") * exact[:, 100:]
    assert gelu is not None and gelu.shape == (m, 100) and gelu.dtype == torch.bfloat16
    assert ((gelu.float() - want).abs() <= want.abs() / 128 + 1e-4 * want.abs().max()).all()


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16 rounded as the int8 kernel rounds it: per block of 32, scale
    max|x| / 127, round to nearest even; returned as float32 q * scale."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # full_like / amax: one division, as the kernel (127.0 / amax is reciprocal(amax) * 127,
    # two roundings: a tie such as 63.5 can then round the other way)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).view(x.shape)


needs_int8 = pytest.mark.skipif(
    not (cpu_quant.available() and cpu_quant.load().has_int8_kernel()),
    reason="no AVX512-VNNI on this CPU",
)


@needs_int8
@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("m", [1, 3, 6])  # one and several groups of 4 rows
def test_int8_gemm_matches_q8_activations_times_float32_weights(name, m):
    w = random_weight(name, 40, 512, seed=m)
    ref_w = reference(w)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g).bfloat16()
    x[0, :32] = 0.0  # an all-zero block: scale 0
    residual = torch.randn(m, 40, generator=g).bfloat16()
    exact = q8_round(x) @ ref_w.T  # what the int8 kernel computes, in float32
    plain = x.float() @ ref_w.T
    top = exact.abs().max()

    def near(out: torch.Tensor, want: torch.Tensor) -> bool:  # bf16 rounding of each output
        return bool(((out.float() - want).abs() <= want.abs() / 256 + 1e-4 * top).all())

    out = cpu_quant.gemm(x, w, kernel="int8")
    assert near(out, exact)
    assert (out.float() - plain).abs().max() <= 0.03 * plain.abs().max()
    out = cpu_quant.gemm(x, w, residual=residual, kernel="int8")
    assert near(out, exact + residual.float())
    silu = torch.nn.functional.silu(exact[:, :20]) * exact[:, 20:]
    assert near(cpu_quant.gemm(x, w, silu_mul=True, kernel="int8"), silu)
    head = cpu_quant.gemm(x, QuantWeight(w.data, w.qtype, w.shape, float_out=True), kernel="int8")
    assert head.dtype == torch.float32
    assert (head - exact).abs().max() <= 1e-4 * top


@needs_int8
@pytest.mark.parametrize("name", sorted(TYPES))
def test_int8_one_row_gemv_matches_the_multi_row_loop_at_odd_shapes(name, monkeypatch):
    """One activation row takes the GEMV of quant_int8_row.h (4 weight rows per pass, 16
    blocks per scale group, blocks in pairs): rows not a multiple of 4, block counts neither
    a multiple of 16 nor even (a lone last block). Same int8 activations and integer products
    as the multi-row loop (PAGEWARDEN_INT8_ROW=0): only the float32 summation order differs."""
    per_block = KERNEL_TYPES[TYPES[name]][1]
    for k in [544, 1056, 64] if per_block == 32 else [256, 768]:
        for n in (1, 6, 42):
            w = random_weight(name, n, k, seed=n + k)
            head = QuantWeight(w.data, w.qtype, w.shape, float_out=True)
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).bfloat16()
            residual = torch.randn(1, n).bfloat16()
            row = cpu_quant.gemm(x, head, kernel="int8")
            row_res = cpu_quant.gemm(x, w, residual=residual, kernel="int8")
            row_silu = cpu_quant.gemm(x, w, silu_mul=True, kernel="int8") if n % 2 == 0 else None
            monkeypatch.setenv("PAGEWARDEN_INT8_ROW", "0")
            loop = cpu_quant.gemm(x, head, kernel="int8")
            loop_res = cpu_quant.gemm(x, w, residual=residual, kernel="int8")
            loop_silu = cpu_quant.gemm(x, w, silu_mul=True, kernel="int8") if n % 2 == 0 else None
            monkeypatch.delenv("PAGEWARDEN_INT8_ROW")
            exact = q8_round(x) @ reference(w).T
            top = exact.abs().max()
            assert row.dtype == torch.float32
            assert (row - loop).abs().max() <= 1e-5 * top, (k, n)
            assert (row - exact).abs().max() <= 0.01 * top, (k, n)  # rare ties of the rounding
            ulp = (loop_res.float().abs() / 128 + 1e-4 * top).max()  # one bf16 step
            assert (row_res.float() - loop_res.float()).abs().max() <= ulp
            if row_silu is not None:
                assert row_silu.shape == (1, n // 2)
                diff = (row_silu.float() - loop_silu.float()).abs()
                assert (diff <= loop_silu.float().abs() / 128 + 1e-4 * top).all()


@needs_int8
def test_auto_kernel_rule_and_refusals():
    w = random_weight("Q4_1", 16, 256)
    ext = cpu_quant.load()
    one = torch.randn(1, 256).bfloat16()
    many = torch.randn(cpu_quant.INT8_MAX_ROWS + 1, 256).bfloat16()
    batch = torch.randn(64, 256).bfloat16()
    assert cpu_quant.pick_kernel(ext, one, w) == "int8"
    assert cpu_quant.pick_kernel(ext, many, w) == "bf16"
    assert cpu_quant.pick_kernel(ext, batch, w) == "bf16"  # prefill in int8 loses "Paris"
    assert cpu_quant.pick_kernel(ext, one.float(), w) == "bf16"
    few = torch.randn(cpu_quant.INT8_DECODE_MIN_ROWS - 1, 256).bfloat16()
    with cpu_quant.decode_batch(True):  # a decode batch: int8 tiles from 5 rows
        assert cpu_quant.pick_kernel(ext, batch, w) == "int8"
        assert cpu_quant.pick_kernel(ext, few, w) == "bf16"
        assert cpu_quant.pick_kernel(ext, batch.float(), w) == "bf16"
        with cpu_quant.decode_batch(False):
            assert cpu_quant.pick_kernel(ext, batch, w) == "bf16"
    assert cpu_quant.pick_kernel(ext, batch, w) == "bf16"
    with pytest.raises(ValueError, match="int8"):
        cpu_quant.gemm(one.float(), w, kernel="int8")
    with pytest.raises(ValueError, match="int8"):
        cpu_quant.gemm(one, w, kernel="int8", portable=True)


def test_float32_activations_use_the_portable_path():
    w = random_weight("Q4_1", 16, 256)
    x = torch.randn(2, 256)
    out = cpu_quant.gemm(x, w)
    assert out.dtype == torch.float32
    ref = x @ reference(w).T
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_weight_shape_is_checked():
    w = random_weight("Q4_1", 4, 64)
    with pytest.raises(ValueError):
        QuantWeight(w.data, w.qtype, (4, 96))
    with pytest.raises(ValueError):
        QuantWeight(w.data, 99, (4, 64))
    with pytest.raises(RuntimeError):  # x's K against the rows' bytes
        cpu_quant.gemm(torch.randn(1, 96).bfloat16(), w)


@pytest.mark.slow
def test_avx2_build_compiles_and_matches():
    ext = cpu_quant.build_avx2()
    assert not ext.has_vector_kernel()
    for name in ("Q4_1", "Q6_K"):
        w = random_weight(name, 24, 512)
        assert torch.equal(ext.dequantize(w.data, w.qtype, 512), reference(w))
        assert not ext.has_int8_kernel() and not ext.has_int8_tiles_kernel()
        for m in (70, 3, 1):  # no int8 GEMV nor int8 tiles in this build: the portable path
            x = torch.randn(m, 512).bfloat16()
            assert_close(cpu_quant.gemm(x, w, ext=ext), x.float() @ reference(w).T)


@pytest.mark.slow
def test_default_model_kept_quantized_matches_dequantized():
    from pagewarden.kernels.attention import AttentionMetadata
    from pagewarden.kernels.cpu import linear as cpu_linear
    from pagewarden.models.loader import load_model

    q = load_model(None, torch.bfloat16, "gguf")
    d = load_model(None, torch.bfloat16, "none")
    model = q.model
    assert cpu_linear.quant_weight(model.lm_head).type_name == "Q8_0"  # tied embedding
    layer = model.model.layers[0]
    assert cpu_linear.quant_weight(layer.self_attn.qkv_proj).type_name == "Q4_1"
    assert cpu_linear.quant_weight(layer.mlp.gate_up_proj).shape == (3072, 576)
    assert layer.mlp.gate_up_proj.weight.numel() == 0  # no dense copy kept
    dense = dict(d.model.named_modules())
    for name, module in model.named_modules():
        qw = cpu_linear.quant_weight(module)
        if qw is not None and name != "lm_head":  # the same bf16 weights, rows in order
            assert torch.equal(qw.dequantize().bfloat16(), dense[name].weight), name

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = q.tokenizer.encode(q.tokenizer.apply_chat_template(msgs))
    cfg, bs = q.config, 16
    caches = [
        torch.zeros(2, 8, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
        for _ in range(cfg.num_hidden_layers)
    ]
    table, out, ctx, new = [3, 6, 1, 5, 2], [], 0, list(ids)
    for _ in range(8):  # greedy, prefill then decode steps
        sl = [table[p // bs] * bs + p % bs for p in range(ctx, ctx + len(new))]
        meta = AttentionMetadata.build([len(new)], [ctx], [table], sl, bs, "cpu")
        h = model(torch.tensor(new), torch.arange(ctx, ctx + len(new)), caches, meta)
        nxt = int(model.compute_logits(h[-1:]).argmax(-1))
        ctx += len(new)
        out.append(nxt)
        new = [nxt]
    assert "Paris" in q.tokenizer.decode(out)


@pytest.mark.slow
def test_llm_with_gguf_quantization_answers_greedy_chat():
    """End to end through the engine: ``LLM(quantization="gguf")`` on the default model."""
    from pagewarden import LLM
    from pagewarden.kernels.cpu import linear as cpu_linear
    from pagewarden.sampling_params import SamplingParams

    llm = LLM(quantization="gguf", kv_cache_memory="64MiB", device="cpu")
    assert llm.config.resolved_quantization == "gguf"
    model = llm.engine.loaded.model
    assert cpu_linear.quant_weight(model.model.layers[0].self_attn.qkv_proj) is not None
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0.0))
    assert "Paris" in out[0].outputs[0].text


@needs_int8
def test_gguf_decode_batches_use_int8_and_prefill_stays_bf16(monkeypatch):
    """Six greedy chats at once under ``quantization="gguf"``: the prefill's many-row
    GEMMs run the bf16-decode kernel, the six-row decode steps the int8 tiles, and every
    answer is still right (int8-rounded prefill activations lose "Paris"). The lm_head's
    rows (one per sequence, the next token's) take the int8 tiles in every step, the
    prefill's too (not the whole vocabulary decoded to bf16 tiles for six rows)."""
    from pagewarden import LLM
    from pagewarden.sampling_params import SamplingParams

    picks: list[tuple[int, int, str]] = []
    pick = cpu_quant.pick_kernel

    def spy(ext, x, w):
        kernel = pick(ext, x, w)
        picks.append((x.shape[0], w.shape[0], kernel))
        return kernel

    monkeypatch.setattr(cpu_quant, "pick_kernel", spy)
    llm = LLM(quantization="gguf", kv_cache_memory="64MiB", device="cpu")
    msgs = [[{"role": "user", "content": "What is the capital of France?"}]] * 6
    outs = llm.chat(msgs, SamplingParams(max_tokens=12, temperature=0.0))
    assert all("Paris" in o.outputs[0].text for o in outs)
    assert ("int8" in {k for rows, _, k in picks if rows == 6}) and all(
        k == "bf16" for rows, _, k in picks if rows > 6
    )
    vocab = llm.get_tokenizer().vocab_size
    heads = [k for rows, n, k in picks if n == vocab]
    assert heads and set(heads) == {"int8"}


def test_fused_shards_of_mixed_types_stay_quantized_as_row_runs():
    """Q4_K_M files mix types within q/k/v (Gemma 3 270M: v in Q8_0, q/k in Q5_0): such a
    fused layer stays quantized as a QuantRows (q and k concatenated, v its own run), whose
    GEMM is each run's GEMM side by side (residual split by columns; no fused SiLU*up); a
    fused layer that also got a dense shard is decoded into its dense parameter."""
    from pagewarden.models.quantized import densify_mixed

    q, k, v = (
        random_weight(n, r, 256, s)
        for s, (n, r) in enumerate([("Q5_0", 16), ("Q5_0", 12), ("Q8_0", 12)])
    )
    rows = cpu_quant.QuantRows.of([q, k, v])
    assert isinstance(rows, cpu_quant.QuantRows) and rows.shape == (40, 256)
    assert [p.type_name for p in rows.parts] == ["Q5_0", "Q8_0"]
    assert rows.nbytes == q.nbytes + k.nbytes + v.nbytes
    assert torch.equal(rows.dequantize(), torch.cat([reference(w) for w in (q, k, v)]))
    assert isinstance(cpu_quant.QuantRows.of([q, k]), QuantWeight)
    for m in (1, 3):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
        residual = torch.randn(m, 40).bfloat16()
        qk = QuantWeight.cat([q, k])
        for kwargs, cols in (({}, (0, 28, 40)), ({"residual": residual}, (0, 28, 40))):
            got = cpu_quant.gemm(x, rows, **kwargs)
            for part, a, b in ((qk, cols[0], cols[1]), (v, cols[1], cols[2])):
                res = {"residual": residual[:, a:b]} if kwargs else {}
                assert torch.equal(got[:, a:b], cpu_quant.gemm(x, part, **res)), (m, kwargs)
        with pytest.raises(ValueError, match="silu_mul"):
            cpu_quant.gemm(x, rows, silu_mul=True)

    qkv = torch.nn.Parameter(torch.zeros(40, 256, dtype=torch.bfloat16), requires_grad=False)
    shards = {"a.qkv_proj.weight": [(2, v), (0, q)], "b.qkv_proj.weight": [(2, v), (0, q), (1, k)]}
    params = {"a.qkv_proj.weight": qkv, "b.qkv_proj.weight": qkv.clone()}
    densify_mixed(params, shards, {"a.qkv_proj.weight"}, {"qkv_proj": [16, 12, 12]})
    assert list(shards) == ["b.qkv_proj.weight"]  # a: k was dense, the rest decoded into it
    assert torch.equal(qkv[:16], reference(q).bfloat16())
    assert torch.equal(qkv[28:], reference(v).bfloat16())
