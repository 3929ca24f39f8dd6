"""GPU throughput against the memory roofline, and the integrity levels' overheads.

    python bench/gpu_roofline.py LOG [LOG ...]      # LOGs: outputs of bench/throughput.py

For each ``bench/throughput.py`` output it reads the workload (batch N x in/out) and the
median batch tok/s of ``pagewarden off / standard / strict``, and prints:

* the overheads of standard and strict against off (targets on H100/H200-class GPUs:
  standard within 3 %, strict within 10 %);
* the roofline: a decode step must read every weight once and the K/V of every cached
  token of the batch, so with memory bandwidth BW (measured here by a device copy)

      step_time(k) >= (weight_bytes + N * (in + k) * kv_bytes_per_token) / BW
      roofline tok/s = N * out / sum_k step_time(k)          (k = 0 .. out - 1)

  (prefill is compute-bound and a few milliseconds at these sizes; it is left out, so the
  roofline is an upper bound), and the measured tok/s as a share of it.

Needs a CUDA GPU (bandwidth); loads the default model (or ``--model``) for its sizes.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_WORKLOAD = re.compile(r"batch (\d+) x (\d+)/(\d+)")
_MEDIAN = re.compile(r"^pagewarden (off|standard|strict)\s+([\d.]+)")


def measure_bandwidth(device: str = "cuda", gib: int = 2, reps: int = 10) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * reps / (time.perf_counter() - start)


def model_bytes(model: str | None, dtype: torch.dtype) -> tuple[int, int]:
    """(weight bytes, K/V bytes per cached token) of the model in ``dtype``."""
    from pagewarden.models.loader import load_model

    loaded = load_model(model, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in loaded.model.parameters()) * elem
    c = loaded.config
    kv = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * elem
    return weights, kv


def roofline_tok_s(n: int, n_in: int, n_out: int, weights: int, kv: int, bw: float) -> float:
    seconds = sum((weights + n * (n_in + k) * kv) / bw for k in range(n_out))
    return n * n_out / seconds


def parse_log(path: Path) -> tuple[tuple[int, int, int], dict[str, float]]:
    text = path.read_text()
    match = _WORKLOAD.search(text)
    if match is None:
        raise SystemExit(f"{path}: no 'batch N x in/out' line; is it bench/throughput.py output?")
    medians = {m.group(1): float(m.group(2)) for m in map(_MEDIAN.match, text.splitlines()) if m}
    n, n_in, n_out = (int(g) for g in match.groups())
    return (n, n_in, n_out), medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    bw = measure_bandwidth()
    weights, kv = model_bytes(args.model, getattr(torch, args.dtype))
    print(f"GPU {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"weights {weights / 2**20:.1f} MiB, K/V {kv} bytes per cached token ({args.dtype})")
    for log in args.logs:
        (n, n_in, n_out), med = parse_log(log)
        roof = roofline_tok_s(n, n_in, n_out, weights, kv, bw)
        print(f"\n{n} x {n_in}/{n_out}: roofline {roof:,.0f} tok/s (decode, memory bound)")
        for level in ("off", "standard", "strict"):
            if level in med:
                line = (
                    f"  {level:<9}{med[level]:>10,.1f} tok/s  {med[level] / roof:6.1%} of roofline"
                )
                if level != "off" and "off" in med:
                    line += f"  overhead vs off {1 - med[level] / med['off']:+.1%}"
                print(line)


if __name__ == "__main__":
    main()
