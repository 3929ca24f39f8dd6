"""``pagewarden generate`` / ``chat`` in the terminal: streaming, /reset, sampling
defaults, and a help text with its default for every flag."""

from __future__ import annotations

import io
import json
import shutil
import time

import pytest

import pagewarden.terminal as terminal
from pagewarden.cli import build_parser, main
from pagewarden.engine.args import DefaultsHelpFormatter
from pagewarden.engine.llm import LLM
from pagewarden.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_flag_has_a_help_text_with_its_default(command: str) -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    formatter = DefaultsHelpFormatter(command)
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            text = formatter._get_help_string(action) or ""
            assert action.help and "default" in text, action.option_strings


def test_completion_is_written_as_it_is_generated(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = llm.engine.tokenizer.encode("hello world")
    pieces: list[str] = []
    text = terminal.stream_completion(llm, "hello world", ids, params, pieces.append)
    assert len([p for p in pieces if p]) > 3  # token by token, not at the end
    assert "".join(pieces) == text == llm.generate(ids, params, use_tqdm=False)[0].outputs[0].text
    assert llm.stats().used_blocks == 0


def test_chat_streams_replies_and_reset_clears_the_conversation(llm, monkeypatch) -> None:
    seen: list[list[dict[str, str]]] = []
    real = terminal.chat_prompt

    def recording(llm_, messages):
        seen.append([dict(m) for m in messages])
        return real(llm_, messages)

    monkeypatch.setattr(terminal, "chat_prompt", recording)
    lines = iter(["hi there", "and again", "/reset", "hello", "/nope"])

    def read(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert terminal.run_chat(llm, params, "be brief", read, out) == 0
    system = {"role": "system", "content": "be brief"}
    assert seen[0] == [system, {"role": "user", "content": "hi there"}]
    assert [m["role"] for m in seen[1]] == ["system", "user", "assistant", "user"]
    assert seen[2] == [system, {"role": "user", "content": "hello"}]  # after /reset
    text = out.getvalue()
    assert "(conversation cleared)" in text and "unknown command /nope" in text
    assert seen[1][2]["content"] in text  # the first reply was printed


def test_chat_samples_as_the_model_recommends(tiny_llama_dir, tmp_path) -> None:
    assert terminal.chat_sampling(tiny_llama_dir, {}) == terminal.CHAT_FALLBACK
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    cfg = {"do_sample": True, "temperature": 0.3, "top_p": 0.8, "eos_token_id": 2}
    (model / "generation_config.json").write_text(json.dumps(cfg))
    assert terminal.chat_sampling(model, {"top_p": None}) == {"temperature": 0.3, "top_p": 0.8}
    assert terminal.chat_sampling(model, {"temperature": 1.0})["temperature"] == 1.0


def test_chat_reads_the_sampling_keys_of_a_gguf(tmp_path) -> None:
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_float32("general.sampling.temp", 0.6)
    w.add_float32("general.sampling.top_p", 0.95)
    w.add_int32("general.sampling.top_k", 20)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert terminal.recommended_sampling(path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_generate_cli_prints_the_completion(tiny_llama_dir, capsys) -> None:
    argv = ["generate", "hello", "--model", str(tiny_llama_dir), "--dtype", "float32"]
    argv += ["--num-kv-blocks", "32", "--max-tokens", "6", "--max-model-len", "64"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "loading" in captured.err and "done in" in captured.err


def test_load_progress_is_one_line_updated_in_place() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    with terminal.load_progress("loading m", out):
        time.sleep(0.35)
    text = out.getvalue()
    assert "\n" not in text[:-1] and text.count("\r") >= 3  # redrawn, one line
    assert text.endswith("s\n") and "\rloading m done in" in text
    with pytest.raises(KeyError), terminal.load_progress("loading m", io.StringIO()) as _:
        raise KeyError("x")
