"""Dense parameters on parameter servers: :class:`PSModel` (``_model``), its checkpoints
(``_checkpoints``) and the servers' side of its blocks (``_server``). Its public names are
``remote_module.ps``'s; nothing here imports ``remote_module.ps.tables``."""
