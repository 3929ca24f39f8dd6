import gc
import weakref

import pytest

from pagewarden.gc_policy import SERVING_GEN0_THRESHOLD, tune_gc_for_serving


@pytest.fixture
def restore_gc():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
    gc.unfreeze()


def test_tune_sets_young_threshold_and_returns_previous(restore_gc):
    gc.set_threshold(700, 11, 12)
    previous = tune_gc_for_serving(freeze=False)
    assert previous == (700, 11, 12)
    assert gc.get_threshold() == (SERVING_GEN0_THRESHOLD, 11, 12)
    assert gc.get_freeze_count() == 0


def test_freeze_moves_live_objects_out_of_collection(restore_gc):
    keep = [[i] for i in range(1000)]  # container objects alive at start-up
    tune_gc_for_serving(5000)
    assert gc.get_threshold()[0] == 5000
    assert gc.get_freeze_count() >= len(keep)
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in tracked for o in keep)  # frozen: no collection walks them


def test_cycles_are_still_collected(restore_gc):
    tune_gc_for_serving(100)
    gc.enable()

    class Node:
        pass

    collected = []
    for _ in range(50):
        a, b = Node(), Node()
        a.other, b.other = b, a
        collected.append(weakref.ref(a))
        del a, b
    assert any(r() is not None for r in collected)  # reference counting cannot free them
    keep = [[] for _ in range(3000)]  # surviving allocations fill the young generations
    assert all(r() is None for r in collected), "young collections freed the cycles"
    assert len(keep) == 3000


def test_rejects_non_positive_threshold(restore_gc):
    with pytest.raises(ValueError, match="gen0_threshold"):
        tune_gc_for_serving(0)
