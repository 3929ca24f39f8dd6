"""Event-loop block time of hostile and large request bodies (issue 35 item 1).

For each body just under the 10 MiB limit (and a few at the JSON budget's limits), runs
what the server runs before a route sees the request, ``JsonBudget.check`` (the value
count, a quarter MiB at a time) and, if it passes, ``parse_body``, inside an event loop
with a ticker task beside it, and prints the scan and parse times and the longest time
the loop was held (what ``/health`` on another connection would wait at most).

    python bench/body_parse.py                     # budget of the default model (8192, 32)
    python bench/body_parse.py --max-model-len 32768
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time

from pagewarden.server.context import parse_body
from pagewarden.server.errors import APIError
from pagewarden.server.json_budget import JsonBudget
from pagewarden.server.protocol import ChatCompletionRequest, CompletionRequest


def bodies(budget: JsonBudget, max_model_len: int, prompts: int) -> dict[str, tuple]:
    def junk(item: str, n: int) -> bytes:
        return ('{"model":"m","prompt":"hi","junk":[' + ",".join([item] * n) + "]}").encode()

    ids = ",".join(["1"] * 5_200_000)
    c, chat = CompletionRequest, ChatCompletionRequest
    return {
        "5.2M token ids": (c, f'{{"model":"m","prompt":[{ids}]}}'.encode()),
        "3.4M empty arrays": (c, junk("[]", 3_400_000)),
        "9 MB text": (c, json.dumps({"model": "m", "prompt": "flood, " * 1_300_000}).encode()),
        "5M escapes (\\n)": (c, ('{"model":"m","prompt":"' + "\\n" * 5_000_000 + '"}').encode()),
        "1.7M \\u00e9": (c, ('{"model":"m","prompt":"' + "\\u00e9" * 1_700_000 + '"}').encode()),
        f"{prompts} x {max_model_len - 1} ids (fits)": (
            c,
            json.dumps({"model": "m", "prompt": [[1] * (max_model_len - 1)] * prompts}).encode(),
        ),
        "ints at max_values": (c, junk("1", budget.max_values - 10)),
        "floats at max_costly": (c, junk("1.5", budget.max_costly - 10)),
        "objects at max_costly": (c, junk('{"a":[]}', budget.max_costly // 4 - 10)),
        "messages at max_costly": (
            chat,
            json.dumps(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": "hi"}] * (budget.max_costly // 5 - 10),
                }
            ).encode(),
        ),
    }


async def measure(budget: JsonBudget, model, body: bytes) -> tuple[str, float, float, float]:
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    gaps.clear()
    t0 = time.perf_counter()
    try:
        await budget.check(body)
        t1 = time.perf_counter()
        parse_body(model, body)
        outcome = "parsed"
    except APIError as exc:
        t1, outcome = time.perf_counter(), str(exc.status)
    t2 = time.perf_counter()
    await asyncio.sleep(0)
    done = True
    await task
    return outcome, t1 - t0, t2 - t1, max(gaps)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-prompts-per-request", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="runs per body; the best is shown")
    args = ap.parse_args()
    logging.getLogger("pagewarden.server").setLevel(logging.ERROR)  # the junk field's warning
    budget = JsonBudget.for_server(args.max_model_len, args.max_prompts_per_request)
    print(f"uptime: {os.popen('uptime').read().strip()}")
    print(f"{budget}")
    print(
        f"{'body':32s} {'MB':>5s} {'result':>7s} {'scan ms':>8s} {'parse ms':>9s} {'loop held ms':>13s}"
    )
    worst = 0.0
    for name, (model, body) in bodies(
        budget, args.max_model_len, args.max_prompts_per_request
    ).items():
        runs = [await measure(budget, model, body) for _ in range(args.repeat)]
        outcome, scan, parse, held = min(runs, key=lambda r: r[3])
        worst = max(worst, held)
        print(
            f"{name:32s} {len(body) / 1e6:5.1f} {outcome:>7s} {scan * 1e3:8.1f} "
            f"{parse * 1e3:9.1f} {held * 1e3:13.1f}"
        )
    print(f"longest hold of the event loop: {worst * 1e3:.1f} ms")
    print(f"uptime: {os.popen('uptime').read().strip()}")


if __name__ == "__main__":
    asyncio.run(main())
