"""Checkpoints of what lives on servers, and of a whole job.

:func:`save_shards`, :func:`load_shards` and :class:`CheckpointError` (public as
``remote_module.ps``'s names): servers write and read their own shards; ``_manifest`` is the
manifest, its checksums and the ``torch.distributed.checkpoint`` metadata (no RPC), ``_shards``
the trainer's side; the servers' sides are ``tables/server/_shard_files.py`` (tables) and
``dense/_shard_files.py`` (PSModels), with the files they both write and check in
``ps/_shard_io.py``.

:class:`~._checkpointer.Checkpointer` saves the servers' objects and each trainer's own state
every N steps, and resumes a restarted job from the newest complete checkpoint
(``_checkpointer.py``; its files' layout and checks in ``_job_files.py``, what it saves of the
servers and of each trainer in ``_job_state.py``)."""
