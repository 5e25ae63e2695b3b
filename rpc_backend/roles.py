"""Worker names from a role spec: ``{"ps": 2, "trainer": 2}`` -> ps0, ps1, trainer0, trainer1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from rpc_backend.options import positive_int


@dataclass(frozen=True)
class RankPlacement:
    """Where a rank sits in a job: its worker name, role and index within the role (not to be
    confused with torch's tensor ``Placement``, which ``remote_module.sharded`` uses)."""

    name: str
    role: str
    role_rank: int
    role_size: int


#: The name this class had before; kept so that code written against it keeps working.
Placement = RankPlacement


def placements(world_size: int, roles: Mapping[str, int] | None = None) -> list[RankPlacement]:
    """One :class:`RankPlacement` per rank, in rank order (roles fill ranks in the spec's order).

    Without ``roles`` every rank is ``worker<rank>`` with role ``worker``.

    Example::

        >>> [p.name for p in placements(3, {"ps": 1, "trainer": 2})]
        ['ps0', 'trainer0', 'trainer1']
    """
    world_size = positive_int(world_size, "world_size", wrong_type=ValueError)
    if roles is None:
        return [RankPlacement(f"worker{r}", "worker", r, world_size) for r in range(world_size)]
    if not isinstance(roles, Mapping) or not roles:
        raise TypeError(f"roles must be a non-empty mapping of role name to count, got {roles!r}")
    out: list[RankPlacement] = []
    for role, count in roles.items():
        if not isinstance(role, str) or not role.isidentifier():
            raise ValueError(f"role names must be identifiers such as 'ps' or 'trainer', got {role!r}")
        count = positive_int(count, f"role {role!r}", wrong_type=ValueError,
                             message="{what} needs a positive int count, got {value!r}")
        out.extend(RankPlacement(f"{role}{i}", role, i, count) for i in range(count))
    if len(out) != world_size:
        spec = ", ".join(f"{r}={c}" for r, c in roles.items())
        raise ValueError(f"roles ({spec}) add up to {len(out)} workers but the world has {world_size}")
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise ValueError(f"roles give duplicate worker names: {names}")
    return out
