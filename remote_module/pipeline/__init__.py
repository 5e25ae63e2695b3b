"""RPC pipelines: a model split into stages on several workers, micro-batches overlapping.

:class:`RemotePipeline` runs stages (``RemoteModule`` proxies) as a pipeline driven from one
caller; :func:`split_sequential` cuts a local ``nn.Sequential`` into such stages. Activations go
from host to host; the caller sends micro-batches and receives the last stage's outputs.
"""

from remote_module.pipeline._pipeline import RemotePipeline
from remote_module.pipeline._split import split_sequential

__all__ = ["RemotePipeline", "split_sequential"]
