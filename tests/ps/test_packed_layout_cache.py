"""The table servers' cache of packed lookup layouts (``_handlers._packed_layout``) is shared by
the server's RPC threads: a thread that finds a layout there must get it even when another
thread clears the cache (beyond 16 layouts) between its check and its read."""

from __future__ import annotations

import pytest

from remote_module.ps.tables.server import _handlers


class _ClearedAfterCheck(dict):
    """A cache that another thread clears right after a lookup found its key (the interleaving
    of two handler threads, made deterministic)."""

    def __contains__(self, key: object) -> bool:
        found = super().__contains__(key)
        if found:
            self.clear()
        return found

    def get(self, key, default=None):  # (the same interleaving for a read that checks itself)
        value = super().get(key, default)
        self.clear()
        return value


def test_a_layout_found_is_returned_though_another_thread_clears_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_handlers, "_packed_layouts", {})  # (the server's own cache left as it was)
    made = _handlers._packed_layout([0, 4], [4, 4], 8)
    cache = _ClearedAfterCheck({((0, 4), (4, 4), 8): made})
    monkeypatch.setattr(_handlers, "_packed_layouts", cache)
    assert _handlers._packed_layout([0, 4], [4, 4], 8) is made  # (was: KeyError)


def test_a_layout_read_as_sent_is_kept_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_handlers, "_packed_layouts", {})
    assert _handlers._packed_layout([0, 2], [4, 4], 8) is None  # (tables sharing bags)
    assert _handlers._packed_layouts == {((0, 2), (4, 4), 8): None}
    assert _handlers._packed_layout([0, 2], [4, 4], 8) is None
