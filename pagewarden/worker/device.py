"""Where the engine runs: the device, and the KV budget a GPU leaves after the weights.

``--device`` picks ``cuda`` when a GPU is present, else ``cpu``. On CUDA, as in vLLM,
the KV cache takes what is left of ``gpu_memory_utilization * total`` once the weights
are loaded, minus a reserve for the forward pass's activations::

    kv_bytes = utilization * total - (total - free_now) - activation_reserve

``total - free_now`` counts everything already on the GPU (weights, other processes).
"""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """The requested device is malformed or not present; the message says what to use."""


def resolve_device(name: str | None) -> torch.device:
    """``name`` as a device; None means cuda when available, else cpu."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r} is not a device; use cuda, cuda:N or cpu") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {name!r} is not supported; use cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            f"device {name!r} asked for, but torch sees no CUDA GPU "
            f"(torch {torch.__version__}); use --device cpu"
        )
    return device


def activation_reserve(max_num_batched_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Bytes held back for one step's activations: logits (float32) and a few hidden
    states per batched token, with a 256 MiB floor for the allocator's own slack."""
    per_token = 4 * vocab_size + 16 * 4 * hidden_size
    return max(256 * 2**20, max_num_batched_tokens * per_token)


def gpu_kv_budget(device: torch.device, utilization: float, reserve: int) -> int:
    """Bytes the KV cache may take on ``device`` (see the module docstring)."""
    free, total = torch.cuda.mem_get_info(device)
    budget = int(utilization * total) - (total - free) - reserve
    if budget <= 0:
        raise DeviceError(
            f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB at gpu_memory_utilization={utilization}; raise it or "
            "free the GPU"
        )
    return budget
