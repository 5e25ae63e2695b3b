"""Source templates of RemoteModule's generated ``forward``/``forward_async``.

Installed as ``remote_module._templates``; read with ``remote_module._proxy.codegen``.
"""
