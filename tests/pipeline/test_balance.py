"""Where split_sequential cuts (remote_module/pipeline/_balance.py): pure functions, no RPC."""

from __future__ import annotations

import itertools
import random

import pytest

from remote_module.pipeline._balance import balance_by_parameters, check_balance


def stage_sizes(sizes: list[int], balance: list[int]) -> list[int]:
    out, start = [], 0
    for count in balance:
        out.append(sum(sizes[start:start + count]))
        start += count
    return out


def allowed_cuts(sizes: list[int], stages: int) -> list[list[int]]:
    """Every balance whose stages (but the first) start at a layer with parameters, and whose
    first stage holds the first layer with parameters."""
    starts = [i for i in range(1, len(sizes)) if sizes[i] > 0 and any(sizes[:i])]
    cuts = []
    for chosen in itertools.combinations(starts, stages - 1):
        bounds = [0, *chosen, len(sizes)]
        cuts.append([b - a for a, b in zip(bounds, bounds[1:])])
    return cuts


@pytest.mark.parametrize(
    "sizes, stages, expected",
    [
        ([100, 0, 100, 0, 50, 50], 2, [2, 4]),  # the docstring's example: a tie goes to the later stage
        ([100, 0, 100, 0, 50, 50], 3, [2, 2, 2]),
        ([10, 10, 10, 10], 4, [1, 1, 1, 1]),
        ([10, 10, 10, 10], 2, [2, 2]),
        ([5, 5, 5], 1, [3]),
        ([576, 0, 0, 520, 72], 2, [3, 2]),
        ([0, 0, 10, 0, 10], 2, [4, 1]),  # leading parameter-free layers join the first real one
        ([0, 0, 0], 1, [3]),
        ([1000, 1, 1, 1], 2, [1, 3]),
        ([1, 1, 1, 1000], 2, [3, 1]),
        ([1, 1, 1, 1000], 3, [1, 2, 1]),  # smallest largest stage, then earlier stages smallest
    ],
)
def test_balance_by_parameters(sizes, stages, expected):
    assert balance_by_parameters(sizes, stages) == expected


def test_balance_by_parameters_is_optimal_and_never_cuts_before_a_parameter_free_layer():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        sizes = [rng.choice([0, 0, 1, 3, 10, 50]) for _ in range(n)]
        units = max(1, sum(1 for s in sizes if s > 0))
        for stages in range(1, units + 1):
            got = balance_by_parameters(sizes, stages)
            assert sum(got) == n and len(got) == stages and min(got) >= 1
            cuts = allowed_cuts(sizes, stages)
            assert got in cuts, (sizes, stages, got)
            best = min(max(stage_sizes(sizes, c)) for c in cuts)
            assert max(stage_sizes(sizes, got)) == best, (sizes, stages, got)
        with pytest.raises(ValueError, match=f"only {units} group"):
            balance_by_parameters(sizes, units + 1)


@pytest.mark.parametrize("stages", [0, -1, True, 1.0, None])
def test_balance_by_parameters_refuses_a_bad_number_of_stages(stages):
    with pytest.raises(ValueError, match=rf"number of stages must be a positive int, got {stages!r}"):
        balance_by_parameters([1, 2], stages)


@pytest.mark.parametrize(
    "sizes, stages, message",
    [
        ([10, 0, 0], 2, r"cannot split 3 layers into 2 stages by parameters: only 1 group"),
        ([0, 0, 10, 0], 2, r"only 1 group"),
        ([1, 1], 3, r"only 2 group"),
        ([], 1, r"cannot split 0 layers"),
    ],
)
def test_balance_by_parameters_refuses_too_few_groups(sizes, stages, message):
    with pytest.raises(ValueError, match=message) as caught:
        balance_by_parameters(sizes, stages)
    assert "pass balance=" in str(caught.value)


def test_check_balance_accepts_and_returns_a_list():
    assert check_balance((2, 3), 5, 2) == [2, 3]
    assert check_balance([5], 5, 1) == [5]
    assert check_balance(iter([1, 1, 1]), 3, 3) == [1, 1, 1]


@pytest.mark.parametrize(
    "balance, layers, stages, error, message",
    [
        (5, 5, 1, TypeError, r"balance must be a sequence of ints \(layers per stage\), got 5"),
        ([2, 0, 3], 5, 3, ValueError, r"positive ints.*\[2, 0, 3\]"),
        ([2, -1, 4], 5, 3, ValueError, r"positive ints"),
        ([True, 4], 5, 2, ValueError, r"positive ints.*\[True, 4\]"),
        ([2.0, 3], 5, 2, ValueError, r"positive ints"),
        (["2", "3"], 5, 2, ValueError, r"positive ints"),
        ([2, 3], 5, 3, ValueError, r"balance has 2 entries but there are 3 remote devices"),
        ([2, 2], 5, 2, ValueError, r"balance \[2, 2\] covers 4 layers but the nn.Sequential has 5"),
        ([], 0, 1, ValueError, r"balance has 0 entries"),
    ],
)
def test_check_balance_refuses(balance, layers, stages, error, message):
    with pytest.raises(error, match=message):
        check_balance(balance, layers, stages)


@pytest.mark.parametrize(
    "sizes, stages, joined, expected",
    [
        ([100, 0, 100, 0, 50, 50], 2, {2}, [4, 2]),  # no stage may start at layer 2
        ([100, 0, 100, 0, 50, 50], 2, {3, 4}, [2, 4]),
        ([10, 10, 10, 10], 2, {2}, [1, 3]),
        ([10, 10, 10, 10], 3, {1, 3}, None),  # only 2 groups left
        ([0, 10, 0, 10, 10], 2, {4}, [3, 2]),
    ],
)
def test_balance_by_parameters_never_starts_a_stage_at_a_joined_layer(sizes, stages, joined, expected):
    if expected is None:
        with pytest.raises(ValueError, match=r"only 2 group\(s\).*share a module or parameter"):
            balance_by_parameters(sizes, stages, joined)
        return
    got = balance_by_parameters(sizes, stages, joined)
    assert got == expected
    starts = [sum(got[:k]) for k in range(1, len(got))]
    assert not set(starts) & joined
