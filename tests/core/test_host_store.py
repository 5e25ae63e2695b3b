"""remote_module._core.HostStore, the one host object store of every layer (no RPC needed)."""

import gc
import threading

import pytest

from remote_module._core import HostStore
from tests._deadlines import HANG_S


class Thing:
    pass


def test_weak_entries_vanish_with_their_object_and_keep_their_key_while_alive():
    store = HostStore()
    a, b = Thing(), Thing()
    ka, kb = store.hold_weakly(a), store.hold_weakly(b)
    assert ka != kb and store.hold_weakly(a) == ka and store.get(ka) is a
    del a
    gc.collect()
    assert store.get(ka) is None and store.keys() == {kb}
    assert store.hold_weakly(Thing()) not in (ka, kb)  # keys are never reused


def test_strong_entries_live_until_popped_or_released():
    store = HostStore()
    assert store.put(("w", 1), "one") is True and store.get(("w", 1)) == "one"
    with pytest.raises(KeyError):
        store.put(("w", 1), "again")
    assert store.pop(("w", 1)) == "one" and store.pop(("w", 1), "gone") == "gone"
    store.put("x", 1)
    store.release(["x"], tombstone=False)
    assert store.get("x") is None and len(store) == 0


def test_a_release_before_the_object_arrives_drops_it_on_arrival():
    store = HostStore(max_tombstones=2)
    store.release(["late"], tombstone=True)
    assert store.put("late", "result") is False and store.get("late") is None
    assert store.put("late", "next") is True  # the tombstone was used up
    store.release(["a", "b", "c"], tombstone=True)  # bounded: "a" is forgotten first
    assert store.put("a", 1) is True and store.put("b", 2) is False and store.put("c", 3) is False


def test_setdefault_makes_once_under_concurrency():
    store, made = HostStore(), []

    def make():
        made.append(1)
        return Thing()

    got = []
    threads = [threading.Thread(target=lambda: got.append(store.setdefault("job", make))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert not any(t.is_alive() for t in threads), f"hang guard: still making after {HANG_S} s"
    assert len(made) == 1 and len({id(obj) for obj, _ in got}) == 1
    assert sorted(created for _, created in got) == [False] * 7 + [True]


def test_update_changes_a_held_entry_only():
    store = HostStore()
    store.put(7, {})
    assert store.update(7, lambda box: box.__setitem__(0, "out")) and store.get(7) == {0: "out"}
    assert store.pop(7) == {0: "out"}
    assert store.update(7, lambda box: box.__setitem__(1, "late")) is False


def test_caller_keys_and_picked_keys_never_shadow_each_other():
    """One store with weak entries (keys it picks: 1, 2, ...) and strong ones under int keys:
    a caller's key is never picked, and a picked key is refused to a caller, so neither entry
    hides the other from get()."""
    store = HostStore()
    store.put(1, "caller's")
    module = Thing()
    key = store.hold_weakly(module)
    assert key != 1 and store.get(key) is module and store.get(1) == "caller's"
    with pytest.raises(KeyError):
        store.put(key, "another")
    with pytest.raises(KeyError):
        store.setdefault(key, lambda: "another")
    assert store.get(key) is module and store.keys() == {1, key}
