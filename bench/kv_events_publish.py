"""Cost of publishing KV cache events next to the engine step it follows.

Runs the default model (or --model) with --kv-events-endpoint on, times each
``EngineCore.step()`` and the publish inside it, and prints the publish share of the
step. A subscriber is connected so that messages really leave the socket.

    python3 bench/kv_events_publish.py [--model PATH] [--batch 8] [--steps 40]
"""

from __future__ import annotations

import argparse
import time

import zmq

from pagewarden.engine.llm import LLM
from pagewarden.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--port", type=int, default=5598)
    args = ap.parse_args()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    llm = LLM(model=args.model, block_size=16, kv_events_endpoint=f"tcp://*:{args.port}")
    engine = llm.engine
    publisher = engine.kv_events
    sub.connect(f"tcp://127.0.0.1:{args.port}")
    while not publisher.wait_for_subscriber(0.05):
        sub.poll(0)
    publish_s = 0.0
    real_publish = publisher.publish

    def timed_publish(events) -> None:
        nonlocal publish_s
        t = time.perf_counter()
        real_publish(events)
        publish_s += time.perf_counter() - t

    publisher.publish = timed_publish  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    ids = engine.tokenizer.encode("Tell me a long story about a lighthouse keeper. " * 4)
    for k in range(args.batch):
        engine.add_request(f"b{k}", ids + [k + 1], params)
    steps, step_s = 0, 0.0
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        step_s += time.perf_counter() - t
        steps += 1
    received = 0
    while sub.poll(200):
        sub.recv_multipart()
        received += 1
    print(
        f"batch {args.batch}, {steps} steps: step {step_s / steps * 1e3:.2f} ms, "
        f"publish {publish_s / steps * 1e6:.1f} us per step "
        f"({publish_s / step_s:.4%} of the step), {publisher.seq} messages sent, "
        f"{received} received"
    )


if __name__ == "__main__":
    main()
