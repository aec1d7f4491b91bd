"""The build's one dynamic part: ``KVFSM_MYPYC=1`` compiles the model checker's hot modules with mypyc.

Everything else about the package is declared in pyproject.toml. The compiled modules are the same source
files: the extension is imported in place of the ``.py`` when it is there, and ``kvfsm.check.compiled()``
says which one runs. The graphs the two explore are the same (tests/test_check_fingerprints.py pins them,
and tox env ``prove`` runs those tests on the compiled build).
"""

from __future__ import annotations

import os

from setuptools import setup

#: The modules compiled: the model (successors, canonical forms, invariants) and the BFS over it.
COMPILED = ["kvfsm/check/model.py", "kvfsm/check/bfs.py"]

try:
    from mypyc.build import mypycify
except ImportError:
    # setuptools runs this file to ask for the build requirements before they are installed; the build
    # itself has mypy (build_backend/kvfsm_build.py adds it, and refuses to build without it).
    mypycify = None

if os.environ.get("KVFSM_MYPYC", "") == "1" and mypycify is not None:
    setup(ext_modules=mypycify(COMPILED, opt_level="3"))
else:
    setup()
