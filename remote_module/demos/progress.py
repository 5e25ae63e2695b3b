"""Progress bars for the demos: tqdm's when it is installed and wanted, else one that shows
nothing (tqdm comes with the optional ``demo`` extra)."""

from __future__ import annotations

from typing import Any


class NoBar:
    """Stands in for a tqdm bar and shows nothing."""

    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: object) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, **tqdm_kwargs: Any) -> Any:
    """``tqdm(total=total, **tqdm_kwargs)``, or a :class:`NoBar` when not ``enabled`` or tqdm
    is not installed.

    Example::

        bar = progress_bar(100, enabled=True, desc="training", unit="step")
        bar.update(1)
    """
    if not enabled:
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return NoBar()
    return tqdm(total=total, **tqdm_kwargs)
