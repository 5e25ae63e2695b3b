"""A user subclass of RemoteModule (kept apart from tests/_remote.py, which must not import
remote_module)."""

from remote_module import RemoteModule


class TaggedRemoteModule(RemoteModule):
    """Must travel over RPC as itself."""
