"""Checkpoints whose servers write and read their own shards: :func:`save_shards`,
:func:`load_shards` and :class:`CheckpointError` (public as ``remote_module.ps``'s names).
``_manifest`` is the manifest, its checksums and the ``torch.distributed.checkpoint``
metadata (no RPC); ``_shards`` the trainer's side; the servers' side is
``tables/server/_shard_files.py``."""
