"""--chat-template replaces the model's template (serve, chat, generate, LLM) and a chat
request's chat_template_kwargs reach the template."""

from __future__ import annotations

import httpx
import pytest
from test_api import MODEL, _Running

from pagewarden.cli import build_parser
from pagewarden.engine.args import engine_config
from pagewarden.engine.async_engine import AsyncEngine
from pagewarden.engine.config import EngineConfig, EngineConfigError

TEMPLATE = (
    "{{ prefix | default('') }}{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>{% endif %}"
)


def test_flag_on_every_command(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    parser = build_parser()
    for argv in (["serve"], ["chat"], ["generate", "hi"]):
        args = parser.parse_args([*argv, "--chat-template", str(f)])
        assert engine_config(args).chat_template == str(f)
    bare = parser.parse_args(["generate", "hi", "--chat-template", "--temperature", "0"])
    assert bare.chat_template == "" and engine_config(bare).chat_template is None
    assert parser.parse_args(["generate", "hi"]).chat_template is None
    with pytest.raises(EngineConfigError, match="no such file"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    cfg = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=256,
        chat_template=TEMPLATE,
    )
    s = _Running(AsyncEngine(cfg))
    yield s
    s.stop()


def _prompt_tokens(url: str, **extra) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        **extra,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_override_and_chat_template_kwargs(srv):
    tok = srv.engine.tokenizer
    assert tok.chat_template == TEMPLATE
    plain = _prompt_tokens(srv.url)
    assert plain == len(tok.encode("<|im_start|>hi<|im_end|><|im_start|>", False))
    prefixed = _prompt_tokens(srv.url, chat_template_kwargs={"prefix": "a b c d"})
    assert prefixed == plain + len(tok.encode("a b c d", False))
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={**bad, "chat_template_kwargs": {"messages": []}},
        timeout=60,
    )
    assert r.status_code == 400 and "chat template" in r.text
