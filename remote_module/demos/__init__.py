"""What ``make demo`` and ``make demo-hybrid`` run.

- :mod:`remote_module.demos.dlrm`: a DLRM-style click model whose embedding tables live on
  parameter servers (``make demo``; ``python -m remote_module.demos.dlrm``);
- :mod:`remote_module.demos.hybrid`: a hybrid model, a remote ``EmbeddingBag`` and a local
  ``Linear`` (``make demo-hybrid``; ``python -m remote_module.demos.hybrid``);
- :mod:`remote_module.demos.progress`: their progress bar.
"""
