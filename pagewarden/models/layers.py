"""The blocks every decoder family is built from: RMSNorm (Gemma's (1 + w) too), RoPE
tables (default, linear, llama3, longrope, GGUF frequency factors), the gated MLP (SiLU
or GELU-tanh), the attention layer that calls ``AttentionOps`` (q/k norms, biases,
per-layer sliding window, soft-capping, ``query_pre_attn_scalar``) and the pre-norm
decoder layer. They compute through ``kernels/cpu`` (packed GEMMs, fused RMSNorm incl.
q/k norms in place, RoPE, and SiLU*mul or GELU-tanh*mul, in bf16 inside the gate_up GEMM)
where those kernels apply, plain torch elsewhere.

Per-token code reads its submodules through plain references taken at construction
(``_blocks``, ``_qkv_proj``) and calls ``forward`` directly: nn.Module's ``__getattr__``
and ``__call__`` (hook checks this engine never needs) cost about a microsecond each, and
a one-token decode step makes hundreds of them. Submodules are never reassigned after
construction; parameters are read through the modules (``to_empty`` replaces them).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagewarden.kernels.attention import AttentionMetadata, AttentionOps, TorchAttention
from pagewarden.kernels.cpu import fused as cpu_fused
from pagewarden.kernels.cpu.linear import linear, linear_add, linear_gated
from pagewarden.models.config import ModelConfig, Scaling, UnsupportedModelError, rope_type


class RMSNorm(nn.Module):
    """RMSNorm scaling by ``offset + weight`` (Gemma: offset 1), in float32, rounded once
    to x's dtype. ``weight`` holds the checkpoint's value; ``prepare`` (called whenever
    the weights change dtype) precomputes ``offset + weight`` in float32, as Gemma's norm
    computes it."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset
        self.scale: torch.Tensor | None = None  # offset + weight, float32 (offset != 0)

    def prepare(self) -> None:
        if self.offset:
            self.scale = self.offset + self.weight.detach().float()

    def factor(self) -> torch.Tensor:
        """What x's normalised rows are multiplied by: weight, or offset + weight in float32."""
        if not self.offset:
            return self._parameters["weight"]  # self.weight, without Module.__getattr__
        if self.scale is None:
            self.prepare()
        assert self.scale is not None
        return self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_fused.rms_norm(x, self.factor(), self.eps)  # one C++ pass on the CPU

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the norm rounded before the add (fused on the CPU)."""
        return cpu_fused.rms_norm_add(x, self.factor(), residual, self.eps)


def _f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device="cpu")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Scaling | None, long: bool = False
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim / 2,), cos/sin factor) of a RoPE with ``scaling``
    (``config.ROPE_TYPES``); ``long`` picks longrope's long factors over its short ones."""
    # On the CPU explicitly: models are built under torch.device("meta").
    even = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / (theta ** (even / head_dim))
    s = dict(scaling or ())
    kind = rope_type(scaling)
    mscale = 1.0
    if kind == "llama3":
        factor = s["factor"]
        low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / low) & (wavelen >= old / high)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / s["factor"]
    elif kind == "freq_factors":  # GGUF rope_freqs: llama.cpp divides theta_i by factor i
        inv = inv / _f64(s["factors"])
    elif kind == "longrope":
        return _longrope_inv_freq(head_dim, theta, s, long)
    elif kind != "default":
        raise UnsupportedModelError(f"rope_type {kind!r} is not supported")
    return inv.float(), float(mscale)


def _longrope_inv_freq(
    head_dim: int, theta: float, s: dict, long: bool
) -> tuple[torch.Tensor, float]:
    """longrope (Phi-3 ``su``) as transformers computes it, in float32: theta_i divided by
    the short or long factor i; cos/sin times ``attention_factor``, by default
    sqrt(1 + ln(factor) / ln(original)) (both factor sets use the same one)."""
    old = s["original_max_position_embeddings"]
    cpu = torch.device("cpu")  # models are built under torch.device("meta")
    factors = torch.tensor(s["long_factor" if long else "short_factor"], device=cpu)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim
    inv = 1.0 / (factors * theta**shape)
    mscale = s.get("attention_factor")
    factor = s.get("factor") or 1.0
    if mscale is None:
        mscale = math.sqrt(1 + math.log(factor) / math.log(old)) if factor > 1.0 else 1.0
    return inv, float(mscale)


class RopeTable:
    """cos and signed sin (n, head_dim) of one RoPE, built once and grown on demand.

    longrope has a short and a long factor set. transformers picks one for a whole
    forward pass from the sequence's length (short while it is at most the original
    context O, long past it) and recomputes every position when a sequence grows past O.
    So the table holds both sets, rows ``[0, n)`` short and ``[n, 2n)`` long, and each
    token says which it uses (``lookup``'s ``long``); the scheduler restarts a request
    that grows past O (``Scheduler._restart_past_rope_switch``), so its cached keys are
    never a mix of the two. Positions past the context given to ``select_context`` (until
    then, O) are refused.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Scaling | None) -> None:
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.inv_freq, self.mscale = rope_inv_freq(head_dim, theta, scaling)
        self.long_inv_freq: torch.Tensor | None = None
        self.original: int | None = None  # longrope's O
        self.limit: int | None = None  # positions past it are refused (longrope)
        if rope_type(scaling) == "longrope":
            self.long_inv_freq = rope_inv_freq(head_dim, theta, scaling, long=True)[0]
            self.original = self.limit = dict(scaling or ())["original_max_position_embeddings"]
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows = 0  # positions per factor set in _table

    def reset(self) -> None:
        self._table = None

    def select_context(self, max_model_len: int) -> int | None:
        """Serve contexts up to ``max_model_len``; return the sequence length past which
        a request uses longrope's long factors (None: every request uses one set).
        ``UnsupportedModelError`` past longrope's extended context."""
        if self.original is None:
            return None
        most = dict(self.scaling or ())["max_position_embeddings"]
        if max_model_len > most:
            raise UnsupportedModelError(
                f"max_model_len={max_model_len} is past this longrope model's "
                f"max_position_embeddings ({most})"
            )
        self.limit = max_model_len
        self._table = None
        return self.original if max_model_len > self.original else None

    def lookup(
        self,
        positions: torch.Tensor,
        size: int,
        dtype: torch.dtype,
        device: torch.device,
        long: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed (T, 1, head_dim) for ``positions`` (T,) (see ``apply_rope``);
        ``long`` (T,) bool picks longrope's long factors for those tokens."""
        need = int(positions.max()) + 1
        if self.limit is not None and need > self.limit:
            raise UnsupportedModelError(
                f"position {need - 1} is past the context this longrope table was "
                f"selected for ({self.limit}, see RopeTable.select_context)"
            )
        if long is not None and self.long_inv_freq is None:
            raise UnsupportedModelError("long factors asked of a RoPE without them")
        if self._table is None or self._rows < need or self._table[0].dtype != dtype:
            self._rows = max(need, size)
            self._table = self._build(self._rows, dtype, device)
        cos_t, sin_t = self._table
        rows = positions
        if long is not None:  # rows [0, n): short factors; [n, 2n): long
            rows = positions + long.to(positions.dtype) * self._rows
        return cos_t.index_select(0, rows).unsqueeze(1), sin_t.index_select(0, rows).unsqueeze(1)

    def _build(
        self, n: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) (n, D), or (2n, D) with the long set's rows after the short's."""
        positions_f = torch.arange(n, dtype=torch.float32, device="cpu")
        sets = (
            [self.inv_freq] if self.long_inv_freq is None else [self.inv_freq, self.long_inv_freq]
        )
        freqs = torch.cat([torch.outer(positions_f, f) for f in sets])  # (n * sets, D/2)
        cos, sin = freqs.cos() * self.mscale, freqs.sin() * self.mscale
        return (
            torch.cat((cos, cos), dim=-1).to(device, dtype),
            torch.cat((-sin, sin), dim=-1).to(device, dtype),
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (T, H, D); cos, sin_signed (T, 1, D) from ``RopeTable``.

    rotate_half(x) = [-x2, x1] is x with its halves swapped (one flip of a (2, D/2)
    view) times [-1, +1], and that sign is folded into ``sin_signed`` = [-sin, +sin].
    Where the fused CPU op runs, x itself is rotated in place and returned; otherwise x
    is left as it was and a new tensor returned (see ``cpu_fused.rope``): use the result.
    """
    return cpu_fused.rope(x, cos, sin_signed)


def compute_dtype_for(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a model loaded in `dtype` computes in on `device`.

    CPUs without native bf16/fp16 GEMM kernels (oneDNN's check: no AVX512 core, AMX or
    equivalent) run bf16 GEMMs through a reference path 10-20x slower than float32. There
    the model computes in float32, as llama.cpp does with BF16 weights on such CPUs: the
    weights keep exactly their `dtype`-rounded values and the KV cache stays in `dtype`.
    """
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return dtype
    if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return dtype
    return torch.float32


class Attention(nn.Module):
    """Self-attention of one layer over its paged KV cache (fused q/k/v projection)."""

    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(
            c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.o_proj_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset) if c.qk_norm else None
        # Plain references (module docstring); the projection not registered twice.
        self.__dict__["_qkv_proj"] = self.qkv_proj
        self._qk_norms = (self.q_norm, self.k_norm) if c.qk_norm else None
        self.scale = (c.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = c.layer_window(layer)
        self.softcap = c.attn_logit_softcapping
        # Which of the model's RoPE tables rotates this layer (1: the sliding layers' own).
        self.rope_index = 1 if self.sliding_window and c.local_rope_theta is not None else 0
        # The ``attend`` keywords of this layer (none where it uses neither).
        self.features: dict[str, int | float] = {}
        if self.sliding_window is not None:
            self.features["sliding_window"] = self.sliding_window
        if self.softcap is not None:
            self.features["softcap"] = self.softcap
        self.ops: AttentionOps = TorchAttention()  # the worker may pick another backend

    def forward(self, x, cos, sin, cache, meta: AttentionMetadata) -> torch.Tensor:
        """Attention output (T, n_heads * D), before o_proj (the layer adds the residual)."""
        qkv = linear(self._qkv_proj, x)  # (T, q_size + 2 * kv_size)
        return self.attend_qkv(qkv, cos, sin, cache, meta)

    def attend_qkv(self, qkv, cos, sin, cache, meta: AttentionMetadata) -> torch.Tensor:
        """``forward`` from the projected qkv (T, q_size + 2 * kv_size) on (q/k norms,
        RoPE, K/V written, attention); qkv may be changed in place."""
        t, d = qkv.shape[0], self.head_dim
        if self._qk_norms is not None:  # per head, in place where fused
            q_norm, k_norm = self._qk_norms
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.n_heads + self.n_kv, d)
            normed = cpu_fused.rms_norm_heads(
                qk, q_norm.factor(), k_norm.factor(), self.n_heads, q_norm.eps
            )
            if normed is not qk:  # the torch path's copy: back into qkv, which goes on
                qk.copy_(normed)
        features = self.features  # only what this layer needs: every backend takes a plain call
        fused = getattr(self.ops, "rope_write_decode", None)
        if fused is not None:  # RoPE, write_kv and attend in one call where it applies
            out = fused(qkv, cos, sin, cache, meta, self.scale, **features)
            if out is not None:
                return out  # (T, n_heads * D)
        # q and k are adjacent columns: one RoPE call rotates both.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.n_heads + self.n_kv, d)
        q, k = apply_rope(qk, cos, sin).split([self.n_heads, self.n_kv], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.n_kv, d)  # (T, n_kv, D)
        self.ops.write_kv(cache, k, v, meta)
        out = self.ops.attend(q, cache, meta, self.scale, new_kv=(k, v), **features)
        return out.reshape(t, self.q_size)  # (T, n_heads * D)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one [gate; up] projection."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.activation = c.hidden_act  # "silu" | "gelu_tanh"
        self._projs = (self.gate_up_proj, self.down_proj)  # plain references (docstring)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up (T, intermediate), before down_proj: fused into the gate_up GEMM
        where kernels/cpu/linear can (GELU-tanh as torch's approximate="tanh")."""
        return linear_gated(self._projs[0], x, self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self._projs[1], self.act(x))


class DecoderLayer(nn.Module):
    """Pre-norm layer (Llama, Mistral, Qwen, Phi-3): x + attn(norm(x)), then x + mlp(norm(x)),
    the residual adds fused into o_proj's and down_proj's GEMMs."""

    decode_chain_kind = "pre_norm"  # what models/decode_chain.py runs it as (this class only)

    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        self.self_attn = Attention(c, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        self.mlp = GatedMLP(c)
        self._blocks = (  # plain references (module docstring)
            self.input_layernorm, self.self_attn, self.self_attn.o_proj,
            self.post_attention_layernorm, self.mlp, self.mlp.down_proj,
        )  # fmt: skip

    def forward(self, x, cos, sin, cache, meta) -> torch.Tensor:
        norm, attn, o_proj, post_norm, mlp, down_proj = self._blocks
        a = attn.forward(norm.forward(x), cos, sin, cache, meta)  # (T, q_size)
        x = linear_add(o_proj, a, x)  # (T, hidden)
        return linear_add(down_proj, mlp.act(post_norm.forward(x)), x)
