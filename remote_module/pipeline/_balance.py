"""Where to cut an ``nn.Sequential`` into pipeline stages (pure functions, no RPC).

:func:`balance_by_parameters` chooses the layers per stage so that the largest stage holds as
few parameters as possible; :func:`check_balance` checks a balance the user gave. A layer
without parameters (``ReLU``, ``Dropout``, ``Flatten``) stays with the layer before it: a cut
never separates a layer from the activation that follows it. A cut is never made where the
caller forbids one (``joined``: e.g. between two layers that share a module, see
``remote_module.pipeline._split``).
"""

from __future__ import annotations

from typing import AbstractSet, Sequence

from remote_module._core import positive_int


def _units(sizes: Sequence[int], joined: AbstractSet[int] = frozenset()) -> list[tuple[int, int]]:
    """``(layers, parameters)`` per unit: a layer with parameters and the parameter-free layers
    after it. Parameter-free layers at the front join the first unit; a layer whose index is in
    ``joined`` joins the unit before it (no cut right before it)."""
    units: list[list[int]] = []
    for index, size in enumerate(sizes):
        if units and (size == 0 or index in joined):
            units[-1][0] += 1
            units[-1][1] += size
        else:
            units.append([1, size])
    if len(units) > 1 and units[0][1] == 0:  # leading parameter-free layers: with the first real one
        first = units.pop(0)
        units[0][0] += first[0]
    return [(n, p) for n, p in units]


def balance_by_parameters(sizes: Sequence[int], stages: int, joined: AbstractSet[int] = frozenset()) -> list[int]:
    """Layers per stage for layers holding ``sizes`` parameters, over ``stages`` stages.

    Contiguous stages, each at least one unit (see the module docstring); among the cuts that
    minimise the largest stage's parameter count, the one whose earlier stages are smallest
    is taken (so a tie puts more work on later stages). No stage starts at a layer whose index
    is in ``joined``. Raises ``ValueError`` when there are fewer units than stages.

    Example::

        >>> balance_by_parameters([100, 0, 100, 0, 50, 50], 2)   # Linear ReLU Linear ReLU Linear Linear
        [2, 4]
        >>> balance_by_parameters([100, 0, 100, 0, 50, 50], 2, joined={2})   # no cut before layer 2
        [4, 2]
    """
    stages = positive_int(stages, "the number of stages", wrong_type=ValueError)
    units = _units(list(sizes), joined)
    if len(units) < stages:
        raise ValueError(
            f"cannot split {len(sizes)} layers into {stages} stages by parameters: only {len(units)} "
            "group(s) of a layer with parameters and the parameter-free layers after it"
            + (" (layers that share a module or parameter, and those between them, form one group)" if joined else "")
            + "; pass balance=[layers per stage] explicitly, or use fewer stages"
        )
    params = [p for _, p in units]
    prefix = [0]
    for p in params:
        prefix.append(prefix[-1] + p)
    n = len(params)
    inf = float("inf")
    # cost[k][j]: the smallest possible largest stage when units[:j] form k stages.
    cost = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    cost[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(cost[k - 1][i], prefix[j] - prefix[i])
                if value < cost[k][j]:  # the first i wins ties: earlier stages smaller
                    cost[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [sum(units[u][0] for u in range(a, b)) for a, b in zip(bounds, bounds[1:])]


def check_balance(balance: Sequence[int], layers: int, stages: int) -> list[int]:
    """``balance`` as a list, checked: one positive int per stage, summing to ``layers``.

    Example::

        >>> check_balance((2, 3), 5, 2)
        [2, 3]
    """
    try:
        values = list(balance)
    except TypeError:
        raise TypeError(f"balance must be a sequence of ints (layers per stage), got {balance!r}") from None
    try:
        values = [positive_int(v, "balance", wrong_type=ValueError) for v in values]
    except ValueError:
        raise ValueError(f"balance must hold positive ints (layers per stage), got {values!r}") from None
    if len(values) != stages:
        raise ValueError(
            f"balance has {len(values)} entries but there are {stages} remote devices; give one "
            "entry (layers per stage) per device"
        )
    if sum(values) != layers:
        raise ValueError(
            f"balance {values!r} covers {sum(values)} layers but the nn.Sequential has {layers}; the "
            "entries must add up to its length"
        )
    return values
