"""The old path of the DLRM-style demo, kept working: see :mod:`remote_module.demos.dlrm`.

``python -m remote_module.dlrm_demo`` runs the demo; ``import remote_module.dlrm_demo`` gives
the module :mod:`remote_module.demos.dlrm` itself.
"""

import sys

from remote_module.demos import dlrm as _dlrm

if __name__ == "__main__":
    _dlrm.main()
elif __name__ == "remote_module.dlrm_demo":  # imported: the real module
    sys.modules[__name__] = _dlrm
