"""The host's interfaces, typed: /proc, NVML, cgroup cpusets, subordinate ids, child programs."""
