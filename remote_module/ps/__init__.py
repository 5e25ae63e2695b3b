"""Parameter servers: a model's parameters sliced into blocks across server workers,
server-side optimizers, and sync / async / half-async / geo training.

:func:`slice_blocks` cuts a parameter into :class:`Block`\\ s; a dispatcher (:class:`RoundRobin`,
:class:`HashName`, or any callable ``(block_names, servers) -> servers``) places them;
:class:`PSModel` wraps a trainer's local model. :class:`ShardedEmbedding` and
:class:`ShardedEmbeddingBag` are embedding tables sliced into row blocks over the servers, with
sparse lookups and sparse updates (inside a PSModel or on their own);
:class:`ShardedEmbeddingBagCollection` looks up and pushes several tables together, one
message per server; their ``prefetch`` (or :func:`prefetching` over a batch iterator) sends the
next batch's lookups with a step's pushes. Servers run no code of their own.
A lazy table's row admission (``admit_after``, at most :data:`MAX_ADMIT_AFTER`) counts ids in a
sketch whose false admissions :func:`false_admission_rate` estimates. A sync table step the
servers refused reaches every trainer at its next lookup as :class:`StepRefused` (a
``ValueError``: the trainers' ``ps_optimizer`` settings disagree) or :class:`StepNotApplied`
(a ``RuntimeError``: the optimizer raised something else).
"""

from remote_module.ps._modes import StepNotApplied, StepRefused
from remote_module.ps._placement import Block, HashName, RoundRobin, slice_blocks
from remote_module.ps.dense._model import PSModel
from remote_module.ps.tables._collection import ShardedEmbeddingBagCollection
from remote_module.ps.tables._embedding import ShardedEmbedding
from remote_module.ps.tables._embedding_bag import ShardedEmbeddingBag
from remote_module.ps.tables._prefetching import prefetching
from remote_module.ps.tables.lifetime._admission import MAX_THRESHOLD as MAX_ADMIT_AFTER
from remote_module.ps.tables.lifetime._admission import false_admission_rate

__all__ = [
    "slice_blocks", "Block", "RoundRobin", "HashName", "PSModel", "ShardedEmbedding", "ShardedEmbeddingBag",
    "ShardedEmbeddingBagCollection", "prefetching", "MAX_ADMIT_AFTER", "false_admission_rate", "StepRefused",
    "StepNotApplied",
]
