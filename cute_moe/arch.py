"""The GPU architecture the CuTe DSL compiles for, set once for the whole package.

WGMMA, TMA multicast and ``setmaxnreg`` are sm_90a features (the ``a``: Hopper's
architecture-specific PTX), and the DSL reads ``CUTE_DSL_ARCH`` when cutlass is first imported, so
``cute_moe/__init__.py`` imports this module before any module that imports cutlass; a CPU then
compiles the PTX an H200 runs.  A value already in the environment wins.
"""

import os

ARCH = "sm_90a"

os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
