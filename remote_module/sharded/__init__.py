"""Shard-local computation from one controller over RPC.

One module per worker of a mesh runs on that worker's local shard (:class:`LocalModule`);
sharded remote tensors (:class:`RemoteTensor`, made by :func:`distribute` and
:func:`from_local`) keep their shards on the workers and combine by torch's placements
(``torch.distributed.tensor.Shard``, ``Replicate``, ``Partial``). Inside a shard,
:func:`mesh_rank` / :func:`mesh_size` say where it runs. A mesh is an ordered list of worker
names (1-D).
"""

from remote_module.sharded._local_module import LocalModule
from remote_module.sharded._mesh import mesh_rank, mesh_size
from remote_module.sharded._tensor import RemoteTensor, distribute, from_local

__all__ = ["RemoteTensor", "distribute", "from_local", "LocalModule", "mesh_rank", "mesh_size"]
