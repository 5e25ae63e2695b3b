"""Checkpoints of a whole parameter-server job: :class:`~._checkpointer.Checkpointer` saves the
servers' objects and each trainer's own state every N steps, and resumes a restarted job from
the newest complete checkpoint (``_checkpointer.py``)."""
