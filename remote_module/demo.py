"""The old path of the hybrid demo, kept working: see :mod:`remote_module.demos.hybrid`.

``python -m remote_module.demo`` runs the demo; ``import remote_module.demo`` gives the module
:mod:`remote_module.demos.hybrid` itself.
"""

import sys

from remote_module.demos import hybrid as _hybrid

if __name__ == "__main__":
    _hybrid.main()
elif __name__ == "remote_module.demo":  # imported: the real module
    sys.modules[__name__] = _hybrid
