"""Monitoring: samplers (GPU, host, bound jobs), history rings, Prometheus exposition."""

from tunerd.monitor.gpu import GpuSampler
from tunerd.monitor.history import History
from tunerd.monitor.host import HostSampler
from tunerd.monitor.jobs import JobSampler
from tunerd.monitor.ring import Ring

__all__ = ["GpuSampler", "History", "HostSampler", "JobSampler", "Ring"]
