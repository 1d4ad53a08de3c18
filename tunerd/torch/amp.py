"""Mixed precision and torch.compile, as the guide uses them, switchable from outside.

The guide's example: autocast plus GradScaler on CUDA (fp16 needs the scaler: its
small gradients underflow without it; bf16 has fp32's exponent range and does not),
bf16 autocast on CPU. Gradient accumulation stays in the user's loop::

    amp = tunerd.torch.Amp(device)             # mode: computed < daemon < TUNERD_AMP
    model = tunerd.torch.maybe_compile(model)  # off unless asked (TUNERD_COMPILE=1 ...)
    for i, (x, y) in enumerate(loader, 1):
        with amp.autocast():
            loss = criterion(model(x), y) / accumulation_steps
        amp.backward(loss)
        if i % accumulation_steps == 0:
            amp.step(optimizer)
            optimizer.zero_grad(set_to_none=True)

Computed default mode: CUDA: bf16 where the GPU supports it, else fp16; CPU: bf16
only on CPUs with native bf16 arithmetic (AVX512_BF16 or AMX), since elsewhere
autocast to bf16 converts in software and is slower than fp32 (on the 2-CPU dev VM
without it, nn.Linear(1024, 1024) trains ~1.4x slower in bf16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from tunerd.torch.affinity import check_process
from tunerd.torch.link import daemon_settings
from tunerd.torch.settings import (
    env_overrides,
    log,
    record,
    valid_settings,
    warn_once,
)

__all__ = ["Amp", "cpu_has_native_bf16", "maybe_compile"]


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (/proc/cpuinfo flags)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def _resolve(key: str, given: Any, computed: Any, settings: Mapping[str, Any] | None,
             env: Mapping[str, str] | None) -> tuple[Any, str]:
    value, source = (computed, "computed") if given is None else (given, "argument")
    layer = daemon_settings() if settings is None else valid_settings(settings, "settings")
    if key in layer:
        value, source = layer[key], "daemon"
    over = env_overrides(env)
    if key in over:
        value, source = over[key], "environment"
    return value, source


class Amp:
    """autocast + GradScaler for one device type ("cuda" or "cpu").

    ``mode``: "off" | "bf16" | "fp16" (None: computed; the daemon's ``amp`` setting and
    ``TUNERD_AMP`` override it). fp16 on CPU becomes bf16 (no GradScaler on CPU),
    bf16 on a GPU without it becomes fp16, each with one warning.
    """

    def __init__(self, device: Any = "cpu", mode: str | None = None, *,
                 settings: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        import torch

        self.device_type = torch.device(device).type
        cuda = self.device_type == "cuda"
        try:
            check_process()
            computed = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if cuda else \
                ("bf16" if cpu_has_native_bf16() else "off")
            chosen, self.source = _resolve("amp", mode, computed, settings, env)
        except Exception as err:
            warn_once("amp", "tunerd.torch: cannot resolve the AMP mode (%r); AMP off", err)
            chosen, self.source = "off", "fallback"
        if chosen == "fp16" and not cuda:
            warn_once("amp-fp16-cpu", "tunerd.torch: fp16 autocast needs CUDA here; using bf16")
            chosen = "bf16"
        elif chosen == "bf16" and cuda and not torch.cuda.is_bf16_supported():
            warn_once("amp-bf16-gpu", "tunerd.torch: this GPU has no bf16; using fp16")
            chosen = "fp16"
        self.mode: str = chosen
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(chosen)
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=chosen == "fp16")
        record("amp", {"amp": self.mode, "device": self.device_type, "source": self.source})
        log.info("tunerd.torch: AMP %s on %s (%s)", self.mode, self.device_type, self.source)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: Any) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: Any) -> None:
        """optimizer.step() through the scaler (which skips steps with inf/NaN grads)."""
        self.scaler.step(optimizer)
        self.scaler.update()


def maybe_compile(model: Any, enabled: bool | None = None, *,
                  settings: Mapping[str, Any] | None = None,
                  env: Mapping[str, str] | None = None, **compile_kwargs: Any) -> Any:
    """``torch.compile(model)`` when enabled (default off: compiling costs seconds to
    minutes, which short jobs never win back; the daemon's ``compile`` setting and
    ``TUNERD_COMPILE`` turn it on). A model that cannot be compiled is returned as
    is, with one warning; errors inside a compiled graph fall back to eager execution
    (torch._dynamo's suppress_errors) instead of stopping training.
    """
    try:
        on, source = _resolve("compile", enabled, False, settings, env)
    except Exception as err:
        warn_once("compile", "tunerd.torch: cannot resolve the compile setting (%r); off", err)
        on, source = False, "fallback"
    record("compile", {"compile": bool(on), "source": source})
    if not on:
        return model
    try:
        import torch
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True
        compiled = torch.compile(model, **compile_kwargs)
        log.info("tunerd.torch: torch.compile on (%s)", source)
        return compiled
    except Exception as err:
        warn_once("compile-failed", "tunerd.torch: torch.compile failed (%r); running eager",
                  err)
        return model
