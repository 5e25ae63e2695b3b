"""Sharded embedding tables, the trainer's side: ``ShardedEmbedding(Bag)``, the collection,
packed planning, prefetch, gradient recording, the geo cache and checkpoints. The servers'
side is ``tables.server``; the parts a table server composes for long-lived tables
(admission, eviction, deltas) are ``tables.lifetime``. Public names are ``remote_module.ps``'s."""
