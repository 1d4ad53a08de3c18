"""The [irq] tuner on recorded /sys + /proc/irq trees (the DGX H100 snapshot's devices)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.iotree import build
from tunerd.base.cpulist import parse_cpulist
from tunerd.policy.typed import IrqSection
from tunerd.topology import read_snapshot
from tunerd.tuners.irq import BALANCE_KEY, IrqContext, IrqTuner, format_mask, parse_mask

DGX = Path(__file__).parent / "fixtures" / "topologies" / "dgx-h100.json"
NODE0 = parse_cpulist("0-55,112-167")


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, dict[str, list[int]]]:
    topo = read_snapshot(DGX)
    irqs = build(tmp_path, topo)
    return tmp_path, irqs


def _tuner(root: Path, held: dict[int, str] | None = None,
           hk: frozenset[int] = frozenset()) -> IrqTuner:
    topo = read_snapshot(DGX)
    ctx = IrqContext(online=frozenset(topo.cpus), held=held or {}, housekeeping=hk,
                     gpus=[(g.index, g.pci_bus_id) for g in topo.gpus])
    return IrqTuner(root / "proc", root / "sys", root / "etc", lambda: ctx)


def test_mask_round_trip() -> None:
    assert parse_mask("00000000,00000003") == {0, 1}
    assert format_mask({0, 1}, "ffffffff,ffffffff") == "00000000,00000003"
    assert format_mask({40}, None) == "00000100,00000000"
    assert format_mask({0}, "3") == "1"  # 2 CPUs: the kernel's one short group
    assert format_mask(set(range(2, 56)) | {112}, "ffff") == \
        "00010000,00000000,00ffffff,fffffffc"
    for cpus in ({0}, {1, 33}, set(range(2, 56)) | set(range(112, 168))):
        assert parse_mask(format_mask(cpus, "ff,ffffffff")) == cpus


def test_fabric_and_gpu_interrupts_go_to_their_node_off_ranks_housekeeping_first(tree) -> None:
    root, irqs = tree
    held = {c: "pid 42 (rank 0)" for c in range(2, 16)}
    t = _tuner(root, held, hk=frozenset({0, 1}))
    changes = t.plan(IrqSection(devices=("mlx5_*", "gpu")))
    keys = {c.key for c in changes}
    # mlx5_0..7 (and the storage port mlx5_8) plus 8 GPUs, 4 vectors each
    assert len(changes) == (9 + 8) * 4 and all(c.available for c in changes)
    by_dev = {c.key.split(":")[1] for c in changes}
    assert {"mlx5_0", "mlx5_7", "gpu0", "gpu7"} <= by_dev and "ibp24s0" not in by_dev
    assert f"irq:mlx5_0:{irqs['0000:18:00.0'][0]}" in keys
    for c in changes:
        cpus = parse_cpulist(c.desired or "")
        node1 = c.key.split(":")[1] in {"mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_8",
                                        "gpu4", "gpu5", "gpu6", "gpu7"}
        if node1:
            assert cpus == parse_cpulist("56-111,168-223")
        else:
            assert cpus == {0, 1}  # housekeeping first
        assert not cpus & set(held)
    for c in changes:
        t.apply(c)
    assert t.plan(IrqSection(devices=("mlx5_*", "gpu"))) and not any(
        c.needed for c in t.plan(IrqSection(devices=("mlx5_*", "gpu"))))


def test_no_free_cpu_on_the_node_leaves_them_and_says_why(tree) -> None:
    root, _irqs = tree
    held = {c: "pid 7 (rank 3)" for c in NODE0}
    t = _tuner(root, held)
    changes = t.plan(IrqSection(devices=("mlx5_0",)))
    assert changes and all(not c.available for c in changes)
    assert "every CPU of NUMA node 0" in (changes[0].reason or "")
    assert "pid 7 (rank 3)" in t.stuck["mlx5_0"]


def test_plan_apply_verify_revert_byte_for_byte(tree) -> None:
    root, irqs = tree
    t = _tuner(root)
    sec = IrqSection(devices=("ibp24s0",), cpus=frozenset({3}))
    irq = irqs["0000:18:00.0"][0]
    f = root / "proc" / "irq" / str(irq) / "smp_affinity"
    before = f.read_bytes()
    (c, *_) = [c for c in t.plan(sec) if c.key == f"irq:ibp24s0:{irq}"]
    assert c.needed and c.desired == "3"
    saved = t.save_original(c)
    t.apply(c)
    assert f.read_text() == "00000000,00000000,00000000,00000000,00000000,00000000,00000008"
    assert not [x for x in t.plan(sec) if x.needed and x.key == c.key]  # verify: in sync
    f.write_text("ffffffff\n")  # an outside write
    assert [x for x in t.plan(sec) if x.needed and x.key == c.key]  # verify: drift
    t.revert(c.key, saved)
    assert f.read_bytes().rstrip(b"\n") == before.rstrip(b"\n")
    assert t.mentions(c.key, sec) and not t.mentions(c.key, IrqSection(devices=("gpu",)))


def test_ban_keeps_irqbalance_args_in_a_managed_block(tree) -> None:
    root, irqs = tree
    conf = root / "etc" / "default" / "irqbalance"
    conf.parent.mkdir(parents=True)
    original = '# irqbalance settings\nIRQBALANCE_ARGS="--hintpolicy=ignore"\n'
    conf.write_text(original)
    t = _tuner(root)
    changes = t.plan(IrqSection(devices=("mlx5_0",), irqbalance="ban"))
    (ban,) = [c for c in changes if c.key == BALANCE_KEY]
    ids = irqs["0000:18:00.0"]
    assert ban.desired == '"--hintpolicy=ignore ' + " ".join(f"--banirq={i}" for i in ids) + '"'
    saved = t.save_original(ban)
    t.apply(ban)
    assert "--banirq=" in conf.read_text() and conf.read_text().startswith(original)
    assert not [c for c in t.plan(IrqSection(devices=("mlx5_0",))) if c.needed
                and c.key == BALANCE_KEY]
    t.revert(BALANCE_KEY, saved)
    assert conf.read_text() == original
    assert not [c for c in t.plan(IrqSection(devices=("mlx5_0",), irqbalance="leave"))
                if c.key == BALANCE_KEY]
