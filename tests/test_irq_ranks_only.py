"""Only ranks steer [irq] (issue 34 item 7), and interrupts are moved at a bounded rate.

The attack: an ordinary user binds her own ``sleep`` with ``tunerctl bind`` and rebinds
it between CPU 0 and CPU 1: before, each bind counted as "CPUs a bound rank holds", so
the host's managed NIC interrupts followed her around (21 rewrites in 12 s), and
``bind --cpus 0-1`` left them no CPU at all (IRQ placement stopped). Now only ranks
(rule-bound, launcher-identified, self-pinned) and root's binds steer them. Run against
this machine's real eth0 interrupts, as the real unprivileged test user; every affinity
is restored in a ``finally``.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

from tests.helpers import run_as, write_policy
from tests.irq_helpers import (
    IRQS,
    POLICY,
    dgx_irqs,
    irq_cpus,
    irq_status,
    masks,
    needs_real_irqs,
    restore_masks,
)
from tunerd.tuners.irq import RewriteLimit, parse_mask


def _cli(sock: str, *argv: str) -> int:
    from tunerd.cli.main import main

    return main(["--socket", sock, *argv])


@needs_real_irqs
def test_a_users_binds_never_move_host_interrupts(daemon_factory, unpriv_user,
                                                  tmp_path: Path) -> None:
    uid, gid = unpriv_user
    originals = masks()
    sleeper: subprocess.Popen[bytes] | None = None
    try:
        pdir = tmp_path / "policies"
        write_policy(pdir, "00-irq.toml", POLICY)
        d = daemon_factory(policy_dir=pdir).start()
        time.sleep(0.6)  # the first checks ran: eth0's interrupts are where [irq] wants
        placed = masks()
        assert all(parse_mask(m) for m in placed.values())
        sock = str(d.socket)
        sleeper = subprocess.Popen(["sleep", "120"], user=uid, group=gid, extra_groups=[])
        pid = str(sleeper.pid)
        t_end = time.monotonic() + 3.0
        n = 0
        while time.monotonic() < t_end:  # her own process, rebound between CPU 0 and 1
            assert run_as(uid, gid, _cli, sock, "bind", pid, "--cpus", str(n % 2)) == 0
            n += 1
            time.sleep(0.1)
            assert masks() == placed, n
        assert run_as(uid, gid, _cli, sock, "bind", pid, "--cpus", "0-1") == 0
        time.sleep(0.8)  # three checks
        irq = irq_status(d)
        assert not irq["not_placed"], irq  # her bind does not stop IRQ placement
        assert masks() == placed
        assert "their CPUs changed" not in d.log() and "irq: " not in d.log().replace(
            "irq: placed", ""), d.log()[-2000:]

        # root's bind of the same process does steer them (a root decision)
        assert d.ctl("bind", pid, "--cpus", "1").rc == 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and any(1 in irq_cpus(i) for i in IRQS):
            time.sleep(0.05)
        assert all(irq_cpus(i) == {0} for i in IRQS)
        assert d.ctl("revert").rc == 0
    finally:
        restore_masks(originals)
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
    assert masks() == originals


def test_rewrites_of_one_interrupt_are_rate_limited(tmp_path: Path) -> None:
    """On the recorded DGX H100 tree: the CPUs ranks hold flip every check (root's binds
    moving); each interrupt is rewritten at most 4 times per 10 s, the rest held back
    (counted) and written once the window allows."""
    dgx = dgx_irqs(tmp_path, frozenset({0, 1, 2, 3}))
    host, tuner, ctx, proc = dgx.host, dgx.tuner, dgx.ctx, dgx.proc
    clock = [0.0]
    host.irq_limit = RewriteLimit(clock=lambda: clock[0])
    ids = dgx.irqs["0000:18:00.0"]
    writes = {i: 0 for i in ids}

    async def run() -> None:
        await host._apply_changes(tuner.plan(host._policy.model.irq), "policy")
        last = {i: (proc / str(i) / "smp_affinity").read_text() for i in ids}
        for k in range(20):  # 20 checks 0.25 s apart: 5 s, the held CPUs flipping
            ctx["held"] = {0: "pid 42", 1: "pid 42"} if k % 2 == 0 else \
                {2: "pid 42", 3: "pid 42"}
            await host.correct_irq()
            clock[0] += 0.25
            for i in ids:
                now = (proc / str(i) / "smp_affinity").read_text()
                writes[i] += now != last[i]
                last[i] = now
        assert all(n <= 4 for n in writes.values()), writes
        assert host.irq_limit.held_back == 8 * len(ids), host.irq_limit.held_back  # k=4,6,..18
        assert host.irq_status()["rate_limited_total"] == host.irq_limit.held_back
        clock[0] += 10.0  # the window passed: the interrupts go where they belong now
        await host.correct_irq()
        want = {2, 3} if ctx["held"] == {0: "pid 42", 1: "pid 42"} else {0, 1}
        assert all(parse_mask((proc / str(i) / "smp_affinity").read_text()) == want
                   for i in ids)

    asyncio.run(run())


def test_which_holds_steer_interrupts() -> None:
    """The ledger's ``held_cpus(steering=True)``: ranks (a rule's, a self-pinned one, one
    its launcher or scheduler identified) and root's binds and leases; never a user's
    plain bind or her own lease outside a scheduler's job."""
    from tunerd.jobs.placer import Reservation, ReservationKey, steers_irq

    def res(key: ReservationKey, **kw: object) -> Reservation:
        return Reservation(key=key, holder=str(key), gpus=(), cpus=frozenset({1}), **kw)  # type: ignore[arg-type]

    steer = {
        "rule": res(ReservationKey.rule(1), uid=1000),
        "external": res(ReservationKey.external(2), uid=1000, ranked=True),
        "a user's torchrun rank": res(ReservationKey.bind(3), uid=1000, ranked=True,
                                      group="torch:ppid 9"),
        "root's plain bind": res(ReservationKey.bind(4), uid=0),
        "root's lease": res(ReservationKey.lease("L1"), uid=0, soft=True),
        "a lease in a Slurm job": res(ReservationKey.lease("L2"), uid=1000, job="slurm:12"),
    }
    never = {
        "a user's plain bind": res(ReservationKey.bind(5), uid=1000),
        "a user's exclusive bind": res(ReservationKey.bind(6), uid=1000, exclusive=True),
        "a user's lease": res(ReservationKey.lease("L3"), uid=1000, soft=True),
        "a user's rank-looking bind, no launcher": res(ReservationKey.bind(7), uid=1000,
                                                       group="torch:ppid 9"),
    }
    assert [k for k, r in steer.items() if not steers_irq(r)] == []
    assert [k for k, r in never.items() if steers_irq(r)] == []
