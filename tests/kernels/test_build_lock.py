"""A build lock left by a process killed mid-build is removed after STALE_LOCK_S; a fresh
one (a build in progress elsewhere) is left alone."""

from __future__ import annotations

import os
import time

from pagewarden.kernels.cpu import build


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog) -> None:
    lock = tmp_path / "lock"
    lock.write_text("")
    assert not build.remove_stale_lock(tmp_path) and lock.exists()  # a build in progress
    old = time.time() - build.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert build.remove_stale_lock(tmp_path) and not lock.exists()
    assert "removing a build lock" in caplog.text
    assert not build.remove_stale_lock(tmp_path)  # nothing to remove


def test_an_engine_on_the_cpu_builds_every_extension_before_its_first_step(
    tiny_llama_dir, monkeypatch
) -> None:
    # A build inside a served step looked like a hung engine (60 s without a step): the
    # server failed the requests and killed the core mid-build, leaving its lock behind.
    from pagewarden.engine.config import EngineConfig
    from pagewarden.engine.core import EngineCore
    from pagewarden.kernels.cpu import attention, checksum, fused, gemm, quant

    called: set[str] = set()
    loaders = [(fused, "load"), (gemm, "load"), (checksum, "load"), (quant, "load")]
    for module, name in [*loaders, (attention, "load_extension")]:
        real = getattr(module, name)
        tag = f"{module.__name__}.{name}"
        monkeypatch.setattr(module, name, lambda real=real, tag=tag: (called.add(tag), real())[1])
    cfg = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, num_kv_blocks=40)
    core = EngineCore(cfg)
    assert core.scheduler.num_steps == 0
    assert called == {
        "pagewarden.kernels.cpu.fused.load",
        "pagewarden.kernels.cpu.gemm.load",
        "pagewarden.kernels.cpu.checksum.load",
        "pagewarden.kernels.cpu.quant.load",
        "pagewarden.kernels.cpu.attention.load_extension",
    }
