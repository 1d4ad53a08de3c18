"""`tunerctl fleet check`: every node against its class majority, through Prometheus.

A handful of fleet-wide PromQL queries per check — one per fact, aggregated by
instance, never one per node — then the comparison here: per node class (the
``class`` label of ``tunerd_node_info``, or ``--class-label``), each node's NCCL
interface MTU and IPv4 subnet (names may differ between nodes; MTU and subnet may
not), every managed NCCL setting, driver/CUDA/NCCL versions and the policy hash
against the value most nodes of the class have. Stragglers: per multi-node job
(``job`` of ``tunerd_rank_step_seconds``), a node whose ranks' mean step time over
the window exceeds the job's median by more than the threshold, with the likely
cause where tunerd exports one. HTTP with the standard library only (fast start).
"""

from __future__ import annotations

import json
import math
import re
import socket
import statistics
import time
import urllib.parse
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from tunerd.base.errors import Failed, UsageError

__all__ = ["Finding", "Prometheus", "check_fleet", "format_findings"]

UNSET = "(unset)"
NONE = "(none)"
PSI_ABOVE = 0.2  # as advise: stalled more than a fifth of the time
TREE_CPU_ABOVE = 0.9  # the job with its DataLoader workers uses >90 % of its CPUs
THROTTLING = "sw_power_cap|hw_slowdown|sw_thermal|hw_thermal|hw_power_brake"
VERSION_KEYS = (("driver", "driver_version"), ("cuda", "cuda_version"),
                ("nccl", "nccl_version"))


@dataclass
class Finding:
    instance: str
    key: str
    value: str
    majority: str | None  # None: no majority (a tie)
    node_class: str
    nodes: int = 0  # nodes in the class
    agree: int = 0  # of them, nodes holding the majority value
    job: str | None = None  # stragglers
    ratio: float | None = None
    causes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["class"] = d.pop("node_class")
        return d


MAX_RESPONSE = 32 << 20  # bytes of one answer: a fleet's few series are far less
DEADLINE = 30.0  # seconds for the whole check, every query and redirect together
MAX_REDIRECTS = 3
_REDIRECTS = (301, 302, 303, 307, 308)


class Prometheus:
    """The HTTP API's instant queries (``/api/v1/query``), as a careful client: one
    overall deadline for every query of a check (``deadline`` seconds; ``timeout`` for
    each read), answers of at most ``max_bytes``, redirects followed only to the same
    scheme, host and port, and every answer checked for shape and finite numbers
    before it is used. Whatever goes wrong is one ``Failed`` (exit 1), a server that
    cannot be reached too (exit 3 means tunerd's daemon); never a traceback."""

    def __init__(self, url: str, timeout: float = 10.0, deadline: float = DEADLINE,
                 max_bytes: int = MAX_RESPONSE) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.netloc or not u.hostname:
            raise UsageError(f"--prometheus: not an http(s) URL: {url!r}")
        try:
            self._origin = (u.scheme, u.hostname, u.port)
        except ValueError as err:
            raise UsageError(f"--prometheus: {url!r}: {err}") from None
        self.base = url.rstrip("/")
        self.timeout = timeout
        self.deadline = deadline
        self.max_bytes = max_bytes
        self._end = time.monotonic() + deadline
        self.queries = 0

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The result vector: [{"metric": {labels}, "value": [ts, float]}, ...], series
        whose value is not a finite number left out."""
        self.queries += 1
        data = urllib.parse.urlencode({"query": promql}).encode()
        url = f"{self.base}/api/v1/query"
        for _ in range(MAX_REDIRECTS + 1):
            status, location, raw = self._post(url, data)
            if status in _REDIRECTS:
                url = self._redirect(url, location)
                continue
            break
        else:
            raise Failed(f"Prometheus at {self.base}: more than {MAX_REDIRECTS} redirects")
        try:
            body = json.loads(raw, parse_constant=_not_json)
        except (ValueError, RecursionError) as err:
            if status >= 400:
                raise Failed(f"Prometheus at {self.base} refused {promql!r}: HTTP "
                             f"{status}") from None
            raise Failed(f"Prometheus at {self.base}: not a JSON answer: {err}") from None
        if not isinstance(body, dict):
            raise Failed(f"Prometheus at {self.base}: the answer is not a JSON object")
        if status >= 400 or body.get("status") != "success":
            why = body.get("error")
            raise Failed(f"Prometheus at {self.base} refused {promql!r}: HTTP {status}: "
                         f"{why if isinstance(why, str) else body.get('status')!r}")
        return self._vector(body, promql)

    def _vector(self, body: dict[str, Any], promql: str) -> list[dict[str, Any]]:
        data = body.get("data")
        result = data.get("result", []) if isinstance(data, dict) else None
        if not isinstance(result, list):
            raise Failed(f"Prometheus at {self.base}: the answer to {promql!r} holds no "
                         "result list")
        out: list[dict[str, Any]] = []
        for i, s in enumerate(result):
            metric = s.get("metric") if isinstance(s, dict) else None
            value = s.get("value") if isinstance(s, dict) else None
            if not isinstance(metric, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in metric.items()) \
                    or not isinstance(value, list) or len(value) != 2 \
                    or not isinstance(value[1], str):
                raise Failed(f"Prometheus at {self.base}: series {i} of the answer to "
                             f"{promql!r} is not an instant vector sample "
                             '({"metric": {labels}, "value": [time, "number"]})')
            try:
                v = float(value[1])
            except ValueError:
                raise Failed(f"Prometheus at {self.base}: series {i} of the answer to "
                             f"{promql!r}: {value[1][:40]!r} is not a number") from None
            if math.isfinite(v):
                out.append({"metric": metric, "value": [value[0], v]})
        return out

    def _redirect(self, url: str, location: str | None) -> str:
        if not location:
            raise Failed(f"Prometheus at {self.base}: a redirect without a Location")
        new = urllib.parse.urljoin(url, location)
        u = urllib.parse.urlsplit(new)
        try:
            where = (u.scheme, u.hostname, u.port)
        except ValueError:
            where = (u.scheme, None, None)
        if where != self._origin:
            raise Failed(f"Prometheus at {self.base}: refused a redirect to {new[:200]!r} "
                         "(only redirects to the same scheme, host and port are followed)")
        return new

    def _left(self) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise self._late()
        return left

    def _late(self) -> Failed:
        return Failed(f"Prometheus at {self.base}: no complete answer within the overall "
                      f"deadline of {self.deadline:g} s (--deadline)")

    def _post(self, url: str, data: bytes) -> tuple[int, str | None, bytes]:
        """(status, Location, body) of a POST to ``url``, within the deadline."""
        import http.client
        import threading

        u = urllib.parse.urlsplit(url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else \
            http.client.HTTPConnection
        conn = cls(u.hostname or "", u.port, timeout=min(self.timeout, self._left()))
        # a server that sends one byte a second never lets a read time out: at the
        # deadline the connection is shut, whatever is being read
        watchdog = threading.Timer(self._left(), _shut, (conn,))
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.request("POST", (u.path or "/") + (f"?{u.query}" if u.query else ""),
                         body=data, headers={"Content-Type":
                                             "application/x-www-form-urlencoded"})
            resp = conn.getresponse()
            length = resp.getheader("Content-Length")
            if length is not None and length.strip().isdigit() \
                    and int(length) > self.max_bytes:
                raise self._big(int(length))
            chunks: list[bytes] = []
            total = 0
            while True:
                chunk = resp.read1(1 << 16)
                if not chunk:
                    break
                total += len(chunk)
                if total > self.max_bytes:
                    raise self._big(total)
                chunks.append(chunk)
                self._left()
            return resp.status, resp.getheader("Location"), b"".join(chunks)
        except (http.client.HTTPException, OSError, ValueError) as err:
            if time.monotonic() >= self._end:
                raise self._late() from None
            if isinstance(err, (http.client.HTTPException, ValueError)):
                raise Failed(f"Prometheus at {self.base}: not an HTTP answer "
                             f"({type(err).__name__}: {str(err)[:200]})") from None
            reason = getattr(err, "reason", None) or err.strerror or err
            # exit 1, not 3: 3 is "tunerd's daemon not reachable" (docs/install.md)
            raise Failed(f"cannot reach Prometheus at {self.base}: {reason}",
                         prometheus_unreachable=self.base) from None
        finally:
            watchdog.cancel()
            conn.close()

    def _big(self, size: int) -> Failed:
        return Failed(f"Prometheus at {self.base}: an answer of {size} bytes or more, "
                      f"larger than the limit of {self.max_bytes}")


def _shut(conn: Any) -> None:
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _majority(values: dict[str, str]) -> tuple[str | None, int]:
    counts = Counter(values.values()).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return None, counts[0][1]
    return counts[0][0], counts[0][1]


def _compare(classes: dict[str, list[str]], key: str, value_of: dict[str, str]
             ) -> list[Finding]:
    out = []
    for klass, nodes in sorted(classes.items()):
        if len(nodes) < 2:
            continue
        values = {n: value_of.get(n, NONE) for n in nodes}
        maj, agree = _majority(values)
        for n in sorted(nodes):
            if values[n] != maj:
                out.append(Finding(n, key, values[n], maj, klass, len(nodes), agree))
    return out


def _selector(match: str) -> str:
    """``--match 'cluster="a",rack=~"r1.*"'`` -> ``,cluster="a",rack=~"r1.*"`` (appended
    inside every selector's braces); "" for the whole fleet."""
    match = match.strip().strip(",")
    if not match:
        return ""
    if any(c in match for c in "{}") or not re.fullmatch(
            r'\s*[A-Za-z_]\w*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
            r'(,\s*[A-Za-z_]\w*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*)*', match):
        raise UsageError(f"--match: not a list of PromQL label matchers: {match!r} "
                         "(e.g. cluster=\"a\",rack=~\"r1.*\")")
    return "," + match


def check_fleet(prom: Prometheus, class_label: str = "class", window: str = "5m",
                threshold: float = 0.10, match: str = "") -> dict[str, Any]:
    """Every inconsistency and straggler of the fleet Prometheus sees (see module doc)."""
    if not class_label.isidentifier():
        raise UsageError(f"--class-label: not a Prometheus label name: {class_label!r}")
    sel = _selector(match)
    by = f"instance, {class_label}" if class_label != "instance" else "instance"
    info = prom.query(f"max by ({by}, driver, cuda, nccl) (tunerd_node_info{{{sel[1:]}}})")
    node_class: dict[str, str] = {}
    versions: dict[str, dict[str, str]] = {k: {} for _, k in VERSION_KEYS}
    for s in info:
        m = s["metric"]
        inst = m.get("instance", "")
        node_class[inst] = m.get(class_label, "")
        for label, key in VERSION_KEYS:
            versions[key][inst] = m.get(label) or UNSET
    if not node_class:  # nothing to compare is not a consistent fleet
        raise Failed(f"Prometheus at {prom.base} has no tunerd_node_info series"
                     + (f" matching {match!r}" if sel else "")
                     + ": is it scraping tunerd (0.2 or later) on every node?")
    classes: dict[str, list[str]] = defaultdict(list)
    for inst, k in node_class.items():
        classes[k].append(inst)

    findings: list[Finding] = []
    policy = {s["metric"].get("instance", ""): s["metric"].get("hash", "")
              for s in prom.query(f"max by (instance, hash) (tunerd_policy_info{{{sel[1:]}}})")}
    nics = prom.query(f'max by (instance, subnet) (tunerd_nic_mtu{{nccl="1"{sel}}})')
    mtus: dict[str, set[str]] = defaultdict(set)
    subnets: dict[str, set[str]] = defaultdict(set)
    for s in nics:
        inst = s["metric"].get("instance", "")
        mtus[inst].add(str(int(s["value"][1])))
        subnets[inst].add(s["metric"].get("subnet") or NONE)
    settings: dict[str, dict[str, str]] = defaultdict(dict)  # key -> instance -> value
    for s in prom.query(f"max by (instance, key, value) "
                        f"(tunerd_nccl_setting_info{{{sel[1:]}}})"):
        m = s["metric"]
        settings[m.get("key", "")][m.get("instance", "")] = m.get("value", "")

    findings += _compare(classes, "nccl_mtu", {i: ",".join(sorted(v, key=int))
                                               for i, v in mtus.items()})
    findings += _compare(classes, "nccl_subnet", {i: ",".join(sorted(v))
                                                  for i, v in subnets.items()})
    for key in sorted(settings):
        vals = {i: settings[key].get(i, UNSET) for i in node_class}
        findings += _compare(classes, f"nccl:{key}", vals)
    for _, key in VERSION_KEYS:
        findings += _compare(classes, key, versions[key])
    findings += _compare(classes, "policy_hash", policy)
    io: dict[str, dict[str, str]] = {"irq": {}, "acs": {}, "pairing": {}}
    for s in prom.query(f"max by (instance, irq, acs, pairing) "
                        f"(tunerd_io_path_info{{{sel[1:]}}})"):
        m = s["metric"]
        for key in io:
            io[key][m.get("instance", "")] = m.get(key, "")
    for key in ("irq", "acs", "pairing"):
        if io[key]:  # nodes of a tunerd without the series are not compared
            have = {k: [n for n in v if n in io[key]] for k, v in classes.items()}
            findings += _compare(have, f"io_{key}", io[key])
    stragglers = find_stragglers(prom, node_class, window, threshold, sel)
    return {"nodes": len(node_class), "classes": {k: len(v) for k, v in sorted(classes.items())},
            "findings": [f.to_dict() for f in findings + stragglers],
            "queries": prom.queries, "window": window, "threshold": threshold}


def _job(labels: dict[str, str]) -> str:
    """tunerd's ``job`` label: ``exported_job`` when the scrape's own ``job`` label won
    (Prometheus' default, honor_labels: false), else ``job``."""
    if "exported_job" in labels:
        return labels["exported_job"]
    return labels.get("job", "")


def find_stragglers(prom: Prometheus, node_class: dict[str, str], window: str,
                    threshold: float, sel: str = "") -> list[Finding]:
    if not window or not window[0].isdigit():
        raise UsageError(f"--window: not a Prometheus duration: {window!r}")
    series = prom.query(f"avg by (instance, job, exported_job, rank) "
                        f"(avg_over_time(tunerd_rank_step_seconds{{{sel[1:]}}}[{window}]))")
    per_job: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in series:
        m = s["metric"]
        job = _job(m)
        if not job:  # a rank that did not say which job it is part of
            continue
        per_job[job][m.get("instance", "")].append(float(s["value"][1]))
    out: list[Finding] = []
    for job, nodes in sorted(per_job.items()):
        if len(nodes) < 2:  # one node: nothing to compare with
            continue
        median = statistics.median([v for vals in nodes.values() for v in vals])
        if median <= 0:
            continue
        for inst, vals in sorted(nodes.items()):
            mean = statistics.fmean(vals)
            ratio = mean / median
            if ratio > 1.0 + threshold:
                out.append(Finding(inst, "straggler", f"{mean:.4g}s", f"{median:.4g}s",
                                   node_class.get(inst, ""), len(nodes), job=job,
                                   ratio=round(ratio, 3)))
    if out:
        _likely_causes(prom, out)
    return out


def _likely_causes(prom: Prometheus, stragglers: list[Finding]) -> None:
    """What tunerd exports that explains a slow node (fleet-wide queries, filtered here)."""
    causes: dict[str, list[str]] = defaultdict(list)
    unbound: dict[tuple[str, str], list[str]] = defaultdict(list)
    for s in prom.query("min by (instance, job, exported_job, rank) (tunerd_rank_bound) == 0"):
        m = s["metric"]
        unbound[(m.get("instance", ""), _job(m))].append(m.get("rank", ""))
    for s in prom.query(f"max by (instance) (tunerd_job_tree_cpu_saturation_ratio) "
                        f"> {TREE_CPU_ABOVE}"):
        causes[s["metric"].get("instance", "")].append(
            f"data loading CPU-starved (job with its workers at {float(s['value'][1]):.0%} of "
            "its CPUs)")
    for s in prom.query(f'max by (instance, resource) (tunerd_pressure_avg10_ratio'
                        f'{{kind="some"}}) > {PSI_ABOVE}'):
        m = s["metric"]
        causes[m.get("instance", "")].append(
            f"{m.get('resource', '?')} pressure (PSI some avg10 {float(s['value'][1]):.0%})")
    for s in prom.query(f'max by (instance, gpu, reason) (tunerd_gpu_throttle_reason_active'
                        f'{{reason=~"{THROTTLING}"}}) == 1'):
        m = s["metric"]
        causes[m.get("instance", "")].append(
            f"GPU {m.get('gpu', '?')} throttled ({m.get('reason', '?')})")
    for s in prom.query("max by (instance, gpu, width, max_width) "
                        "(tunerd_gpu_pcie_link_degraded) == 1"):
        m = s["metric"]
        causes[m.get("instance", "")].append(
            f"GPU {m.get('gpu', '?')} PCIe link at x{m.get('width', '?')} of "
            f"x{m.get('max_width', '?')}")
    for f in stragglers:
        ranks = unbound.get((f.instance, f.job or ""), [])
        if ranks:
            f.causes.append(f"rank {','.join(sorted(ranks))} unbound")
        f.causes += causes.get(f.instance, [])


def format_findings(result: dict[str, Any]) -> str:
    lines = []
    for f in result["findings"]:
        maj = f["majority"] if f["majority"] is not None else "none (a tie)"
        if f["key"] == "straggler":
            why = f"; likely: {'; '.join(f['causes'])}" if f["causes"] else ""
            lines.append(f"{f['instance']}: straggler in job {f['job']}: step {f['value']} vs "
                         f"job median {f['majority']} (ratio {f['ratio']:.2f}){why}")
        else:
            lines.append(f"{f['instance']}: {f['key']} = {f['value']} (class {f['class']}: "
                         f"majority {maj}, {f['agree']} of {f['nodes']} nodes)")
    n, c = result["nodes"], len(result["classes"])
    summary = (f"{n} node(s) in {c} class(es): "
               + (f"{len(lines)} finding(s)" if lines else "consistent"))
    return "\n".join([*lines, summary])
