"""The composition root: every service of the daemon is built here, explicitly.

Each service gets only what it needs: its section of the state, the binder, the
pid watcher, the topology, the placing service, and typed views of the policy.
Command handlers are registered here by plain imports. Nothing else in the
daemon constructs services or looks them up by name.

    tunerctl ──socket──▶ ControlServer ─▶ Router ─▶ *Commands ─▶ services
                                                         │
      exec events ─▶ AutoBinder ─┐                       ▼
      alloc/run  ─▶ LeaseService ┼──▶ BindPipeline ─▶ Placer (decide, hold), JobRegistry
      bind       ─▶ BindCommands ┤      (records), Actuator ─▶ kernel
      cpuset change ─▶ CpusetWatch┘
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tunerd.adapters.subids import SubIds
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import Failed, UsageError
from tunerd.base.safefs import prepare_dir
from tunerd.daemon.app import Daemon, Service
from tunerd.daemon.cmd_bind import BindCommands
from tunerd.daemon.cmd_core import CoreCommands
from tunerd.daemon.cmd_env import EnvCommands, NcclConfFile
from tunerd.daemon.cmd_host import HostCommands
from tunerd.daemon.cmd_leases import LeaseCommands
from tunerd.daemon.cmd_monitor import MonitorCommands
from tunerd.daemon.cmd_topology import TopologyCommands
from tunerd.daemon.config import DaemonConfig
from tunerd.daemon.host import HostSettings
from tunerd.daemon.hotplug import TopologyWatch
from tunerd.daemon.notify import Notifier
from tunerd.daemon.policyholder import PolicyHolder
from tunerd.daemon.policywatch import PolicyWatch
from tunerd.daemon.preview import PolicyPreview
from tunerd.daemon.router import Peer, Router
from tunerd.daemon.runtime import NodeClaim, PidLock
from tunerd.daemon.server import ControlServer
from tunerd.daemon.state import DurableStore, RuntimeStore
from tunerd.daemon.visibility import ProcVisibility
from tunerd.jobs.actuate import Actuator
from tunerd.jobs.allocation import add_gpu_source
from tunerd.jobs.autobind import AutoBinder
from tunerd.jobs.cpusetwatch import CpusetWatch
from tunerd.jobs.exclusive import ExclusiveMover
from tunerd.jobs.gate import ReservationGate
from tunerd.jobs.gpuuse import GpuUse
from tunerd.jobs.intake import Intake
from tunerd.jobs.journal import BindJournal
from tunerd.jobs.leases import LeaseService
from tunerd.jobs.pidwatch import PidWatch
from tunerd.jobs.pipeline import BindPipeline, BindRequest, BindSource
from tunerd.jobs.placement import Placement
from tunerd.jobs.placer import HostCapacity, Placer
from tunerd.jobs.podresources import PodResourcesSource
from tunerd.jobs.registry import JobRegistry
from tunerd.jobs.scope import ProcessScope
from tunerd.monitor.facts import FleetFacts
from tunerd.monitor.service import Monitor, MonitorSettings
from tunerd.policy import NodeFacts, Policy
from tunerd.topology import Topology, load_topology
from tunerd.tuners import IrqContext, build_tuners
from tunerd.tuners.nccl import NcclTuner

__all__ = ["build"]

log = logging.getLogger("tunerd")


def build(cfg: DaemonConfig) -> Daemon:
    """Build the daemon for ``cfg``: state, topology and policy loaded, nothing started.

    Raises TunerdError (the caller prints it and exits) when the directories, the
    state or the policy cannot be used.
    """
    errors = ErrorLog()
    # one daemon binds processes on a node, whatever its runtime dir: an unscoped one
    # that writes claims the node before it touches anything (held until it exits:
    # the kernel drops the flock with the process, SIGKILL included)
    claim = (NodeClaim.acquire(cfg.node_lock, cfg.runtime_dir)
             if cfg.scope_pid is None and not cfg.dry_run else None)
    try:
        # owned by root (or by us, unprivileged), writable by nobody else: refused otherwise
        prepare_dir(cfg.runtime_dir, 0o755, "runtime dir")
        # one daemon per runtime dir: locked before its state or socket is touched
        pidlock = PidLock.acquire(cfg.runtime_dir / "tunerd.pid")
    except BaseException:
        if claim is not None:
            claim.release()
        raise
    try:
        return _build(cfg, errors, pidlock)
    except BaseException:
        pidlock.release()
        if claim is not None:
            claim.release()
        raise


def _build(cfg: DaemonConfig, errors: ErrorLog, pidlock: PidLock) -> Daemon:
    prepare_dir(cfg.state_dir, 0o700, "state dir")
    # host originals: durable (fsync, backup copy); per-process state: tmpfs, no fsync
    durable = DurableStore(cfg.state_path)
    runtime = RuntimeStore(cfg.runtime_dir / "state.json", legacy=durable)
    durable.load()  # StateDamaged (one line naming the file and the way out): no start
    runtime.load()
    for store in (durable, runtime):
        if store.load_error:
            errors.record("state", store.load_error, key=str(store.path))
    save_runtime, save_durable = runtime.save, durable.save

    topology = load_topology(cfg.topology)
    if cfg.debug_nvml_replay is not None or cfg.debug_gpu_processes is not None:
        _replay_nvml(cfg, topology)
    policy = PolicyHolder(cfg.policy_dir, NodeFacts.from_topology(topology))
    policy.put(policy.load())  # a bad policy at start: PolicyError, exit 1

    pidwatch = PidWatch()
    binder = Actuator()  # processes live in the real /proc (proc_root is for host settings)
    leases_section: dict[str, Any] = runtime.section("leases")
    leases_section.setdefault("moved", {})
    mover = ExclusiveMover(leases_section["moved"], save_runtime, dry_run=cfg.dry_run)
    # exact: the registry stores and deletes whole records (a save compares only those)
    jobs = JobRegistry(binder, runtime.section("bindings", exact=True), save_runtime,
                       pidwatch, errors, dry_run=cfg.dry_run, mover=mover)
    placer = Placer(topology, HostCapacity.read(), policy.housekeeping,
                    dry_run=cfg.dry_run)
    subids = SubIds(cfg.subuid_file)  # a user's subordinate uids count as her
    gate = ReservationGate(policy.lease_limits, policy.default_nofile, subids=subids)
    intake = Intake(topology, placer.host.cpus, bound=jobs.rank_cpus, lease=placer.lease_of)
    # every bind of a process: tunerctl bind, rules, run, workers, cpuset re-binds
    pipeline = BindPipeline(
        jobs, placer, gate, intake, binder, max_per_user=cfg.max_binds_per_user,
        journal=BindJournal(None if cfg.dry_run else cfg.runtime_dir / "binds-in-flight"),
        bind_delay=cfg.debug_bind_delay)
    leases = LeaseService(pipeline, pidwatch, mover, leases_section, save_runtime, errors,
                          limits=policy.lease_limits, default_nofile=policy.default_nofile)
    # a test daemon: rules (and cpuset re-binds) touch only its test's process subtree
    scope = ProcessScope(cfg.scope_pid) if cfg.scope_pid is not None else None
    autobind = AutoBinder(pipeline, pidwatch, mover, errors, scope=scope,
                          default_nofile=policy.default_nofile, gate=gate,
                          use_connector=cfg.watch_execs,
                          realtime=cfg.exec_watch_realtime,
                          record_delay=cfg.debug_apply_delay)
    autobind.rescan_hooks.append(leases.rescan)  # leases die with their job
    replay = (f"topology replay ({cfg.topology}): GPU settings are not applied"
              if cfg.topology is not None else None)
    def irq_context() -> IrqContext:
        """The CPUs interrupts may use now: none a bound process or a reservation holds."""
        held: dict[int, str] = {}
        for r in placer.reservations():
            for c in r.cpus:
                held.setdefault(c, r.holder)
        for pid in jobs.pids():
            rec = jobs.record(pid)
            if rec is not None and rec.cpus:
                for c in rec.cpu_set():
                    held.setdefault(c, f"pid {pid}")
        gpus = [] if replay else [(g.index, g.pci_bus_id) for g in placer.topo.gpus]
        return IrqContext(online=placer.host.cpus, held=held,
                          housekeeping=placer.housekeeping(), gpus=gpus)

    host = HostSettings(build_tuners(cfg.proc_root, cfg.sys_root, cfg.etc_root,
                                     gpu_unavailable=replay, irq_context=irq_context,
                                     topology=lambda: None if replay else placer.topo),
                        durable.section("host"), save_durable, errors,
                        state_path=cfg.state_path, dry_run=cfg.dry_run,
                        verify_interval=cfg.verify_interval, apply_delay=cfg.debug_apply_delay)

    def daemon_facts() -> dict[str, float | None]:
        """Daemon health for the metrics (read from the HTTP thread: plain values only)."""
        return {"policy_rejected": 1.0 if policy.error else 0.0,
                "host_enforcing": 1.0 if host.enforcing else 0.0,
                "host_drifted": float((host.last_verify or {}).get("drift", 0)),
                "host_failed": float(len(host.failed)),
                "rule_bind_failures": float(autobind.failed),
                "rule_matches": float(autobind.matched),
                "irq_reapplied": float(host.irq_reapplied)}

    nccl_tuner = NcclTuner(cfg.etc_root)

    def nccl_conf() -> tuple[dict[str, str], str | None]:
        """The managed nccl.conf keys and the NCCL_SOCKET_IFNAME in force (a scrape's thread)."""
        conf = nccl_tuner.load()
        return dict(conf.block), nccl_tuner.current_of(conf, "NCCL_SOCKET_IFNAME")

    fleet = FleetFacts(nccl_conf=nccl_conf, proc_root=cfg.proc_root, sys_root=cfg.sys_root,
                       gpu_pci=[(g.index, g.pci_bus_id) for g in topology.gpus],
                       python=str(cfg.job_python) if cfg.job_python is not None else None)
    io_cache: dict[str, Any] = {}

    def io_path() -> dict[str, str]:
        """tunerd_io_path_info's labels (a scrape's thread: plain reads; the topology part
        is read again at most once a minute)."""
        import time

        from tunerd.topology.iopath import gpu_nics
        from tunerd.topology.pcicfg import read_function

        now = time.monotonic()
        if not io_cache or now - io_cache["t"] > 60:
            pairs = gpu_nics(placer.topo)
            pairing = ",".join(f"{g}:{ps[0].tier}" if ps else f"{g}:-"
                               for g, ps in pairs.items())
            if replay:
                acs = "n/a"
            else:
                pcie: Any = host.tuners.get("pcie")
                bridges = pcie.bridges() if pcie is not None else []
                acs = str(sum(1 for b in bridges
                              if read_function(b, cfg.sys_root).acs_source_validation))
            io_cache.update(t=now, pairing=pairing, acs=acs)
        sec = policy.model.irq
        if not sec.devices:
            irq = "off"
        else:
            st = host.irq_status()
            irq = ("not placed: " + ",".join(sorted(st["not_placed"]))
                   if st["not_placed"] else "placed")
        return {"irq": irq, "acs": io_cache["acs"], "pairing": io_cache["pairing"]}

    fleet.io_path = io_path
    monitor = Monitor(MonitorSettings(interval=cfg.sample_interval,
                                      history_seconds=cfg.history_seconds,
                                      metrics_listen=cfg.metrics_listen),
                      jobs, errors, daemon_facts=daemon_facts, fleet=fleet,
                      uid_sees_all=ProcVisibility(str(cfg.proc_root)).uid_sees_all)
    # processes a launch started without a rank variable (mp.spawn): placed by the
    # rules at their first GPU use, seen in the monitor's GPU sample
    gpuuse = GpuUse(autobind, intake, jobs, scope=scope, listing=monitor.gpu_processes)

    async def fleet_changed(new: Policy) -> None:
        fleet.policy_changed(new.model.info.names, policy.facts.gpu_models, new.data)

    async def rules_changed(new: Policy) -> None:
        await autobind.apply_rules(policy.rules())

    async def rebind_inside(pid: int, cpus: frozenset[int]) -> str | None:
        """The kubelet changed pid's cpuset: its binding again, inside the new set (the
        CPUs bound)."""
        if scope is not None and not scope.admits(pid):
            raise Failed(f"pid {pid} is out of this daemon's scope (--scope-pid "
                         f"{scope.root}): left alone", pid=pid)
        out = await pipeline.bind(BindRequest(pid, Peer(os.getpid(), 0, 0), BindSource.CPUSET,
                                              placement=Placement.given(cpus, None)))
        return out.record.cpus if out.record is not None else None

    # Kubernetes: the GPUs each pod got, as one more allocation source (like Slurm's)
    pods = PodResourcesSource(cfg.pod_resources_socket)

    def pod_gpus(pid: int, topo: Topology) -> tuple[tuple[int, ...], str] | None:
        a = pods.lookup(pid, topo)
        return None if a is None else (a.gpus, f"Kubernetes pod {a.namespace}/{a.pod}")

    add_gpu_source(pod_gpus)
    def bound_cpus(pid: int) -> tuple[int, str] | None:
        b = jobs.record(pid)
        return (b.start_time, b.cpus) if b is not None and b.cpus else None

    # its backstop poll runs in the monitor's sampling thread, on that thread's timer
    cpusets = CpusetWatch(bound_cpus, rebind_inside, bound=jobs.pids, on_change=pods.invalidate,
                          ticker=monitor.interval)
    monitor.cycle_hooks.append(cpusets.poll_elsewhere)
    jobs.on_change(cpusets.changed)  # it follows binds and exits, not a list of all jobs
    # a change of the policy dir (a ConfigMap's ..data swap) reloads as SIGHUP does
    policywatch = PolicyWatch(cfg.policy_dir, lambda: daemon.reload())

    topology_cmds = TopologyCommands(topology)

    def topology_changed(new: Topology) -> None:
        """CPUs or memory hot-plugged: place on the node as it is now."""
        placer.topo, placer.host = new, HostCapacity.read()
        intake.topo, intake.online = new, placer.host.cpus
        topology_cmds.topology = new
        cpusets.wake()  # effective cpusets change with the CPUs online, unnotified

    hotplug = TopologyWatch(topology, topology_changed, replay=cfg.topology is not None)
    services: list[Service] = [jobs, placer, leases, autobind, gpuuse, host, monitor,
                               cpusets, policywatch, hotplug, pods]
    router = Router()
    nccl_file = NcclConfFile(cfg.runtime_dir, dry_run=cfg.dry_run)
    server = ControlServer(router, cfg.socket_path, idle_timeout=cfg.client_timeout,
                           max_connections_per_user=cfg.max_connections_per_user,
                           max_reply=cfg.max_reply_bytes,
                           owner=subids.owner)
    daemon = Daemon(server=server, services=services, policy=policy, errors=errors,
                    notifier=Notifier.from_env(),
                    on_policy=[("host", host.policy_changed), ("autobind", rules_changed),
                               ("fleet", fleet_changed),
                               ("nccl-file", nccl_file.policy_changed)],
                    dry_run=cfg.dry_run, replay=cfg.topology,
                    pidfile=cfg.runtime_dir / "tunerd.pid", pidlock=pidlock)

    def settings_for(pid: int) -> dict[str, Any]:
        rb = autobind.bound.get(pid)
        if rb is None:
            return {}
        for rule in autobind.rules.rules:
            if rule.name == rb.rule:
                return rule.torch.to_dict()
        return {}

    preview = PolicyPreview(policy, host, autobind)
    preview.register(router)
    CoreCommands(daemon.status, daemon.reload, policy,
                 refuse_rebind=preview.refuse_rebind).register(router)
    if not cfg.reload_rebinds_running:
        def refuse_for_root(p: Policy) -> str | None:  # SIGHUP comes from root
            return preview.refuse_rebind(p, 0)

        daemon.reload_guard = refuse_for_root
    BindCommands(pipeline, leases, left_alone=autobind.left_alone_now).register(router)
    LeaseCommands(leases).register(router)
    HostCommands(host).register(router)
    topology_cmds.register(router)
    EnvCommands(policy, nccl_file, topology=lambda: topology_cmds.topology).register(router)
    def pairing() -> dict[str, Any]:
        from tunerd.topology.iopath import gpu_nics, pairing_json

        return pairing_json(gpu_nics(placer.topo))

    MonitorCommands(monitor, settings_for=settings_for,
                    left_alone=autobind.left_alone_now, gpu_nics=pairing).register(router)
    return daemon


def _replay_nvml(cfg: DaemonConfig, topology: Topology) -> None:
    """NVML answered from the snapshot plus a recording's driver and telemetry
    (``debug_nvml_replay``, tests only: one node of a test fleet runs another driver)
    and the compute processes a test lists (``debug_gpu_processes``)."""
    from tunerd.adapters import nvml
    from tunerd.topology.nvml_recording import RecordedNvml
    from tunerd.topology.nvml_replay import ReplayNvml

    if cfg.topology is None and cfg.debug_gpu_processes is not None:
        raise UsageError("debug_gpu_processes lists processes on a snapshot's GPUs: it "
                         "needs --topology")
    if cfg.debug_nvml_replay is not None:
        nvml.set_backend(RecordedNvml(topology, cfg.debug_nvml_replay,
                                      cfg.debug_gpu_processes))
    else:
        nvml.set_backend(ReplayNvml(topology, processes=cfg.debug_gpu_processes))
