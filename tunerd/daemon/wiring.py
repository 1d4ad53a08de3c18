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

from tunerd.adapters import procfs
from tunerd.adapters.subids import SubIds
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import Failed, TunerdError, UsageError
from tunerd.base.safefs import prepare_dir
from tunerd.daemon.app import Daemon, Service
from tunerd.daemon.cmd_bind import BindCommands
from tunerd.daemon.cmd_core import CoreCommands
from tunerd.daemon.cmd_env import EnvCommands, NcclConfFile
from tunerd.daemon.cmd_host import HostCommands
from tunerd.daemon.cmd_leases import LeaseCommands
from tunerd.daemon.cmd_monitor import MonitorCommands
from tunerd.daemon.cmd_topology import TopologyCommands
from tunerd.daemon.config import DaemonConfig, device_nodes
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
from tunerd.jobs.external import ExternalHolds
from tunerd.jobs.gate import ReservationGate
from tunerd.jobs.gpuuse import GpuUse
from tunerd.jobs.intake import Intake
from tunerd.jobs.journal import BindJournal
from tunerd.jobs.leases import LeaseService
from tunerd.jobs.ledger import Ledger
from tunerd.jobs.pipeline import BindPipeline, BindRequest, BindSource
from tunerd.jobs.placement import Placement, mems_of
from tunerd.jobs.placer import HostCapacity, Placer
from tunerd.jobs.podresources import PodResourcesSource
from tunerd.jobs.registry import JobRegistry
from tunerd.jobs.scope import ProcessScope
from tunerd.monitor.facts import FleetFacts
from tunerd.monitor.service import Monitor, MonitorSettings
from tunerd.policy import NodeFacts, Policy
from tunerd.topology import Topology, load_topology
from tunerd.topology.iopath import GpuNic
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
    return _Wiring(cfg, errors).build(pidlock)


class _Wiring:
    """The daemon's services, built in order by ``build``; the callbacks services are
    given are this object's methods (no closures), each naming what it reads."""

    def __init__(self, cfg: DaemonConfig, errors: ErrorLog) -> None:
        self.cfg = cfg
        self.errors = errors
        self.replay = (f"topology replay ({cfg.topology}): GPU settings are not applied"
                       if cfg.topology is not None else None)
        self._io_cache: dict[str, Any] = {}
        self._nics: tuple[Topology, dict[int, tuple[GpuNic, ...]]] | None = None

    def build(self, pidlock: PidLock) -> Daemon:
        cfg = self.cfg
        prepare_dir(cfg.state_dir, 0o700, "state dir")
        self._stores()
        topology = load_topology(cfg.topology)
        if cfg.debug_nvml_replay is not None or cfg.debug_gpu_processes is not None \
                or cfg.debug_gpu_device_nodes is not None:
            _replay_nvml(cfg, topology)
        self.policy = PolicyHolder(cfg.policy_dir, NodeFacts.from_topology(topology))
        self.policy.put(self.policy.load())  # a bad policy at start: PolicyError, exit 1
        self._bind_domain(topology)
        self._host()
        self._monitor(topology)
        self._cpusets()
        self.topology_cmds = TopologyCommands(topology)
        hotplug = TopologyWatch(topology, self.topology_changed,
                                replay=cfg.topology is not None)
        # a change of the policy dir (a ConfigMap's ..data swap) reloads as SIGHUP does
        policywatch = PolicyWatch(cfg.policy_dir, self.reload)
        services: list[Service] = [self.jobs, self.placer, self.leases, self.autobind,
                                   self.gpuuse, self.host, self.monitor, self.cpusets,
                                   policywatch, hotplug, self.pods]
        self.daemon = self._daemon(services, pidlock)
        self._commands()
        return self.daemon

    # -- the parts, in the order built ---------------------------------------------
    def _stores(self) -> None:
        """Host originals: durable (fsync, backup copy); per-process state: tmpfs."""
        cfg = self.cfg
        self.durable = DurableStore(cfg.state_path)
        self.runtime = RuntimeStore(cfg.runtime_dir / "state.json", legacy=self.durable)
        self.durable.load()  # StateDamaged (one line naming the file and the way out)
        self.runtime.load()
        for store in (self.durable, self.runtime):
            if store.load_error:
                self.errors.record("state", store.load_error, key=str(store.path))

    def _bind_domain(self, topology: Topology) -> None:
        """The bind domain: registry, placer (the ledger), gate, intake, pipeline,
        leases and the rules' binder."""
        cfg, policy, save = self.cfg, self.policy, self.runtime.save
        self.ledger = Ledger()
        binder = Actuator()  # processes live in the real /proc
        leases_section: dict[str, Any] = self.runtime.section("leases")
        leases_section.setdefault("moved", {})
        self.mover = ExclusiveMover(leases_section["moved"], save, dry_run=cfg.dry_run)
        # exact: the registry stores and deletes whole records (a save compares only those)
        self.jobs = JobRegistry(binder, self.runtime.section("bindings", exact=True), save,
                                self.ledger, self.errors, dry_run=cfg.dry_run,
                                mover=self.mover)
        self.placer = Placer(topology, HostCapacity.read(), policy.housekeeping,
                             dry_run=cfg.dry_run)
        self.subids = SubIds(cfg.subuid_file)  # a user's subordinate uids count as her
        gate = ReservationGate(policy.lease_limits, policy.default_nofile, subids=self.subids)
        self.intake = Intake(topology, self.placer.host.cpus, bound=self.jobs.rank_cpus,
                             lease=self.placer.lease_of, ledger=self.ledger)
        # every bind of a process: tunerctl bind, rules, run, workers, cpuset re-binds
        self.pipeline = BindPipeline(
            self.jobs, self.placer, gate, self.intake, binder,
            max_per_user=cfg.max_binds_per_user, bind_delay=cfg.debug_bind_delay,
            journal=BindJournal(None if cfg.dry_run else cfg.runtime_dir / "binds-in-flight"))
        self.leases = LeaseService(self.pipeline, self.ledger, self.mover, leases_section,
                                   save, self.errors, limits=policy.lease_limits,
                                   default_nofile=policy.default_nofile)
        # a test daemon: rules (and cpuset re-binds) touch only its test's process subtree
        self.scope = (ProcessScope(cfg.scope_pid, ledger=self.ledger)
                      if cfg.scope_pid is not None else None)
        self.autobind = AutoBinder(self.pipeline, self.ledger, self.mover, self.errors,
                                   scope=self.scope, default_nofile=policy.default_nofile,
                                   gate=gate, use_connector=cfg.watch_execs,
                                   realtime=cfg.exec_watch_realtime,
                                   record_delay=cfg.debug_apply_delay,
                                   external=ExternalHolds(self.placer, self.ledger,
                                                          self.runtime.section("external"),
                                                          save))
        self.autobind.rescan_hooks.append(self.leases.rescan)  # leases die with their job

    def _host(self) -> None:
        cfg = self.cfg
        tuners = build_tuners(cfg.proc_root, cfg.sys_root, cfg.etc_root,
                              gpu_unavailable=self.replay, irq_context=self.irq_context,
                              topology=self.host_topology)
        self.host = HostSettings(tuners, self.durable.section("host"), self.durable.save,
                                 self.errors, state_path=cfg.state_path, dry_run=cfg.dry_run,
                                 verify_interval=cfg.verify_interval,
                                 apply_delay=cfg.debug_apply_delay,
                                 plan_only=_plan_only(cfg))

    def _monitor(self, topology: Topology) -> None:
        cfg = self.cfg
        self.nccl_tuner = NcclTuner(cfg.etc_root)
        self.fleet = FleetFacts(nccl_conf=self.nccl_conf, proc_root=cfg.proc_root,
                                sys_root=cfg.sys_root,
                                gpu_pci=[(g.index, g.pci_bus_id) for g in topology.gpus],
                                python=str(cfg.job_python) if cfg.job_python is not None
                                else None)
        self.fleet.io_path = self.io_path
        self.monitor = Monitor(MonitorSettings(interval=cfg.sample_interval,
                                               history_seconds=cfg.history_seconds,
                                               metrics_listen=cfg.metrics_listen),
                               self.jobs, self.errors, daemon_facts=self.daemon_facts,
                               fleet=self.fleet,
                               uid_sees_all=ProcVisibility(str(cfg.proc_root)).uid_sees_all)
        # processes a launch started without a rank variable (mp.spawn): placed by the
        # rules at their first GPU use, seen in the monitor's GPU sample
        self.gpuuse = GpuUse(self.autobind, self.intake, self.jobs, scope=self.scope,
                             listing=self.monitor.gpu_processes)

    def _cpusets(self) -> None:
        # Kubernetes: the GPUs each pod got, as one more allocation source (like Slurm's)
        self.pods = PodResourcesSource(self.cfg.pod_resources_socket)
        add_gpu_source(self.pod_gpus)
        # its backstop poll runs in the monitor's sampling thread, on that thread's timer
        self.cpusets = CpusetWatch(self.bound_cpus, self.rebind_inside, bound=self.jobs.pids,
                                   on_change=self.pods.invalidate,
                                   ticker=self.monitor.interval, ledger=self.ledger)
        self.monitor.cycle_hooks.append(self.cpusets.poll_elsewhere)
        self.jobs.on_change(self.cpusets.changed)  # it follows binds and exits

    def _daemon(self, services: list[Service], pidlock: PidLock) -> Daemon:
        cfg = self.cfg
        self.router = Router()
        self.nccl_file = NcclConfFile(cfg.runtime_dir, dry_run=cfg.dry_run)
        server = ControlServer(self.router, cfg.socket_path, idle_timeout=cfg.client_timeout,
                               max_connections_per_user=cfg.max_connections_per_user,
                               max_reply=cfg.max_reply_bytes,
                               owner=self.subids.owner)
        return Daemon(server=server, services=services, policy=self.policy,
                      errors=self.errors, notifier=Notifier.from_env(),
                      on_policy=[("host", self.host.policy_changed),
                                 ("autobind", self.rules_changed),
                                 ("fleet", self.fleet_changed),
                                 ("nccl-file", self.nccl_file.policy_changed)],
                      dry_run=cfg.dry_run, replay=cfg.topology,
                      pidfile=cfg.runtime_dir / "tunerd.pid", pidlock=pidlock)

    def _commands(self) -> None:
        router, autobind = self.router, self.autobind
        self.preview = PolicyPreview(self.policy, self.host, autobind)
        self.preview.register(router)
        CoreCommands(self.daemon.status, self.daemon.reload, self.policy,
                     refuse_rebind=self.preview.refuse_rebind).register(router)
        if not self.cfg.reload_rebinds_running:
            self.daemon.reload_guard = self.refuse_for_root
        BindCommands(self.pipeline, self.leases, left_alone=autobind.left_alone_now,
                     external=autobind.external.listing).register(router)
        LeaseCommands(self.leases).register(router)
        HostCommands(self.host, policy_error=self.policy_error).register(router)
        self.topology_cmds.register(router)
        EnvCommands(self.policy, self.nccl_file,
                    topology=self.current_topology,
                    housekeeping=self.placer.housekeeping).register(router)
        MonitorCommands(self.monitor, settings_for=self.settings_for,
                        left_alone=autobind.left_alone_now, gpu_nics=self.pairing,
                        self_pinned=self.self_pinned_findings).register(router)

    # -- callbacks the services are given ----------------------------------------------
    def irq_context(self) -> IrqContext:
        """The CPUs interrupts may use now: none a rank holds (the ledger's
        ``held_cpus``: rule-bound, launcher-identified and self-pinned ranks, root's
        binds; never a user's plain bind)."""
        placer = self.placer
        gpus = [] if self.replay else [(g.index, g.pci_bus_id) for g in placer.topo.gpus]
        return IrqContext(online=placer.host.cpus, held=placer.held_cpus(steering=True),
                          housekeeping=placer.housekeeping(), gpus=gpus)

    def host_topology(self) -> Topology | None:
        return None if self.replay else self.placer.topo

    def current_topology(self) -> Topology:
        return self.topology_cmds.topology

    async def reload(self) -> dict[str, Any]:
        return await self.daemon.reload()

    def daemon_facts(self) -> dict[str, float | None]:
        """Daemon health for the metrics (read from the HTTP thread: plain values only)."""
        host, autobind = self.host, self.autobind
        return {"policy_rejected": 1.0 if self.policy.error else 0.0,
                "host_enforcing": 1.0 if host.enforcing else 0.0,
                "host_drifted": float((host.last_verify or {}).get("drift", 0)),
                "host_failed": float(len(host.failed)),
                "rule_bind_failures": float(autobind.failed),
                "rule_matches": float(autobind.matched),
                "irq_reapplied": float(host.irq_reapplied)}

    def nccl_conf(self) -> tuple[dict[str, str], str | None]:
        """The managed nccl.conf keys and the NCCL_SOCKET_IFNAME in force (a scrape's
        thread)."""
        conf = self.nccl_tuner.load()
        return dict(conf.block), self.nccl_tuner.current_of(conf, "NCCL_SOCKET_IFNAME")

    def gpu_nics(self) -> dict[int, tuple[GpuNic, ...]]:
        """Each GPU's NICs, best first: computed once per topology (``io_path`` and
        ``advise`` read the same pairing)."""
        from tunerd.topology.iopath import gpu_nics

        topo = self.placer.topo
        if self._nics is None or self._nics[0] is not topo:
            self._nics = (topo, gpu_nics(topo))
        return self._nics[1]

    def pairing(self) -> dict[str, Any]:
        from tunerd.topology.iopath import pairing_json

        return pairing_json(self.gpu_nics())

    def io_path(self) -> dict[str, str]:
        """tunerd_io_path_info's labels (a scrape's thread: plain reads; the topology part
        is read again at most once a minute)."""
        import time

        cache = self._io_cache
        now = time.monotonic()
        if not cache or now - cache["t"] > 60:
            pairing = ",".join(f"{g}:{ps[0].tier}" if ps else f"{g}:-"
                               for g, ps in self.gpu_nics().items())
            cache.update(t=now, pairing=pairing, acs=self._acs())
        if not self.policy.model.irq.devices:
            irq = "off"
        else:
            st = self.host.irq_status()
            irq = ("not placed: " + ",".join(sorted(st["not_placed"]))
                   if st["not_placed"] else "placed")
        return {"irq": irq, "acs": cache["acs"], "pairing": cache["pairing"]}

    def _acs(self) -> str:
        """Bridges with ACS source validation on (``n/a`` on a replayed topology)."""
        from tunerd.topology.pcicfg import read_function

        if self.replay:
            return "n/a"
        pcie: Any = self.host.tuners.get("pcie")
        bridges = pcie.bridges() if pcie is not None else []
        return str(sum(1 for b in bridges
                       if read_function(b, self.cfg.sys_root).acs_source_validation))

    async def fleet_changed(self, new: Policy) -> None:
        self.fleet.policy_changed(new.model.info.names, self.policy.facts.gpu_models,
                                  new.data)

    async def rules_changed(self, new: Policy) -> None:
        await self.autobind.apply_rules(self.policy.rules())

    async def rebind_inside(self, pid: int, cpus: frozenset[int]) -> str | None:
        """The kubelet changed pid's cpuset: its binding again, inside the new set (the
        CPUs bound)."""
        scope = self.scope
        if scope is not None and not scope.admits(pid):
            raise Failed(f"pid {pid} is out of this daemon's scope (--scope-pid "
                         f"{scope.root}): left alone", pid=pid)
        out = await self.pipeline.bind(BindRequest(pid, Peer(os.getpid(), 0, 0),
                                                   BindSource.CPUSET,
                                                   placement=Placement.given(cpus, None)))
        return out.record.cpus if out.record is not None else None

    def pod_gpus(self, pid: int, topo: Topology) -> tuple[tuple[int, ...], str] | None:
        a = self.pods.lookup(pid, topo)
        return None if a is None else (a.gpus, f"Kubernetes pod {a.namespace}/{a.pod}")

    def bound_cpus(self, pid: int) -> tuple[int, str] | None:
        b = self.jobs.record(pid)
        return (b.start_time, b.cpus) if b is not None and b.cpus else None

    def topology_changed(self, new: Topology) -> None:
        """CPUs or memory hot-plugged: place on the node as it is now."""
        placer, intake = self.placer, self.intake
        placer.topo, placer.host = new, HostCapacity.read()
        intake.topo, intake.online = new, placer.host.cpus
        self.topology_cmds.topology = new
        self.cpusets.wake()  # effective cpusets change with the CPUs online, unnotified

    def settings_for(self, pid: int) -> dict[str, Any]:
        name = self.autobind.rule_name(pid)
        if name is None:
            return {}
        for rule in self.autobind.rules.rules:
            if rule.name == name:
                return rule.torch.to_dict()
        return {}

    def self_pinned_findings(self, pid: int) -> list[dict[str, Any]]:
        """``advise`` on a self-pinned rank the ledger holds: its CPUs against its GPUs'
        slice, its memory's NUMA nodes against its CPUs' (numa_maps, on a NUMA host)."""
        from tunerd.diagnose.advise import self_pinned
        from tunerd.topology.nodemap import node_map

        placer = self.placer
        res = next((r for r in placer.external_holds() if r.pid == pid), None)
        if res is None:
            return []
        topo = placer.topo
        slice_cpus = node_map(topo, placer.housekeeping()).slice_cpus(res.uses_gpus)
        pages: dict[int, int] = {}
        if len(placer.host.mems) > 1:  # one node: nothing is remote (and no walk)
            try:
                pages = procfs.Process(pid).numa_pages()
            except TunerdError:
                pages = {}
        found = self_pinned(res.cpus, res.uses_gpus, slice_cpus, mems_of(topo, res.cpus),
                            pages)
        return [f.to_dict() for f in found]

    def policy_error(self) -> str | None:
        """The error of the policy files on disk, while the last good policy holds."""
        return self.policy.error

    def refuse_for_root(self, p: Policy) -> str | None:  # SIGHUP comes from root
        return self.preview.refuse_rebind(p, 0)


def _plan_only(cfg: DaemonConfig) -> str | None:
    """Why host settings are planned, never written: a replayed topology is another
    node's, so its policy's sysctls, NICs and nccl.conf are not this machine's to get
    (unless asked with --apply-host-settings)."""
    if cfg.topology is None or cfg.apply_host_settings:
        return None
    return (f"topology replay of {cfg.topology}; tunerd --apply-host-settings writes them")


def _replay_nvml(cfg: DaemonConfig, topology: Topology) -> None:
    """NVML answered from the snapshot plus a recording's driver and telemetry
    (``debug_nvml_replay``, tests only: one node of a test fleet runs another driver)
    and the compute processes a test lists (``debug_gpu_processes``)."""
    from tunerd.adapters import nvml
    from tunerd.jobs.gate import set_test_device_nodes
    from tunerd.topology.nvml_recording import RecordedNvml
    from tunerd.topology.nvml_replay import ReplayNvml

    if cfg.topology is None and (cfg.debug_gpu_processes or cfg.debug_gpu_device_nodes):
        raise UsageError("debug_gpu_processes and debug_gpu_device_nodes stand in for a "
                         "snapshot's GPUs: they need --topology")
    if cfg.debug_gpu_device_nodes is not None:
        set_test_device_nodes(device_nodes(cfg.debug_gpu_device_nodes))
    if cfg.debug_nvml_replay is not None:
        nvml.set_backend(RecordedNvml(topology, cfg.debug_nvml_replay,
                                      cfg.debug_gpu_processes))
    else:
        nvml.set_backend(ReplayNvml(topology, processes=cfg.debug_gpu_processes))
