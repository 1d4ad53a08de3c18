"""Programs tunerd starts on a caller's behalf, often as root: never with the caller's code.

``python -c CODE`` and ``python -m MOD`` put the current directory first on
``sys.path``, so a ``json.py`` another user left in a shared directory would run as
root when root runs ``tunerctl doctor`` there. Every interpreter tunerd starts itself
(probes, the built-in workload, the ``tunerctl run`` prefix of a bench arm) runs with
``-I`` (isolated mode: no current directory or script directory on ``sys.path``, no
``PYTHON*`` variables, no user site-packages), from the root directory, with the
``PYTHON*`` variables dropped from its environment too (so that nothing it starts
picks them up either). Other helper programs (nvcc, setpci, lspci) run from ``/``.
See https://docs.python.org/3/using/cmdline.html#cmdoption-I
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["CWD", "PYTHON_VARS", "bootstrap", "python_argv", "scrubbed"]

CWD = "/"  # root-owned: nothing a user planted is found relative to it

# the variables that make an interpreter load code from somewhere else
PYTHON_VARS = ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONUSERBASE",
               "PYTHONINSPECT", "PYTHONSAFEPATH", "PYTHONPLATLIBDIR", "PYTHONEXECUTABLE",
               "PYTHONBREAKPOINT")


def scrubbed(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: ours) without the variables that load code into Python."""
    env = dict(os.environ if environ is None else environ)
    for k in PYTHON_VARS:
        env.pop(k, None)
    return env


def python_argv(python: str, *args: str) -> list[str]:
    """``python -I ARGS``: an interpreter that imports only from its own installation."""
    return [python, "-I", *args]


def bootstrap(path_dirs: list[str], module: str) -> str:
    """``-c`` code that runs ``module`` as ``__main__`` with only ``path_dirs`` added to
    ``sys.path`` (what PYTHONPATH would have done, under ``-I``)."""
    return ("import runpy, sys; sys.path[:0] = " + repr(list(path_dirs))
            + "; runpy.run_module(" + repr(module) + ", run_name='__main__', alter_sys=True)")
