"""User subclasses of RemoteModule (kept apart from tests/proxy/_remote.py, which must not import
remote_module)."""

from remote_module import RemoteModule


class TaggedRemoteModule(RemoteModule):
    """Must travel over RPC as itself."""


class LabelledRemoteModule(RemoteModule):
    """Declares one more attribute that travels with the proxy."""

    PICKLED_ATTRIBUTES = RemoteModule.PICKLED_ATTRIBUTES + ("label",)

    def __init__(self, remote_device, module_cls, args=None, kwargs=None, *, label: str = "", **options):
        self.label = label  # before RemoteModule.__init__, which checks every attribute is declared
        super().__init__(remote_device, module_cls, args, kwargs, **options)
