"""Terminal use of the offline engine: ``pagewarden generate`` and ``pagewarden chat``.

Tokens are printed as the engine's incremental detokenizer releases them (each step's
``RequestOutput`` carries the text so far; only the new part is written), the model
load shows one line that updates in place, and ``chat`` keeps a conversation that
``/reset`` clears. Chat samples the way the model recommends: its generation config
(``generation_config.json`` of an HF directory, ``general.sampling.*`` of a GGUF) where
it ships one, else ``CHAT_FALLBACK``; flags override either. Greedy decoding of a small
model falls into loops at near-ties, so chat does not default to it.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

#: Chat sampling when the model ships no recommendation: moderate temperature with
#: nucleus sampling and a mild repetition penalty.
CHAT_FALLBACK: dict[str, float] = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def recommended_sampling(model_path: Path) -> dict[str, Any]:
    """The sampling settings the model ships (only those it names; {} when none)."""
    if model_path.is_dir():
        cfg_path = model_path / "generation_config.json"
        if not cfg_path.is_file():
            return {}
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("do_sample") is False:
            return {"temperature": 0.0}
        return {k: cfg[k] for k in _SAMPLING_KEYS if k in cfg}
    from pagewarden.models.gguf_metadata import read_gguf_metadata

    fields = read_gguf_metadata(model_path)
    shipped = {name: fields[key] for key, name in _GGUF_KEYS.items() if key in fields}
    # GGUF stores them as float32: 0.6 reads back as 0.6000000238.
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in shipped.items()}


def chat_sampling(model_path: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """Chat's sampling settings: the flags given (``overrides``, None = not given), then
    the model's recommendation, then ``CHAT_FALLBACK``."""
    shipped = recommended_sampling(model_path)
    base = shipped if shipped else dict(CHAT_FALLBACK)
    return {**base, **{k: v for k, v in overrides.items() if v is not None}}


@contextmanager
def load_progress(label: str, out: TextIO) -> Iterator[None]:
    """One line, ``label ... 1.4s`` updating in place while the body runs (plain once
    at the end when ``out`` is not a terminal)."""
    start = time.monotonic()
    done = threading.Event()
    tty = out.isatty()

    def tick() -> None:
        for spin in itertools.cycle("|/-\\"):
            if done.wait(0.1):
                return
            out.write(f"\r{label} {spin} {time.monotonic() - start:.1f}s")
            out.flush()

    ticker = threading.Thread(target=tick, daemon=True) if tty else None
    if ticker is not None:
        ticker.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        if ticker is not None:
            ticker.join()
        back = "\r" if tty else ""
        status = f"done in {time.monotonic() - start:.1f}s" if ok else "failed"
        out.write(f"{back}{label} {status}\n")
        out.flush()


_request_ids = itertools.count()


def stream_completion(llm, prompt: str, prompt_ids: list[int], params, write: Callable) -> str:
    """Generate one completion, writing its text as it is detokenized; returns it.
    Ctrl-C stops the generation (the request is aborted, its blocks freed) and returns
    the text so far."""
    engine = llm.engine
    request_id = f"cli-{next(_request_ids)}"
    engine.validate(prompt_ids, params)
    engine.add_request(request_id, prompt_ids, params, prompt=prompt)
    text = ""
    try:
        while True:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                new = out.outputs[0].text
                write(new[len(text) :] if new.startswith(text) else new)
                text = new
                if out.finished:
                    return text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        engine.step()  # apply the abort so no KV block is left held
        return text


def chat_prompt(llm, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """The conversation through the model's chat template, as text and token ids."""
    tokenizer = llm.engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return text, tokenizer.encode(text, add_special_tokens=False)


CHAT_HELP = "/reset clears the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply."


def run_chat(llm, params, system: str | None, read: Callable[[str], str], out: TextIO) -> int:
    """The chat loop: read a line, stream the reply, keep the history (``read`` raises
    EOFError at the end of input)."""

    def fresh() -> list[dict[str, str]]:
        return [{"role": "system", "content": system}] if system else []

    def write(s: str) -> None:
        out.write(s)
        out.flush()

    history = fresh()
    out.write(f"pagewarden chat: {CHAT_HELP}\n")
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if line in ("/exit", "/quit", "/bye"):
            return 0
        if line == "/reset":
            history = fresh()
            out.write("(conversation cleared)\n")
            continue
        if line.startswith("/"):
            out.write(f"unknown command {line.split()[0]}; {CHAT_HELP}\n")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        text, ids = chat_prompt(llm, history)
        reply = stream_completion(llm, text, ids, params, write)
        out.write("\n")
        history.append({"role": "assistant", "content": reply})
