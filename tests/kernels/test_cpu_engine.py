"""End to end with the cpu backend: greedy tokens equal the torch backend's and
transformers', and faults in what it reads are found by its own checks (found_by "read").

Same approach as ``tests/engine/test_llm_vs_hf.py``: fresh prompts, chunked prefill over
a cached prefix, decodes in one batch and a prefix-cache hit. In float32 only: on a tiny
random model bf16 logits sit within rounding of each other, and the kernel (which keeps
its probabilities in float32) and torch's bf16 SDPA (which rounds them to bf16) break
such near-ties differently; ``test_cpu_attention.py`` bounds the bf16 error instead.
"""

from __future__ import annotations

import random

import pytest

from pagewarden import LLM, SamplingParams
from pagewarden.faults.kv_faults import corrupt_tag, flip_bit, flip_slot_bit
from pagewarden.kernels.cpu import attention as cpu_attention
from tests.engine.test_llm_vs_hf import hf_greedy, random_prompts, run_engine

transformers = pytest.importorskip("transformers")
# The C++ extension must build where the tests run (CI installs g++; ninja is a
# dependency): a missing toolchain fails here, it does not skip.
assert cpu_attention.load_extension() is not None, (
    f"cpu attention extension unavailable: {cpu_attention.unavailable_reason()}; install g++"
)


@pytest.fixture(scope="module")
def vocab(tiny_llama_dir) -> int:
    return transformers.AutoConfig.from_pretrained(tiny_llama_dir).vocab_size


def _llm(model_dir, backend: str, dtype: str = "float32", **kw) -> LLM:
    return LLM(
        model=str(model_dir),
        dtype=dtype,
        num_kv_blocks=64,
        block_size=kw.pop("block_size", 16),
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 24),
        integrity=kw.pop("integrity", "strict"),
        device="cpu",
        attention_backend=backend,
        **kw,
    )


@pytest.mark.parametrize("block_size", [16, 4])
def test_cpu_tokens_equal_torch_and_transformers(tiny_llama_dir, vocab, block_size):
    """Strict: the kernel checks every tag it reads and re-checksums every sealed block."""
    prompts = random_prompts(4, vocab, 5, 30, seed=3)
    prompts.append(prompts[0][:16] + [5, 6])  # shares a full block with prompt 0
    llm = _llm(tiny_llama_dir, "cpu", block_size=block_size)
    assert llm.engine.runner.guard.fused_reads
    got = run_engine(llm, prompts, 12)
    assert got == run_engine(_llm(tiny_llama_dir, "torch", block_size=block_size), prompts, 12)
    assert got == hf_greedy(tiny_llama_dir, prompts, 12)
    counters = llm.engine.runner.guard.counters
    assert counters.tag_checks > 0 and not counters.failures
    assert counters.block_verifies > 0  # sealed context blocks, checked by the kernel


@pytest.fixture(scope="module")
def prefix(vocab) -> list[int]:
    return random_prompts(1, vocab, 32, 32, seed=5)[0]  # two full blocks of 16


def _with_cached_prefix(tiny_llama_dir, prefix) -> tuple[LLM, list[int]]:
    llm = _llm(tiny_llama_dir, "cpu", scrub_blocks_per_step=0)  # leave it to the kernel
    run_engine(llm, [prefix + [7]], 1)
    pool = llm.engine.scheduler.kv.pool
    cached = [b.block_id for b in pool.blocks if b.block_hash is not None]
    assert len(cached) == 2
    return llm, cached


def test_flipped_bit_in_a_reused_block_is_caught_by_the_kernels_checksum(tiny_llama_dir, prefix):
    llm, cached = _with_cached_prefix(tiny_llama_dir, prefix)
    flip_bit(llm.engine.kv_store.caches, cached[1], 1, random.Random(0))
    prompt = prefix + [9, 10]
    assert run_engine(llm, [prompt], 3) == hf_greedy(tiny_llama_dir, [prompt], 3)
    assert llm.stats().integrity.failures == {("checksum", "read"): 1}


def test_wrong_slot_tag_in_a_reused_block_is_caught_by_the_kernels_tag_check(
    tiny_llama_dir, prefix
):
    llm, cached = _with_cached_prefix(tiny_llama_dir, prefix)
    corrupt_tag(llm.engine.runner.guard.tags, cached[0], 5)
    prompt = prefix + [9, 10]
    assert run_engine(llm, [prompt], 3) == hf_greedy(tiny_llama_dir, [prompt], 3)
    assert llm.stats().integrity.failures == {("slot_tag", "read"): 1}


def test_the_cli_flag_selects_the_cpu_backend():
    import argparse

    from pagewarden.engine.args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config(parser.parse_args(["--attention-backend", "cpu", "--device", "cpu"]))
    assert cfg.resolved_attention_backend == "cpu"


def test_cpu_is_the_default_backend_where_a_toolchain_is_found(monkeypatch) -> None:
    from pagewarden.kernels import backend

    monkeypatch.delenv("PAGEWARDEN_NO_CPU_EXT", raising=False)
    assert backend.cpu_toolchain_found()  # CI installs g++ and ninja
    assert backend.default_backend("cpu") == "cpu"
    monkeypatch.setenv("PAGEWARDEN_NO_CPU_EXT", "1")
    assert backend.default_backend("cpu") == "torch"
    monkeypatch.delenv("PAGEWARDEN_NO_CPU_EXT")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert backend.default_backend("cpu") == "torch"


def test_a_float16_cache_keeps_the_torch_path_under_the_default_backend(tiny_llama_dir) -> None:
    llm = LLM(model=str(tiny_llama_dir), dtype="float16", num_kv_blocks=32)
    assert llm.engine.config.resolved_attention_backend == "cpu"
    assert not llm.engine.runner.guard.fused_reads  # torch path: the guard checks reads
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def _scrub_detection(tiny_llama_dir, prompt, max_fused_blocks, monkeypatch, before=(), **kw):
    """Standard, one request (after the requests ``before`` ran to the end): flip a bit
    of its first sealed block, then step; returns (steps until the fault is found, blocks
    verified from the cache, failures)."""
    from pagewarden.worker import guard_checksums

    monkeypatch.setattr(guard_checksums, "FUSED_SCRUB_MAX_BLOCKS", max_fused_blocks)
    llm = _llm(tiny_llama_dir, "cpu", integrity="standard", scrub_blocks_per_step=1, **kw)
    engine, guard = llm.engine, llm.engine.runner.guard
    if not max_fused_blocks:
        guard.decode_guard = None  # the general path, where the limit applies to decode too
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, earlier in enumerate(before):
        engine.add_request(f"before-{i}", earlier, params)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("r", prompt, params)
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed_tokens < 40:
        engine.step()
    request = engine.scheduler.running[0]
    first = engine.scheduler.kv.tables[request.req_id].ids[0]
    assert bool(guard.sealed[first])
    from_cache: list[int] = []
    verify = guard._verify_sealed
    monkeypatch.setattr(
        guard, "_verify_sealed", lambda ids: from_cache.extend(ids.tolist()) or verify(ids)
    )
    flip_bit(engine.kv_store.caches, first, 1, random.Random(0))
    steps = 0
    while not llm.stats().integrity.failures:
        steps += 1
        assert steps <= 3, "ceil(sealed blocks / scrub_blocks_per_step) = 3 steps at most"
        engine.step()
    found = list(from_cache)  # until the fault was found (its recompute reads afresh)
    while engine.has_unfinished():
        engine.step()
    return steps, found, dict(llm.stats().integrity.failures)


def test_standard_scrub_picks_are_checksummed_by_the_kernel_as_it_reads_them(
    tiny_llama_dir, vocab, monkeypatch
):
    """At one stream the scrubber's picks are the blocks the step reads: the kernel sums
    them as it reads (no pass over the cache), and a flip is found by "scrub" in the
    same step as when the scrubber reads them from the cache."""
    prompt = random_prompts(1, vocab, 40, 40, seed=11)[0]  # 2 full blocks and 8 tokens
    fused = _scrub_detection(tiny_llama_dir, prompt, 64, monkeypatch)
    monkeypatch.undo()
    separate = _scrub_detection(tiny_llama_dir, prompt, 0, monkeypatch)
    assert fused[2] == separate[2] == {("checksum", "scrub"): 1}
    assert fused[0] == separate[0]  # detection latency unchanged, in steps
    assert separate[1] and not fused[1]  # the fused run read no block from the cache


def test_a_decode_step_fuses_its_scrub_picks_past_the_general_paths_limit(
    tiny_llama_dir, vocab, monkeypatch
):
    """A decode step checked by ``DecodeGuard`` has the kernel sum its picks however many
    blocks it reads (the C++ flags them; ``FUSED_SCRUB_MAX_BLOCKS`` bounds only the
    general path's Python walk): with the limit at 1 block, nothing is read from the
    cache and the flip is found by "scrub" in the same step as the separate pass."""
    prompt = random_prompts(1, vocab, 40, 40, seed=11)[0]
    fused = _scrub_detection(tiny_llama_dir, prompt, 1, monkeypatch)
    monkeypatch.undo()
    separate = _scrub_detection(tiny_llama_dir, prompt, 0, monkeypatch)
    assert fused[2] == separate[2] == {("checksum", "scrub"): 1}
    assert fused[0] == separate[0]
    assert separate[1] and not fused[1]


def test_blocks_freed_without_a_hash_are_unsealed_so_the_scrubber_skips_dead_content(
    tiny_llama_dir, vocab, monkeypatch
):
    """Prefix caching off: the blocks of finished requests go FREE with dead content
    (nothing reads it before a new life rewrites it). They are unsealed, so the scrubber's
    round robin covers only live blocks: after a batch, one stream's picks are still the
    blocks it reads (summed by the kernel, none read from the cache), the detection bound
    is the live request's ceil(sealed / per step), and a flip is found as before."""
    prompts = random_prompts(5, vocab, 40, 40, seed=12)
    kw = {"enable_prefix_caching": False}
    fused = _scrub_detection(tiny_llama_dir, prompts[0], 64, monkeypatch, prompts[1:], **kw)
    monkeypatch.undo()
    alone = _scrub_detection(tiny_llama_dir, prompts[0], 64, monkeypatch, **kw)
    assert fused[2] == alone[2] == {("checksum", "scrub"): 1}
    assert fused[0] == alone[0]  # the earlier requests' blocks did not delay it
    assert not fused[1]  # no dead block was read from the cache


def test_a_finished_requests_blocks_are_unsealed_only_when_dead(tiny_llama_dir, vocab):
    """Prefix caching off: every block of a finished request is unsealed. On: its full
    blocks stay sealed (cached, a later hit is verified against the seal), and only the
    unhashed last block is dead."""
    prompt = random_prompts(1, vocab, 40, 40, seed=13)[0]  # 2 full blocks and 8 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for caching, left in ((False, 0), (True, 2)):
        llm = _llm(tiny_llama_dir, "cpu", integrity="standard", enable_prefix_caching=caching)
        engine, guard = llm.engine, llm.engine.runner.guard
        engine.add_request("r", prompt, params)
        while engine.has_unfinished():
            engine.step()
        assert "r" not in engine.scheduler.kv.tables  # finished: its blocks were freed
        assert guard.num_sealed == 2  # sealed while it ran; the frees are not taken yet
        engine.add_request("next", prompt[:3], params)  # a step takes the frees
        engine.step()
        assert guard.num_sealed == left


def test_strict_scrub_skips_picks_the_kernel_verifies_in_the_same_step(
    tiny_llama_dir, vocab, monkeypatch
):
    """Strict: the kernel checksums every full context block a step reads against its
    seal, so a scrub pick among them is not read from the cache a second time; a flip in
    it is found in the next step, by that read."""
    prompt = random_prompts(1, vocab, 40, 40, seed=14)[0]  # 2 full blocks and 8 tokens
    llm = _llm(tiny_llama_dir, "cpu", integrity="strict", scrub_blocks_per_step=2)
    engine, guard = llm.engine, llm.engine.runner.guard
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed_tokens < 40:
        engine.step()
    assert guard.num_sealed == 2  # the picks are the two blocks every step reads
    from_cache: list[int] = []
    verify = guard._verify_sealed
    monkeypatch.setattr(
        guard, "_verify_sealed", lambda ids: from_cache.extend(ids.tolist()) or verify(ids)
    )
    engine.step()
    assert not from_cache and not llm.stats().integrity.failures
    first = engine.scheduler.kv.tables["r"].ids[0]
    flip_bit(engine.kv_store.caches, first, 1, random.Random(0))
    engine.step()
    assert dict(llm.stats().integrity.failures) == {("checksum", "read"): 1}
    assert not from_cache


def _open_block_detection(tiny_llama_dir, prompt, monkeypatch, by_kernel: bool):
    """Strict, one request with a partly filled block: flip a bit of a slot it wrote
    there, step once; returns (failures, slots verified from the cache, tokens)."""
    llm = _llm(tiny_llama_dir, "cpu", integrity="strict", scrub_blocks_per_step=0)
    engine, guard = llm.engine, llm.engine.runner.guard
    if not by_kernel:  # the open block re-read from the cache before the forward pass
        guard.__class__ = type("PreRead", (type(guard),), {"_open_by_kernel": False})
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("r", prompt, params)
    while not engine.scheduler.running or engine.scheduler.running[0].num_computed_tokens < 41:
        engine.step()
    from_cache: list[int] = []
    verify = guard._verify_slots
    monkeypatch.setattr(
        guard, "_verify_slots", lambda slots: from_cache.extend(slots.tolist()) or verify(slots)
    )
    engine.step()  # reads the open block: nothing changed, nothing found
    assert not llm.stats().integrity.failures
    open_block = engine.scheduler.kv.tables["r"].ids[2]  # positions 32..47, 10 written
    flip_slot_bit(engine.kv_store.caches, open_block * 16 + 3, 1, random.Random(0))
    engine.step()
    failures = dict(llm.stats().integrity.failures)
    tokens = []
    while engine.has_unfinished():
        tokens += [o for o in engine.step() if o.finished]
    return failures, from_cache, tokens[0].outputs[0].token_ids


def test_strict_open_block_is_checked_by_the_kernels_sum_of_it(tiny_llama_dir, vocab, monkeypatch):
    """Strict with the cpu kernel: the partly filled block a step reads is verified by
    the sum the kernel took as it read it (its slots' write-time sums combined), not
    re-read from the cache; a flipped bit in a written slot is found in the same step
    as by the re-read, and the output is still the fault-free one."""
    prompt = random_prompts(1, vocab, 40, 40, seed=15)[0]  # 2 full blocks and 8 tokens
    fused = _open_block_detection(tiny_llama_dir, prompt, monkeypatch, by_kernel=True)
    monkeypatch.undo()
    pre = _open_block_detection(tiny_llama_dir, prompt, monkeypatch, by_kernel=False)
    assert fused[0] == pre[0] == {("checksum", "read"): 1}  # in that step, both ways
    assert pre[1] and not fused[1]  # the kernel's run read no slot from the cache
    assert fused[2] == pre[2] == hf_greedy(tiny_llama_dir, [prompt], 6)[0]
