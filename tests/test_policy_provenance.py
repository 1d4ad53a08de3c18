"""Where each effective policy value came from (``policy show --explain``), and the
bundled policies sorting first so that a site file wins (issue 19, item 1)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.helpers import REPO, DaemonProc, run_ctl, wait_for, write_policy
from tunerd.policy.provenance import key_lines

SITE = '[policy]\nname = "site"\n\n[limits]\nnofile = 65536\n'


def test_key_lines_finds_headers_dotted_quoted_and_array_entries() -> None:
    text = ('[policy]\nname = "x"\n[sysctl]\n"net.core.rmem_max" = 1  # c\n'
            'note = """\nfake = 1\n"""\n[[job]]\nname = "a"\n[[job]]\nname = "b"\n'
            'match.env = { R = "*" }\n[job.torch]\nnum_workers = 2\n')
    lines = key_lines(text)
    assert lines[("sysctl", "net.core.rmem_max")] == 4
    assert ("sysctl", "fake") not in lines  # inside a multi-line string
    assert lines[("job", 0, "name")] == 9 and lines[("job", 1, "name")] == 11
    assert lines[("job", 1, "match", "env")] == 12
    assert lines[("job", 1, "torch", "num_workers")] == 14


def _install_bundled(pdir: Path, names: list[str] | None = None) -> None:
    """The README's recipe: ``install -m 0644 policies/*.toml /etc/tunerd/policies/``."""
    pdir.mkdir(parents=True, exist_ok=True)
    files = sorted((REPO / "policies").glob("*.toml"))
    subprocess.run(["install", "-m", "0644", *map(str, files), str(pdir)], check=True)
    for old, new in (names and zip(sorted(p.name for p in files), names, strict=True)) or []:
        (pdir / old).rename(pdir / new)


def test_site_file_wins_over_the_bundled_ones_and_explain_says_so(
        tmp_path: Path, daemon_factory) -> None:
    pdir = tmp_path / "pol"
    _install_bundled(pdir)
    site = write_policy(pdir, "10-site.toml", SITE)
    check = run_ctl("policy", "check", str(pdir), "--explain")  # offline, no daemon
    assert check.rc == 0 and "WARN" not in check.out, check.out
    assert f"limits.nofile = 65536\n    set by    {site}:5 (policy 'site')\n" in check.out
    d: DaemonProc = daemon_factory(policy_dir=pdir, args=["--dry-run"]).start()
    r = d.ctl("--json", "policy", "show", "--explain")
    assert r.rc == 0, r.err
    assert r.json()["limits"]["nofile"] == 65536
    got = r.json()["provenance"]["limits.nofile"]
    assert (got["file"], got["line"], got["value"]) == (str(site), 5, 65536)
    assert [(Path(o["file"]).name, o["line"], o["value"]) for o in got["overrode"]] == [
        ("00-base.toml", 7, 1048576), ("00-default.toml", 10, 1048576)]
    rule = r.json()["provenance"]['job["torch-training"].match.rank']
    assert Path(rule["file"]).name == "00-base.toml" and rule["line"] == 24
    human = d.ctl("policy", "show", "--explain").out
    assert f"limits.nofile = 65536\n    set by    {site}:5 (policy 'site')\n" in human, human
    assert f"    overrode  {pdir / '00-base.toml'}:7 = 1048576\n" in human


def test_check_warns_when_a_bundled_file_sorts_after_a_site_file(tmp_path: Path) -> None:
    """The layout of the old recipe: base.toml and default.toml sort after 10-site.toml."""
    pdir = tmp_path / "pol"
    _install_bundled(pdir, ["base.toml", "default.toml", "grace-blackwell.toml",
                            "h100-training.toml", "hgx-training.toml", "pcie-gpu.toml"])
    write_policy(pdir, "10-site.toml", SITE)
    r = run_ctl("--json", "policy", "check", str(pdir))
    assert r.rc == 0, r.err
    assert r.json()["effective"]["limits"]["nofile"] == 1048576  # the footgun, now flagged
    warns = r.json()["warnings"]
    assert len(warns) == 1, warns  # base.toml overrides it; default.toml sets the same value
    assert warns[0].startswith(f"{pdir / 'base.toml'}:7: bundled policy 'base' overrides "
                               f"limits.nofile = 65536 of {pdir / '10-site.toml'}:5 with "
                               "1048576"), warns
    assert "00-base.toml" in warns[0]
    human = run_ctl("policy", "check", str(pdir)).out
    assert "WARN " in human


def test_explain_after_a_rejected_edit_says_the_files_on_disk_differ(
        tmp_path: Path, daemon_factory) -> None:
    """`policy show --explain` shows the policy in force; after an edit the reload
    rejected it also says the file on disk differs, and why (issue 29)."""
    pdir = tmp_path / "pol"
    site = write_policy(pdir, "10-site.toml", SITE)
    d: DaemonProc = daemon_factory(policy_dir=pdir, args=["--dry-run"]).start()
    assert "NOTE" not in d.ctl("policy", "show", "--explain").out
    assert "on_disk" not in d.ctl("--json", "policy", "show").json()
    time.sleep(0.05)  # the edit's mtime after the load, on any clock granularity
    site.write_text(SITE.replace("65536", '"lots"'))
    wait_for(lambda: d.ctl("--json", "status").json()["policy"]["error"], 10,
             "the watcher's reload to reject the edit")
    human = d.ctl("policy", "show", "--explain").out
    assert human.startswith("# NOTE: the policy files on disk differ from the policy in "
                            f"force shown here:\n#   changed since it was loaded: {site}\n"
                            "#   the last reload was rejected: "), human
    assert "limits.nofile = 65536\n" in human  # what is in force, still
    js = d.ctl("--json", "policy", "show").json()
    assert js["on_disk"]["changed"] == [str(site)] and "limits.nofile" in js["on_disk"]["rejected"]
    assert "on_disk" not in d.ctl("policy", "show").out.split("\n\n", 1)[1]  # not TOML
