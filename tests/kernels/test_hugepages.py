"""Weights moved into huge pages (kernels/cpu/hugepages, linear.to_hugepages): same
values, shared tensors stay shared, the map is advised for THP, and a model computes
the same tokens after the move."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from pagewarden.kernels.cpu import hugepages
from pagewarden.kernels.cpu import linear as cpu_linear
from pagewarden.kernels.cpu.quant import QuantWeight


def _maps_with_thp_flag(ptr: int) -> str | None:
    """The ``THPeligible`` line of the /proc/self/smaps entry holding ``ptr``."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1]
    return None


def test_relocate_keeps_values_dtypes_and_alignment() -> None:
    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(300, 70, generator=g).to(torch.bfloat16),
        torch.randint(0, 255, (1000, 18), dtype=torch.uint8, generator=g),
        torch.randn(17, generator=g),
    ]
    out = hugepages.relocate(ts)
    for a, b in zip(ts, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.data_ptr() % hugepages.ALIGN == 0
        assert b.data_ptr() != a.data_ptr()
    assert out[0].data_ptr() % hugepages.HUGE_PAGE == 0  # the map starts on a huge page
    # one map: consecutive, no overlap
    ends = [t.data_ptr() + t.numel() * t.element_size() for t in out]
    assert all(ends[i] <= out[i + 1].data_ptr() for i in range(len(out) - 1))


def test_relocate_refuses_non_contiguous() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        hugepages.relocate([torch.zeros(8, 8).t()])


def test_map_is_advised_for_huge_pages_and_freed_with_its_last_tensor() -> None:
    (t,) = hugepages.relocate([torch.ones(4 << 20, dtype=torch.uint8)])
    ptr = t.data_ptr()
    flag = _maps_with_thp_flag(ptr)
    assert flag is not None, "the moved tensor is not in a map of its own"
    if hugepages.thp_mode() in ("always", "madvise"):
        assert flag == "1"  # advised: the kernel may back it with 2 MiB pages
    view = t[5:9]
    del t
    gc.collect()
    assert torch.equal(view, torch.ones(4, dtype=torch.uint8))  # a view keeps the map
    del view
    gc.collect()
    assert _maps_with_thp_flag(ptr) is None  # unmapped with the last view


def test_zeros_are_zero_separate_writable_and_advised() -> None:
    """The KV pool's layer caches (``KVStore`` on the CPU): zeros, each its own
    64-byte-aligned region of one advised map, writable without touching the others."""
    ts = hugepages.zeros(3, (2, 128, 16, 4, 64), torch.bfloat16)  # 2 MiB each
    assert [t.shape for t in ts] == [torch.Size([2, 128, 16, 4, 64])] * 3
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in ts)
    assert all(torch.count_nonzero(t) == 0 for t in ts)
    assert ts[0].data_ptr() % hugepages.HUGE_PAGE == 0
    assert all(t.data_ptr() % hugepages.ALIGN == 0 for t in ts)
    ts[1].fill_(1.5)
    assert torch.count_nonzero(ts[0]) == 0 and torch.count_nonzero(ts[2]) == 0
    assert bool((ts[1] == 1.5).all())
    if hugepages.thp_mode() in ("always", "madvise"):
        assert _maps_with_thp_flag(ts[2].data_ptr()) == "1"


def test_the_cpu_kv_pool_lives_in_huge_pages(monkeypatch) -> None:
    from pagewarden.worker.kv_store import KVCacheShape, KVStore

    shape = KVCacheShape(
        num_layers=2, num_blocks=128, block_size=16, num_kv_heads=4, head_dim=64,
        dtype=torch.bfloat16,
    )  # fmt: skip
    store = KVStore(shape)
    if hugepages.thp_mode() in ("always", "madvise"):
        assert all(_maps_with_thp_flag(c.data_ptr()) == "1" for c in store.caches)
    monkeypatch.setenv("PAGEWARDEN_HUGEPAGES", "0")
    plain = KVStore(shape)
    assert _maps_with_thp_flag(plain.caches[0].data_ptr()) != "1" or (
        hugepages.thp_mode() == "always"
    )
    assert all(torch.count_nonzero(c) == 0 for c in store.caches + plain.caches)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 256)
        self.proj = nn.Linear(256, 512, bias=False)
        self.head = nn.Linear(256, 512, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.Parameter(torch.ones(256))


def test_to_hugepages_moves_parameters_and_keeps_ties(monkeypatch) -> None:
    monkeypatch.setenv("PAGEWARDEN_HUGEPAGES", "1")
    m = _Tied()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    small = m.norm.data_ptr()
    moved = cpu_linear.to_hugepages(m)
    assert moved == 2 * 512 * 256 * 4  # embed (= head) and proj; the norm is too small
    assert m.head.weight is m.embed.weight
    assert m.norm.data_ptr() == small
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n])
    assert _maps_with_thp_flag(m.proj.weight.data_ptr()) is not None


def test_to_hugepages_moves_quantized_blocks_once_for_a_tied_head(monkeypatch) -> None:
    monkeypatch.setenv("PAGEWARDEN_HUGEPAGES", "1")
    m = _Tied()
    data = torch.randint(0, 255, (512, 8 * 34), dtype=torch.uint8)
    q = QuantWeight(data, 8, (512, 256))  # Q8_0
    head = QuantWeight(q.data, 8, (512, 256), float_out=True)
    m.embed.__dict__[cpu_linear._QUANT] = q
    m.head.__dict__[cpu_linear._QUANT] = head
    cpu_linear.to_hugepages(m)
    assert q.data.data_ptr() == head.data.data_ptr() != data.data_ptr()
    assert torch.equal(q.data, data)


def test_switch_off_moves_nothing(monkeypatch) -> None:
    monkeypatch.setenv("PAGEWARDEN_HUGEPAGES", "0")
    m = _Tied()
    ptr = m.proj.weight.data_ptr()
    assert cpu_linear.to_hugepages(m) == 0
    assert m.proj.weight.data_ptr() == ptr


def test_to_hugepages_moves_each_run_of_a_mixed_type_layer(monkeypatch) -> None:
    from pagewarden.kernels.cpu.quant import QuantRows

    monkeypatch.setenv("PAGEWARDEN_HUGEPAGES", "1")
    m = _Tied()
    q8 = torch.randint(0, 255, (256, 8 * 34), dtype=torch.uint8)  # Q8_0 rows
    q5 = torch.randint(0, 255, (256, 8 * 22), dtype=torch.uint8)  # Q5_0 rows
    rows = QuantRows((QuantWeight(q5, 6, (256, 256)), QuantWeight(q8, 8, (256, 256))))
    m.proj.__dict__[cpu_linear._QUANT] = rows
    cpu_linear.to_hugepages(m)
    assert [p.data.data_ptr() for p in rows.parts] != [q5.data_ptr(), q8.data_ptr()]
    assert torch.equal(rows.parts[0].data, q5) and torch.equal(rows.parts[1].data, q8)
