import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagewarden.kernels.attention import AttentionMetadata
from pagewarden.models.loader import default_model_path, load_model
from pagewarden.models.tokenizer import Tokenizer

BS = 16
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


def greedy(lm, prompt, steps):
    cfg = lm.config
    caches = [
        torch.zeros(2, 8, BS, cfg.num_key_value_heads, cfg.head_dim)
        for _ in range(cfg.num_hidden_layers)
    ]
    table = [3, 6, 1, 5, 2]
    ids, out, ctx = list(prompt), [], 0
    new = ids
    for _ in range(steps):
        sl = [table[p // BS] * BS + p % BS for p in range(ctx, ctx + len(new))]
        meta = AttentionMetadata.build([len(new)], [ctx], [table], sl, BS, "cpu")
        h = lm.model(torch.tensor(new), torch.arange(ctx, ctx + len(new)), caches, meta)
        nxt = int(lm.model.compute_logits(h[-1:]).argmax(-1))
        ctx += len(new)
        out.append(nxt)
        new = [nxt]
    return out


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
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([ids]),
                max_new_tokens=8,
                do_sample=False,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            )[0, len(ids) :].tolist()
        assert greedy(ours, ids, len(want)) == want, text
