"""Sharded embedding tables, the servers' side: table state, RPC handlers, row storage, initial
rows, pooling, memory and the shard files a server writes and reads for checkpoints. Nothing
here imports the trainers' side (``remote_module.ps.tables``' own modules)."""
