"""The remote module's state as a proxy shows it: training mode and ``state_dict``.

A mixin of :class:`remote_module.RemoteModule` (before ``nn.Module`` in its bases, so these
override ``nn.Module``'s own): ``train``/``eval`` and the ``training`` flag are the host
module's, read and written on the host in program order (every proxy of one module agrees);
``state_dict``/``load_state_dict`` carry the remote entries as CPU copies under the proxy's
prefix. It uses the proxy's ``_rpc`` (a blocking call in program order, see
remote_module._proxy.calls) and ``module_rref`` (None while the proxy is not connected).

The last ``training`` value seen is the one piece of state kept under a ``__dict__`` key: the
property named ``training`` hides the instance attribute of that name from ordinary
assignment, and TorchScript builds a scripted module's own ``training`` flag from the
module's ``__dict__`` (``torch.jit._recursive`` reads ``nn_module.__dict__``), so no declared
attribute under another name would reach it.
"""

from __future__ import annotations

from typing import Any, TypeVar

from remote_module._proxy import _host
from remote_module._proxy.state_dict import entries_under, merge_remote_state

_P = TypeVar("_P", bound="RemoteModuleState")


class RemoteModuleState:
    """``train``/``eval``/``training``/``state_dict``/``load_state_dict`` of a proxy."""

    def train(self: _P, mode: bool = True) -> _P:
        """Set the remote module's training mode (on the host) and return this proxy.

        Example::

            model.train()          # reaches every RemoteModule inside the model, too
            proxy.train(False)     # same as proxy.eval()
        """
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        self._rpc(_host._train, self.module_rref, mode)
        self.__dict__["training"] = mode  # the last value seen (see the module docstring)
        return self

    def eval(self: _P) -> _P:
        """Put the remote module in evaluation mode and return this proxy."""
        return self.train(False)

    # ``training`` is the host module's flag, read and written on the host in program order, so
    # every proxy of one module (init_from_module_rref, proxies sent to other workers) tells the
    # truth. nn.Module.__init__ writes it before the proxy is connected: that write stays local.
    # The last value seen is kept in __dict__ (the property hides it) for TorchScript only, which
    # reads a module's __dict__ when scripting it (see the module docstring).
    @property
    def training(self) -> bool:  # type: ignore[override]
        """The remote module's training flag, asked of the host (a blocking call, in program order).

        Example::

            b = RemoteModule.init_from_module_rref("worker1", a.get_module_rref())
            a.eval()
            assert b.training is False       # one module on worker1
        """
        if self.module_rref is None:  # not connected yet (being built or received)
            return self.__dict__["training"]  # nn.Module.__init__ set it, through the setter
        mode = self.__dict__["training"] = self._rpc(_host._training, self.module_rref)
        return mode

    @training.setter
    def training(self, mode: bool) -> None:
        # Like ``module.training = mode`` on a local module: the host module's own flag only (its
        # submodules keep theirs; train()/eval() set them all).
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        if self.module_rref is not None:
            self._rpc(_host._set_training, self.module_rref, mode)
        self.__dict__["training"] = mode

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """CPU copies of the remote module's state, under ``prefix`` (as ``nn.Module.state_dict``).

        A model holding this proxy gets the remote entries in its own ``state_dict()``.
        ``keep_vars`` has no effect: the values are always detached copies.

        Example::

            torch.save(model.state_dict(), "ckpt.pt")   # local and remote entries
        """
        if args:  # nn.Module's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (list(args) + [destination, prefix, keep_vars][len(args):])[:3]
        state, metadata = self._rpc(_host._state_dict, self.module_rref)
        return merge_remote_state(destination, prefix, state, metadata)

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        # Called by nn.Module.load_state_dict for this proxy (directly or inside a model). The host
        # loads with the module placed at ``prefix``, so keys and messages name full keys.
        state, metadata = entries_under(state_dict, prefix)
        assign = bool(local_metadata.get("assign_to_params_buffers", False))  # load_state_dict(assign=)
        missing, unexpected, errors = self._rpc(
            _host._load_state_dict, dict(state), dict(metadata), self.module_rref, prefix, assign
        )
        missing_keys.extend(missing)
        unexpected_keys.extend(unexpected)
        error_msgs.extend(errors)
