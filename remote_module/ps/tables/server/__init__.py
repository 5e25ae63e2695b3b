"""Sharded embedding tables, the servers' side: table state, RPC handlers, row storage, initial
rows, pooling and memory. Nothing here imports the trainers' side (``remote_module.ps.tables``'
own modules)."""
