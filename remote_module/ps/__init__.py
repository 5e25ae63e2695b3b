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
:class:`Checkpointer` saves a whole job (the servers' objects, each trainer's model, optimizer,
scheduler, data and RNG states, the step) every N steps, and resumes a restarted job exactly.

Inside, by concept (a test, tests/_layers.py, reads the imports and holds this map):

- ``ps/_*.py``, shared by both kinds of owner of server-side parameters and importing only each
  other: ``_placement`` (slicing and dispatch), ``_options`` (the arguments a PSModel and the
  tables share, checked once), ``_modes`` (the modes, written once for both servers),
  ``_rowwise`` (row-wise optimizers), ``_optimizer`` (ps_optimizer and the hook on local
  optimizer steps) and ``_steps`` (the step transport: push plans, one message per server,
  pushes in flight);
- ``dense/``: PSModel, its step, its checkpoints and its server; it imports shared modules only,
  never ``tables/`` (it steps the tables inside it through the ``_steps.SteppedTable`` protocol);
- ``tables/``: the trainer's side of the tables (ShardedEmbedding(Bag), the collection, packed
  planning, lookups, prefetch, gradient recording, pushes, the geo cache, checkpoints); it never
  imports ``dense/``;
- ``tables/server/``: the table servers (table state, RPC handlers and the requests they take,
  row storage, initial rows, pooling, memory); it never imports the trainer's side;
- ``tables/lifetime/``: the parts a table server composes for long-lived tables (admission,
  eviction, deltas); they import only row storage and initial rows;
- ``checkpoint/``: checkpoints: shard files and manifests of what lives on servers, and the
  job's Checkpointer and its resume; it sits above the others and may import any of them
  (shared, dense/, tables/ and its parts); none of them imports it.

No module of ps/ imports ``remote_module.ps`` itself: this file only gives the public names.
"""

from remote_module.ps._modes import StepNotApplied, StepRefused
from remote_module.ps._placement import Block, HashName, RoundRobin, slice_blocks
from remote_module.ps.checkpoint._checkpointer import Checkpointer
from remote_module.ps.checkpoint._manifest import CheckpointError
from remote_module.ps.checkpoint._shards import end_save_chain, load_shards, save_shards
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
    "StepNotApplied", "save_shards", "load_shards", "end_save_chain", "CheckpointError", "Checkpointer",
]
