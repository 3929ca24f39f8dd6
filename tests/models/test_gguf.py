import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagewarden.models.loader import default_model_path, load_model
from pagewarden.models.tokenizer import Tokenizer
from tests.models.paged_greedy import hf_generate_greedy, paged_greedy

TEXTS = [
    "Hello world",
    "naïve café 日本語 🙂🚀",
    "x = 12345 + 67.89\n\tdef f(a, b):\n    return a**2",
    "  leading spaces and\nnewlines\r\n",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def ours():
    return load_model(default_model_path(), torch.float32)


@pytest.mark.slow
def test_tokenizer_matches_transformers(ours):
    p = default_model_path()
    ref = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    tok: Tokenizer = ours.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == ref(text).input_ids, text
        assert tok.decode(tok.encode(text)) == ref.decode(
            ref(text).input_ids, skip_special_tokens=True
        )
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and 2 in tok.eos_token_ids
    assert tok.vocab_size == 49152
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_greedy_matches_transformers(ours):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF")
    p = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(
        p.parent, gguf_file=p.name, dtype=torch.float32
    ).eval()
    tok = ours.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}])
        for q in ["What is the capital of France?", "Write a haiku about the sea."]
    ] + ["The three primary colors are"]
    for text in prompts:
        ids = tok.encode(text)
        want = hf_generate_greedy(ref, ids, 8)
        assert paged_greedy(ours.model, ids, len(want)) == want, text


def test_open_gguf_equals_gguf_reader(tmp_path):
    """The loader's reader (metadata by read_metadata_section, tensors by gguf's reader)
    sees the same metadata, tensor table and tensor bytes as `gguf.GGUFReader`, with a
    non-default alignment and quantized tensors; a cut file is a ValueError."""
    import gguf
    import numpy as np

    from pagewarden.models.gguf_tensors import open_gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 64)
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "ünï", "日本"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.25, -3.0])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((7,)).astype(np.float16))
    q8 = gguf.quants.quantize(
        rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    w.add_tensor("c.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    meta, reader = open_gguf(path)
    want = gguf.GGUFReader(str(path))
    assert meta == {k: f.contents() for k, f in want.fields.items() if not k.startswith("GGUF.")}
    assert reader.alignment == want.alignment == 64
    assert reader.data_offset == want.data_offset
    assert [t.name for t in reader.tensors] == ["a.weight", "b.weight", "c.weight"]
    for got, ref in zip(reader.tensors, want.tensors, strict=True):
        assert (got.name, got.tensor_type, got.data_offset) == (
            ref.name,
            ref.tensor_type,
            ref.data_offset,
        )
        assert got.shape.tolist() == ref.shape.tolist()
        np.testing.assert_array_equal(got.data, ref.data)
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:40])
    with pytest.raises(ValueError):
        open_gguf(tmp_path / "cut.gguf")


def test_loading_a_gguf_imports_neither_triton_nor_numba():
    # A fresh interpreter: other tests import Triton. Building the model on the meta
    # device with nn.init's random fills once pulled in torch._dynamo and with it Triton
    # (~67 MiB resident); numba's LLVM (~71 MiB) came with the CPU checksums, which the
    # engine runs while it is built (integrity "standard"): they are C++ now
    # (kernels/cpu/checksum.cpp), and the whole engine is built here.
    code = (
        "import sys, torch\n"
        "from pagewarden import LLM\n"
        "from pagewarden.worker import integrity_cpu\n"
        "llm = LLM(model=None, kv_cache_memory='16MiB', quantization='gguf')\n"
        "print(integrity_cpu.available())\n"
        "print(sorted(m for m in ('triton', 'numba', 'llvmlite') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    lines = out.stdout.strip().splitlines()
    assert lines[-2:] == ["True", "[]"], out.stderr[-2000:]


def test_auto_keeps_quantized_only_where_the_fast_kernels_build(monkeypatch, caplog):
    """auto (the default) dequantizes on a CPU without the AVX512-BF16 / VNNI paths (and
    says so), and where nothing builds; gguf forces the portable path, or fails."""
    import logging

    from pagewarden.kernels.cpu import quant as cpu_quant
    from pagewarden.models.gguf_weights import QuantizationError, keep_quantized

    class Ext:
        def __init__(self, fast: bool) -> None:
            self.fast = fast

        def has_vector_kernel(self) -> bool:
            return True

        def has_int8_kernel(self) -> bool:
            return self.fast

    caplog.set_level(logging.INFO, logger="pagewarden.models.gguf_weights")
    monkeypatch.setattr(cpu_quant, "load", lambda: Ext(True))
    assert keep_quantized("auto") and keep_quantized("gguf") and not keep_quantized("none")
    assert "kept quantized" in caplog.text
    monkeypatch.setattr(cpu_quant, "load", lambda: Ext(False))
    assert not keep_quantized("auto") and keep_quantized("gguf")
    assert "VNNI" in caplog.text
    monkeypatch.setattr(cpu_quant, "load", lambda: None)
    assert not keep_quantized("auto")
    with pytest.raises(QuantizationError, match="cannot build"):
        keep_quantized("gguf")
