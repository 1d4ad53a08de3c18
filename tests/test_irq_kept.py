"""[irq] kept in place (HostSettings.correct_irq) on the recorded DGX H100 tree: an outside
write is put back and counted with its likely writer; a new MSI-X vector is placed; a
process bound later moves the interrupts off its CPUs; revert restores every original."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.irq_helpers import dgx_irqs
from tunerd.tuners.irq import parse_mask


def test_rewrite_new_vector_and_a_later_bind(tmp_path: Path) -> None:
    saves: list[int] = []
    dgx = dgx_irqs(tmp_path, frozenset({0, 1}), save=lambda: saves.append(1))
    host, tuner, ctx, proc = dgx.host, dgx.tuner, dgx.ctx, dgx.proc
    ids = dgx.irqs["0000:18:00.0"]
    originals = {i: (proc / str(i) / "smp_affinity").read_text() for i in ids}

    async def run() -> None:
        # SECTIONS order: plan_all asks every section; only irq is here
        changes = await host._apply_changes(tuner.plan(host._policy.model.irq), "policy")
        assert len(changes["changed"]) == 4 and saves  # originals saved before
        assert all(parse_mask((proc / str(i) / "smp_affinity").read_text()) == {0, 1}
                   for i in ids)
        await host.correct_irq()  # the first check: nothing moved
        assert host.irq_reapplied == 0

        (proc / str(ids[1]) / "smp_affinity").write_text("ffff\n")  # irqbalance-like
        await host.correct_irq()
        assert parse_mask((proc / str(ids[1]) / "smp_affinity").read_text()) == {0, 1}
        assert host.irq_reapplied == 1
        assert host.irq_last_rewrite["keys"] == [f"irq:mlx5_0:{ids[1]}"]
        assert "no irqbalance running" in host.irq_last_rewrite["likely_writer"]

        # a new vector appears (more queues after a link came up)
        new = 999
        (tmp_path / "sys/bus/pci/devices/0000:18:00.0/msi_irqs" / str(new)).write_text("msix")
        (proc / str(new)).mkdir()
        (proc / str(new) / "smp_affinity").write_text("ffffffff\n")
        await host.correct_irq()
        assert parse_mask((proc / str(new) / "smp_affinity").read_text()) == {0, 1}
        assert host.irq_last_change["keys"] == [f"irq:mlx5_0:{new}"]
        assert host.irq_reapplied == 1  # not an outside rewrite

        # a rank bound on CPUs 0-1 later: its interrupts leave them (rest of node 0)
        ctx["held"] = {0: "pid 42", 1: "pid 42"}
        await host.correct_irq()
        for i in [*ids, new]:
            cpus = parse_mask((proc / str(i) / "smp_affinity").read_text())
            assert cpus and not cpus & {0, 1} and cpus <= set(range(56)) | set(range(112, 168))
        assert "bound" in host.irq_last_change["why"]
        st = host.irq_status()
        assert st["managed"] == 5 and st["reapplied_total"] == 1 and not st["not_placed"]

        res = await host.revert()
        assert not res["errors"]
        for i, text in originals.items():
            assert (proc / str(i) / "smp_affinity").read_text().strip() == text.strip()

    asyncio.run(run())
