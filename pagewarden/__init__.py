"""pagewarden: an LLM inference engine whose paged KV cache never silently serves corrupted KV."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# First, before anything can import torch: idle OpenMP threads sleep (see omp_policy.py).
from pagewarden import omp_policy  # noqa: F401, I001
from pagewarden.sampling_params import SamplingParams
from pagewarden.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from pagewarden.engine.llm import LLM


def __getattr__(name: str) -> Any:
    # Importing torch is slow; `pagewarden.kv` and `pagewarden.sched` users never pay it.
    if name == "LLM":
        from pagewarden.engine.llm import LLM

        return LLM
    raise AttributeError(name)
