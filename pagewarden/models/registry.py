"""Which module implements a checkpoint: one line per architecture (STYLE.md 16).

A new family is one new module that defines an ``Architecture`` and one line here; a
family that reuses another's blocks (Mistral on Llama's) is an entry, not a copy.
"""

from __future__ import annotations

from pagewarden.models import gemma, llama, phi3, qwen
from pagewarden.models.architecture import Architecture

ARCHITECTURES: tuple[Architecture, ...] = (
    llama.LLAMA,
    llama.MISTRAL,
    qwen.QWEN2,
    qwen.QWEN3,
    gemma.GEMMA2,
    gemma.GEMMA3,
    phi3.PHI3,
)

#: HF ``architectures[0]`` -> architecture.
BY_HF_NAME: dict[str, Architecture] = {n: a for a in ARCHITECTURES for n in a.hf_names}
#: GGUF ``general.architecture`` -> architecture.
BY_GGUF_NAME: dict[str, Architecture] = {
    a.gguf_name: a for a in ARCHITECTURES if a.gguf_name is not None
}
