"""The one door to NVML (nvidia-ml-py, import name ``pynvml``).

Initialises lazily and once; every getter goes through ``call`` which returns
``NA`` (a typed "not available") instead of raising for one missing metric, as
nvitop's ``nvitop/api/libnvml.py`` does. A missing driver is not an error here:
``available()`` is False and ``reason()`` says why in words an operator can act on.

Tests replace the module behind ``call`` with a replay of recorded data through
``set_backend`` — the NVML boundary is the only place a fake is used.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final

__all__ = ["NA", "NotAvailable", "available", "call", "module", "reason", "restoring_backend",
           "set_backend", "use_backend"]


class NotAvailable:
    """Singleton for a value NVML could not give (no driver, no GPU, unsupported)."""

    _inst: NotAvailable | None = None

    def __new__(cls) -> NotAvailable:
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self) -> str:
        return "N/A"

    def __bool__(self) -> bool:
        return False


NA: Final = NotAvailable()

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "mod": None, "reason": None}


def set_backend(mod: Any | None, why: str | None = None) -> None:
    """Use ``mod`` (an object with pynvml's function names) instead of real NVML.

    ``set_backend(None, why)`` simulates a node without a driver.
    """
    with _lock:
        _state.update(tried=True, mod=mod, reason=why if mod is None else None)


@contextlib.contextmanager
def restoring_backend() -> Iterator[None]:
    """Whatever ``set_backend`` does inside the block is undone after it (tests)."""
    with _lock:
        saved = dict(_state)
    try:
        yield
    finally:
        with _lock:
            _state.clear()
            _state.update(saved)


@contextlib.contextmanager
def use_backend(mod: Any | None, why: str | None = None) -> Iterator[None]:
    """``set_backend(mod, why)`` for the block only (tests)."""
    with restoring_backend():
        set_backend(mod, why)
        yield


def _init() -> None:
    if _state["tried"]:
        return
    with _lock:
        if _state["tried"]:
            return
        _state["tried"] = True
        try:
            import pynvml
        except ImportError as err:
            _state["reason"] = f"nvidia-ml-py is not installed ({err}); pip install nvidia-ml-py"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            _state["reason"] = (
                f"NVML could not start: {err}. Is the NVIDIA driver installed and loaded? "
                "(check `nvidia-smi` and `lsmod | grep nvidia`)"
            )
            return
        except OSError as err:  # libnvidia-ml.so missing
            _state["reason"] = f"libnvidia-ml.so not found ({err}); no NVIDIA driver on this node"
            return
        _state["mod"] = pynvml


def available() -> bool:
    _init()
    return _state["mod"] is not None


def reason() -> str | None:
    """Why NVML is not available (None when it is)."""
    _init()
    return _state["reason"]


def module() -> Any:
    """The pynvml module (or the replay backend); None without a driver."""
    _init()
    return _state["mod"]


def call(name: str, *args: Any, default: Any = NA) -> Any:
    """``pynvml.<name>(*args)``, or ``default`` when NVML or that function/metric is missing.

    ``name`` may list fallbacks separated by '|' (newest first), e.g.
    ``"nvmlDeviceGetComputeRunningProcesses_v3|nvmlDeviceGetComputeRunningProcesses"``.
    """
    mod = module()
    if mod is None:
        return default
    for fn_name in name.split("|"):
        fn: Callable[..., Any] | None = getattr(mod, fn_name, None)
        if fn is None:
            continue
        try:
            return fn(*args)
        except Exception:  # NVMLError_NotSupported, NoPermission, FunctionNotFound...
            return default
    return default
