"""Slow-link emulation on one machine: run a command inside a fresh network namespace whose loopback is
rate-limited with ``tc`` (htb), optionally with a netem delay; or run multi-node torchrun on an emulated
cluster of namespaces joined by shaped links (``run_on_cluster``).

On plain loopback gloo moves data at memcpy speed, so comm looks free and CPU "overlap" is mostly
contention. Inside the namespace every TCP byte between ranks crosses a shaped ``lo``, so the all-to-all
costs what it would on a real link of that rate. Only the namespace's own loopback is touched; the
namespace is created for the run and always deleted afterwards.

    from moe_comm.tools.slow_link import run_on_slow_link
    rc = run_on_slow_link(["python", "train.py"], rate="1gbit", timeout=600)

The emulated cluster (``run_on_cluster``): one namespace per node plus a hub namespace holding a bridge (the
switch); node k's interface ``node{k}`` (address 10.77.0.(101+k)/24) is one end of a veth pair whose other
end, ``port{k}``, is a port of that bridge. Both ends are shaped with htb at the inter-node rate: ``node{k}``'s
egress is what node k sends, ``port{k}``'s egress what it receives, so each node has a full-duplex link of
that rate to the switch, as a NIC does. A star through a bridge rather than veth pairs between nodes: every
node has one interface and one address whatever the node count, and a node's link is shared by all its
peers as on a real NIC. Ranks of one node reach each other over the node's own address, which Linux routes
over the namespace's unshaped ``lo``: memory speed. Everything (namespaces, veths, bridge, addresses) lives
inside namespaces the tool creates and deletes.

    from moe_comm.tools.slow_link import run_on_cluster
    res = run_on_cluster(["python", "train.py"], nodes=2, ranks_per_node=2, inter="1gbit", timeout=600)
    res.returncode, res.links[0].tx_bytes

    python -m moe_comm.tools.slow_link --nodes 2 --ranks-per-node 2 --inter-link 1gbit -- python train.py

Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN), Linux, and iproute2's ``ip`` and ``tc``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["run_on_slow_link", "run_json_worker", "json_worker_main", "parse_rate",
           "parse_delay", "link_available", "namespace_exists", "run_on_cluster", "cluster_available",
           "ClusterResult", "NodeResult", "LinkCounters", "node_address", "read_link_counters", "main"]

# tc's rate units (tc(8), "RATES"): bit-based and byte-based ("bps" is BYTES per second in tc).
_RATE_UNITS: Dict[str, float] = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40,
}
_TIME_UNITS: Dict[str, float] = {
    "s": 1.0, "sec": 1.0, "secs": 1.0, "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "us": 1e-6, "usec": 1e-6, "usecs": 1e-6,
}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]+)\s*$")
_NETNS_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# ip/tc live in /sbin or /usr/sbin, which a non-login root shell may lack on PATH.
_TOOL_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
# htb's quantum only decides how classes share spare rate; with one class it never limits the rate. Set
# explicitly because the default (rate / r2q = rate / 10) exceeds htb's 200000-byte cap above 16 mbit,
# and tc then prints "quantum of class 10010 is big" on every run.
_HTB_QUANTUM_BYTES = 200000
# SIGTERM first so the command (and e.g. its torch.distributed workers) can exit; SIGKILL after this.
_KILL_GRACE_S = 2.0


def parse_rate(rate: str) -> int:
    """A tc rate string -> bits per second (int, > 0).

    rate: str, a number and a tc unit: bit, kbit, mbit, gbit, tbit (SI), kibit..tibit (IEC), or the
        byte-based bps, kbps, mbps, gbps, tbps, kibps..tibps (tc's "bps" is BYTES per second).
        A bare number is rejected: tc reads it as bits/s, people often mean bytes, so say which.
    Example: ``parse_rate("1gbit") == 1_000_000_000``; ``parse_rate("100mbps") == 800_000_000``.
    """
    if not isinstance(rate, str):
        raise TypeError(f"rate must be a str like '1gbit', got {type(rate).__name__} {rate!r}")
    m = _QUANTITY.match(rate.lower())
    if m is None or m.group(2) not in _RATE_UNITS:
        raise ValueError(
            f"rate must be a number with a tc unit (e.g. '1gbit', '100mbit', '500kbit', '10mbps'; units "
            f"{', '.join(_RATE_UNITS)}), got {rate!r}")
    bits = int(round(float(m.group(1)) * _RATE_UNITS[m.group(2)]))
    if bits < 8:
        raise ValueError(f"rate must be at least 8bit (1 byte/s), got {rate!r} = {bits} bit/s")
    return bits


def parse_delay(delay: str) -> float:
    """A tc time string -> seconds (float, >= 0). Units: s/sec, ms/msec, us/usec; a bare number is
    rejected (tc reads it as microseconds). Example: ``parse_delay("1ms") == 0.001``."""
    if not isinstance(delay, str):
        raise TypeError(f"delay must be a str like '1ms', got {type(delay).__name__} {delay!r}")
    m = _QUANTITY.match(delay.lower())
    if m is None or m.group(2) not in _TIME_UNITS:
        raise ValueError(
            f"delay must be a number with a unit (e.g. '1ms', '250us', '0.1s'; units "
            f"{', '.join(_TIME_UNITS)}), got {delay!r}")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def _tools() -> Tuple[Optional[str], Optional[str]]:
    return shutil.which("ip", path=_TOOL_PATH), shutil.which("tc", path=_TOOL_PATH)


def _missing_requirements() -> List[str]:
    """What this machine lacks for a shaped namespace, as readable phrases (empty = nothing)."""
    missing = []
    if not sys.platform.startswith("linux"):
        missing.append(f"Linux (network namespaces; this is {sys.platform})")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        missing.append("root (network namespaces and tc need CAP_SYS_ADMIN/CAP_NET_ADMIN; run with sudo)")
    ip, tc = _tools()
    if ip is None:
        missing.append("the 'ip' command (iproute2 package)")
    if tc is None:
        missing.append("the 'tc' command (iproute2 package)")
    return missing


def _require(what: str = "slow-link emulation") -> Tuple[str, str]:
    """The paths of ``ip`` and ``tc``; RuntimeError saying what ``what`` needs when anything is missing."""
    missing = _missing_requirements()
    ip, tc = _tools()
    if missing or ip is None or tc is None:
        raise RuntimeError(f"{what} needs " + "; ".join(missing))
    return ip, tc


def _check(argv: Sequence[str], what: str) -> None:
    proc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(argv)}\n{proc.stderr.strip()}")


def namespace_exists(name: str) -> bool:
    """True when ``ip netns list`` shows a namespace called ``name``."""
    ip, _ = _require()
    out = subprocess.run([ip, "netns", "list"], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, check=True).stdout
    # Lines look like "moecomm-1-ab" or "moecomm-1-ab (id: 0)".
    return any(line.split(" ", 1)[0] == name for line in out.splitlines())


def _add_namespace(ip: str, name: str) -> None:
    # `ip netns add` creates /var/run/netns (and its bind mount) itself when it is missing.
    _check([ip, "netns", "add", name], f"creating network namespace {name!r}")


def _shape_loopback(ip: str, tc: str, name: str, rate_bits: int, delay_s: Optional[float]) -> None:
    _check([ip, "-n", name, "link", "set", "dev", "lo", "up"], f"bringing up lo in {name!r}")
    _check([tc, "-n", name, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10"],
           f"adding the htb root qdisc on lo in {name!r}")
    _check([tc, "-n", name, "class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb",
            "rate", f"{rate_bits}bit", "quantum", str(_HTB_QUANTUM_BYTES)],
           f"adding the htb class (rate {rate_bits} bit/s) on lo in {name!r}")
    if delay_s is not None:
        argv = [tc, "-n", name, "qdisc", "add", "dev", "lo", "parent", "1:10", "handle", "10:", "netem",
                "delay", f"{int(round(delay_s * 1e6))}us"]
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if proc.returncode != 0:
            hint = (" (this kernel has no netem qdisc: the sch_netem module is missing or cannot be"
                    " loaded; run without delay)" if "unknown" in proc.stderr.lower() else "")
            raise RuntimeError(f"adding a netem delay of {delay_s * 1e3:g} ms on lo in {name!r} failed"
                               f"{hint}: {' '.join(argv)}\n{proc.stderr.strip()}")


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the command and everything it started (it leads its own process group)."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _delete_namespace(ip: str, name: str) -> None:
    proc = subprocess.run([ip, "netns", "delete", name], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True)
    if proc.returncode != 0 and namespace_exists(name):
        raise RuntimeError(f"could not delete network namespace {name!r} (remove it with "
                           f"`ip netns delete {name}`): {proc.stderr.strip()}")


def run_on_slow_link(cmd: List[str], rate: str = "1gbit", delay: Optional[str] = None,
                     netns_name: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                     timeout: Optional[float] = None) -> int:
    """Run ``cmd`` inside a fresh network namespace whose loopback is shaped to ``rate``; return its exit
    code. The namespace is deleted afterwards in every case (error, timeout, KeyboardInterrupt).

    cmd: list[str], argv of the command (non-empty), run as ``ip netns exec NAME *cmd``. Its stdin,
        stdout and stderr are this process's (fd-level), so output goes where ours goes.
    rate: str, tc rate for everything sent over the namespace's ``lo`` (see ``parse_rate``), e.g. "1gbit".
        Both directions of a TCP connection share this one budget (it is one device).
    delay: str or None, a netem delay per packet such as "1ms" (see ``parse_delay``); None means none.
        Needs the kernel's sch_netem; a RuntimeError says so when it is absent.
    netns_name: str or None, the namespace's name; None means ``moecomm-<pid>-<6 hex>``. It must not
        exist yet (an existing namespace is never touched or deleted).
    env: mapping or None, the command's environment; None inherits ours.
    timeout: float seconds or None. On expiry the command's process group gets SIGTERM, then SIGKILL
        after 2 s, the namespace is deleted and ``subprocess.TimeoutExpired`` is raised.
    Returns: the exit code; -N when the command died from signal N (as ``subprocess`` reports it).
    Raises: RuntimeError when not root / not Linux / ``ip`` or ``tc`` is missing / a setup step fails;
        ValueError or TypeError for bad arguments.
    Example: ``run_on_slow_link(["python", "-c", "print(1)"], rate="100mbit")`` prints 1 and returns 0.
    """
    if isinstance(cmd, (str, bytes)) or not isinstance(cmd, (list, tuple)):
        raise TypeError(f"cmd must be a list of str (argv), got {type(cmd).__name__} {cmd!r}")
    if len(cmd) == 0 or not all(isinstance(a, str) for a in cmd):
        raise ValueError(f"cmd must be a non-empty list of str, got {cmd!r}")
    rate_bits = parse_rate(rate)
    delay_s = None if delay is None else parse_delay(delay)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    if netns_name is None:
        netns_name = f"moecomm-{os.getpid()}-{secrets.token_hex(3)}"
    elif not isinstance(netns_name, str) or not _NETNS_NAME.match(netns_name):
        raise ValueError(f"netns_name must be 1-64 chars of [A-Za-z0-9_.-], got {netns_name!r}")
    ip, tc = _require()

    _add_namespace(ip, netns_name)  # raises before we own anything
    proc: Optional[subprocess.Popen] = None
    try:
        _shape_loopback(ip, tc, netns_name, rate_bits, delay_s)
        # Own session/process group: a timeout or Ctrl-C here kills the command and all its children
        # (torch.distributed workers included) before the namespace goes.
        proc = subprocess.Popen([ip, "netns", "exec", netns_name, *cmd],
                                env=None if env is None else dict(env), start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise subprocess.TimeoutExpired(list(cmd), timeout) from exc
    except BaseException:  # KeyboardInterrupt and timeouts included: clean up, keep the first error
        if proc is not None:
            _kill_group(proc)
        try:
            _delete_namespace(ip, netns_name)
        except Exception as cleanup_exc:  # do not mask the original error; still say what is left
            print(f"moe_comm.tools.slow_link: {cleanup_exc}", file=sys.stderr)
        raise
    _delete_namespace(ip, netns_name)
    return returncode


def link_available() -> Tuple[bool, str]:
    """(True, "") when a shaped namespace can be made here, else (False, why). Besides root and the
    tools, it really creates, shapes and deletes a namespace, since a container can be root yet lack
    CAP_SYS_ADMIN or the htb qdisc."""
    try:
        ip, tc = _require()
    except RuntimeError as err:
        return False, str(err)
    name = f"moecomm-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        _add_namespace(ip, name)
    except RuntimeError as exc:
        return False, str(exc)
    try:
        _shape_loopback(ip, tc, name, 10**9, None)
    except RuntimeError as exc:
        return False, str(exc)
    finally:
        _delete_namespace(ip, name)
    return True, ""


def run_json_worker(script: str, argv: List[str], world_size: int, link: str,
                    timeout: Optional[float] = None):
    """A benchmark's worker run: ``python script *argv --worker W,PATH`` on an emulated ``link`` (a rate for
    ``run_on_slow_link``; "loopback": plain loopback, a subprocess), then the JSON it wrote to PATH.
    Raises RuntimeError naming the link and W when the worker fails or times out."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.abspath(script), *argv, "--worker", f"{world_size},{path}"]
    try:
        try:
            rc = subprocess.call(cmd, timeout=timeout) if link == "loopback" else \
                run_on_slow_link(cmd, rate=link, timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = f"a timeout after {timeout:g} s"
        if rc != 0:
            raise RuntimeError(f"worker for link={link} W={world_size} exited with {rc}")
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def json_worker_main(spec: str, fn, params) -> int:
    """The worker side of ``run_json_worker``: ``spec`` is the ``--worker`` value "W,PATH"; runs
    ``run_ranks(fn, W, params)`` and writes rank 0's result to PATH as JSON. Returns 0."""
    import json

    from moe_comm.tools.launch import run_ranks

    W, path = spec.split(",", 1)
    res = run_ranks(fn, int(W), params)
    with open(path, "w") as f:
        json.dump(res, f)
    return 0


# ---------------------------------------------------------------------------------- the emulated cluster
_CLUSTER_NET = "10.77.0."  # private /24 inside the cluster's own namespaces only
# Node k is 10.77.0.(101 + k): three-digit last octets, so torchrun's c10d rendezvous, which orders the nodes
# by the string of their --local-addr, gives node k the group rank k (node k holds ranks k*L .. k*L+L-1).
_FIRST_HOST = 101
MAX_NODES = 64
# Jumbo frames: TCP/IP/Ethernet headers are 66 bytes a segment, 0.7% of 8948-byte segments at MTU 9000
# (4.6% at 1500), so tc's byte counters stay within 1% of the payload a transport put on the wire.
_CLUSTER_MTU = 9000
_RDZV_PORT = 29400
# After the first node exits non-zero, the others get this long to exit by themselves (torchrun's agents
# notice the failed rendezvous / dead peer); then they are killed.
_FAIL_GRACE_S = 15.0


def node_address(node: int) -> str:
    """The IPv4 address of node ``node`` of an emulated cluster (inside its namespace)."""
    return f"{_CLUSTER_NET}{_FIRST_HOST + node}"


@dataclass
class LinkCounters:
    """tc's counters of node ``node``'s shaped inter-node link, read after the run.

    tx_*: what the node sent (htb class on its own interface ``node{k}``); rx_*: what it received (htb class
    on its switch port ``port{k}`` in the hub namespace). Bytes are as tc counts them: IP packets with their
    Ethernet header (GSO super-packets counted per segment), rendezvous and gloo control traffic included.
    rate_bits: the configured rate, as ``tc class show`` reports it back (bits/s).
    """
    node: int
    ifname: str
    tx_bytes: int
    tx_packets: int
    tx_dropped: int
    rx_bytes: int
    rx_packets: int
    rx_dropped: int
    rate_bits: int


@dataclass
class NodeResult:
    """One node's command: its exit code (-N: killed by signal N), whether it was killed because it outlived
    the timeout (``timed_out``) or a failed peer node (``killed``), and its output when captured."""
    node: int
    address: str
    ifname: str
    returncode: int
    timed_out: bool = False
    killed: bool = False
    stdout: Optional[str] = None
    stderr: Optional[str] = None


@dataclass
class ClusterResult:
    """What ``run_on_cluster`` returns: per-node results and the tc counters of each node's link."""
    nodes: List[NodeResult]
    links: List[LinkCounters]
    inter_rate_bits: int
    seconds: float
    namespaces: List[str] = field(default_factory=list)  # the names it used (all deleted)

    @property
    def returncode(self) -> int:
        """0 when every node's command exited 0; else the first non-zero exit code in node order."""
        return next((n.returncode for n in self.nodes if n.returncode != 0), 0)

    def as_dict(self) -> dict:
        return asdict(self)


_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)")
_CLASS_RATE = re.compile(r"class htb 1:10 .*?\brate (\S+)")


def read_link_counters(ifname: str, netns: Optional[str] = None) -> Tuple[int, int, int, int]:
    """(bytes, packets, dropped, rate bits/s) of the htb class 1:10 that shapes ``ifname``, from
    ``tc -s class show``. netns: read inside that namespace (None: this process's own, e.g. a rank's node).
    Raises RuntimeError when tc is missing or the device has no such class."""
    _, tc = _tools()
    if tc is None:
        raise RuntimeError("reading link counters needs the 'tc' command (iproute2 package)")
    argv = [tc, *(["-n", netns] if netns else []), "-s", "class", "show", "dev", ifname]
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    m_sent, m_rate = _SENT.search(proc.stdout), _CLASS_RATE.search(proc.stdout)
    if proc.returncode != 0 or m_sent is None or m_rate is None:
        raise RuntimeError(f"no shaped htb class 1:10 on {ifname!r}"
                           f"{f' in {netns!r}' if netns else ''}: {' '.join(argv)}\n{proc.stdout}{proc.stderr}")
    return int(m_sent.group(1)), int(m_sent.group(2)), int(m_sent.group(3)), parse_rate(m_rate.group(1).lower())


def _shape_device(tc: str, ns: str, dev: str, rate_bits: int, delay_s: Optional[float]) -> None:
    """htb root on ``dev`` in ``ns`` with one default class at ``rate_bits``; a netem delay under it."""
    _check([tc, "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
           f"adding the htb root qdisc on {dev} in {ns!r}")
    _check([tc, "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
            "rate", f"{rate_bits}bit", "quantum", str(_HTB_QUANTUM_BYTES)],
           f"adding the htb class (rate {rate_bits} bit/s) on {dev} in {ns!r}")
    if delay_s is not None:
        argv = [tc, "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "netem",
                "delay", f"{int(round(delay_s * 1e6))}us"]
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if proc.returncode != 0:
            hint = (" (this kernel has no netem qdisc: the sch_netem module is missing or cannot be loaded;"
                    " run without delay=)" if "unknown" in proc.stderr.lower() else "")
            raise RuntimeError(f"delay: adding a netem delay of {delay_s * 1e6:g} us on {dev} in {ns!r} failed"
                               f"{hint}: {' '.join(argv)}\n{proc.stderr.strip()}")


def _build_cluster(ip: str, tc: str, prefix: str, nodes: int, rate_bits: int, delay_s: Optional[float],
                   made: List[str]) -> List[str]:
    """Create the hub and node namespaces (appending each to ``made`` as soon as it exists, for cleanup),
    the bridge, the veth pairs, the addresses and the shaping. Returns the node namespaces' names."""
    hub = f"{prefix}-hub"
    _add_namespace(ip, hub)
    made.append(hub)
    _check([ip, "-n", hub, "link", "add", "br0", "type", "bridge"], f"adding the bridge in {hub!r}")
    _check([ip, "-n", hub, "link", "set", "br0", "mtu", str(_CLUSTER_MTU), "up"], f"bringing up br0 in {hub!r}")
    names = []
    for k in range(nodes):
        ns, port, dev = f"{prefix}-n{k}", f"port{k}", f"node{k}"
        _add_namespace(ip, ns)
        made.append(ns)
        names.append(ns)
        _check([ip, "-n", ns, "link", "set", "dev", "lo", "up"], f"bringing up lo in {ns!r}")
        _check([ip, "-n", hub, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns],
               f"adding the veth pair {port} (in {hub!r}) - {dev} (in {ns!r})")
        _check([ip, "-n", hub, "link", "set", port, "mtu", str(_CLUSTER_MTU), "master", "br0", "up"],
               f"attaching {port} to br0 in {hub!r}")
        _check([ip, "-n", ns, "link", "set", dev, "mtu", str(_CLUSTER_MTU)], f"setting the MTU of {dev} in {ns!r}")
        _check([ip, "-n", ns, "addr", "add", f"{node_address(k)}/24", "dev", dev],
               f"adding {node_address(k)} to {dev} in {ns!r}")
        _check([ip, "-n", ns, "link", "set", dev, "up"], f"bringing up {dev} in {ns!r}")
        _shape_device(tc, ns, dev, rate_bits, delay_s)   # what node k sends (one-way delay on this side only)
        _shape_device(tc, hub, port, rate_bits, None)    # what node k receives
    return names


def _delete_all(ip: str, names: Sequence[str]) -> List[str]:
    """Delete the namespaces (nodes first: their veths go with them, then the hub); returns the errors."""
    errors = []
    for name in sorted(names, key=lambda n: n.endswith("-hub")):
        try:
            _delete_namespace(ip, name)
        except Exception as exc:  # noqa: BLE001 - try every namespace, report all that remain
            errors.append(str(exc))
    return errors


def _torchrun_argv(cmd: List[str], k: int, nodes: int, ranks_per_node: int, run_id: str,
                   join_timeout: int) -> List[str]:
    is_host = 1 if k == 0 else 0  # the namespaces share one hostname: say which node hosts the c10d store
    # No --node-rank: c10d ignores it (and warns); it orders the nodes by --local-addr (see _FIRST_HOST).
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
            "--nproc-per-node", str(ranks_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{node_address(0)}:{_RDZV_PORT}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={is_host},join_timeout={join_timeout}", "--local-addr", node_address(k),
            "--max-restarts", "0", "--no-python", *cmd]


def _node_env(base: Mapping[str, str], k: int, nodes: int, ranks_per_node: int) -> Dict[str, str]:
    dev = f"node{k}"
    env = dict(base)
    # Import this checkout in every node, whatever the command's working directory.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(GLOO_SOCKET_IFNAME=dev, NCCL_SOCKET_IFNAME=dev, TP_SOCKET_IFNAME=dev,
               MOE_COMM_NODE_RANK=str(k), MOE_COMM_NUM_NODES=str(nodes), MOE_COMM_NODE_IFNAME=dev,
               MOE_COMM_NODE_ADDRS=",".join(node_address(j) for j in range(nodes)))
    # The nodes share this machine's cores: one thread per core and rank unless the caller said otherwise.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nodes * ranks_per_node))))
    return env


def _check_cluster_args(cmd_for_node, nodes, ranks_per_node, timeout) -> Callable[[int], List[str]]:
    for name, v, high in (("nodes", nodes, MAX_NODES), ("ranks_per_node", ranks_per_node, 1024)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= high:
            raise ValueError(f"{name} must be an int in [1, {high}], got {v!r}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    if callable(cmd_for_node):
        make = cmd_for_node
    elif isinstance(cmd_for_node, (list, tuple)) and not isinstance(cmd_for_node, (str, bytes)):
        fixed = list(cmd_for_node)
        make = lambda k: fixed  # noqa: E731 - the same command on every node
    else:
        raise TypeError(f"cmd_for_node must be a list of str (argv) or a callable node -> argv, got "
                        f"{type(cmd_for_node).__name__} {cmd_for_node!r}")
    cmds = {}

    def checked(k: int) -> List[str]:
        if k not in cmds:
            c = make(k)
            if isinstance(c, (str, bytes)) or not isinstance(c, (list, tuple)) or not c or \
                    not all(isinstance(a, str) for a in c):
                raise ValueError(f"cmd_for_node must give a non-empty list of str for node {k}, got {c!r}")
            cmds[k] = list(c)
        return cmds[k]
    return checked


def run_on_cluster(cmd_for_node: Union[List[str], Callable[[int], List[str]]], nodes: int = 2,
                   ranks_per_node: int = 2, inter: str = "1gbit", delay: Optional[str] = None, *,
                   torchrun: bool = True, env: Optional[Mapping[str, str]] = None, capture: bool = False,
                   timeout: Optional[float] = None, fail_grace: float = _FAIL_GRACE_S,
                   prefix: Optional[str] = None) -> ClusterResult:
    """Run a command on every node of an emulated cluster (module docstring) and delete the cluster again, in
    every case (error, timeout, KeyboardInterrupt).

    cmd_for_node: list[str], the argv every rank runs (the same on every node), or a callable node k -> argv.
        With ``torchrun`` (default) each node runs ``python -m torch.distributed.run --nnodes N
        --nproc-per-node L --rdzv-backend c10d --rdzv-endpoint <node 0>:29400 --local-addr <node k>
        --rdzv-conf is_host=<1 on node 0> --no-python *argv``: L ranks per node, ranks k*L .. k*L+L-1 on node
        k. With ``torchrun=False`` the argv runs once per node.
    nodes: N >= 1 namespaces (at most 64); ranks_per_node: L >= 1 (torchrun's --nproc-per-node).
    inter: tc rate of each node's link to the switch, each way (``parse_rate``), e.g. "1gbit".
    delay: one-way netem delay per packet (on each node's sending side), e.g. "100us", or None. Needs the
        kernel's sch_netem: without it a RuntimeError says so before any command starts.
    torchrun: see cmd_for_node. env: the commands' environment (None: ours), to which each node adds
        GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / TP_SOCKET_IFNAME = its interface, MOE_COMM_NODE_RANK,
        MOE_COMM_NUM_NODES, MOE_COMM_NODE_IFNAME, MOE_COMM_NODE_ADDRS (comma-separated, node order), this
        checkout first on PYTHONPATH, and OMP_NUM_THREADS = cores / (N x L) unless set.
    capture: keep each node's stdout / stderr (in ``NodeResult``) instead of passing them through.
    timeout: seconds for the whole run, or None. On expiry every node's process group gets SIGTERM, then
        SIGKILL 2 s later, the cluster is deleted and ``subprocess.TimeoutExpired`` is raised.
    fail_grace: seconds the other nodes get to exit by themselves once one node exited non-zero (default
        15: torchrun's agents notice a dead peer); then they are killed (``NodeResult.killed``).
    prefix: namespace name prefix (default ``mcc-<pid>-<6 hex>``): namespaces PREFIX-hub, PREFIX-n0.. .
    Returns: ``ClusterResult``: per node its exit code; per node its link's tc counters, read after every
        command ended.
    Raises: RuntimeError when not root / not Linux / ``ip`` or ``tc`` is missing / a setup step fails (netem
        missing for ``delay``); ValueError or TypeError for bad arguments; subprocess.TimeoutExpired.
    Example: ``run_on_cluster(["python", "-c", "import os; print(os.environ['RANK'])"], nodes=2,
        ranks_per_node=2).returncode == 0`` prints 0..3, one line per rank.
    """
    make_cmd = _check_cluster_args(cmd_for_node, nodes, ranks_per_node, timeout)
    if isinstance(fail_grace, bool) or not isinstance(fail_grace, (int, float)) or not fail_grace >= 0:
        raise ValueError(f"fail_grace must be a number of seconds >= 0, got {fail_grace!r}")
    rate_bits = parse_rate(inter)
    delay_s = None if delay is None else parse_delay(delay)
    if prefix is None:
        prefix = f"mcc-{os.getpid()}-{secrets.token_hex(3)}"
    elif not isinstance(prefix, str) or not _NETNS_NAME.match(prefix + "-hub"):
        raise ValueError(f"prefix must be 1-60 chars of [A-Za-z0-9_.-], got {prefix!r}")
    argvs = [make_cmd(k) for k in range(nodes)]  # every bad command is rejected before a namespace exists
    ip, tc = _require()

    made: List[str] = []
    procs: List[Optional[subprocess.Popen]] = [None] * nodes
    outdir = tempfile.mkdtemp(prefix="moe_comm_cluster_") if capture else None
    files = []
    t0 = time.perf_counter()
    try:
        names = _build_cluster(ip, tc, prefix, nodes, rate_bits, delay_s, made)
        run_id = f"moecomm{secrets.token_hex(4)}"
        join_timeout = int(min(600, timeout)) if timeout is not None else 600
        for k in range(nodes):
            argv = _torchrun_argv(argvs[k], k, nodes, ranks_per_node, run_id, join_timeout) if torchrun else argvs[k]
            out = err = None
            if outdir is not None:
                out = open(os.path.join(outdir, f"node{k}.out"), "w+")
                err = open(os.path.join(outdir, f"node{k}.err"), "w+")
                files.append((out, err))
            # Own session per node: a timeout or Ctrl-C kills a node's torchrun and all its ranks.
            procs[k] = subprocess.Popen([ip, "netns", "exec", names[k], *argv], stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=err, env=_node_env(os.environ if env is None else env,
                                                                              k, nodes, ranks_per_node),
                                        start_new_session=True)
        deadline = None if timeout is None else t0 + timeout
        failed_at, killed = None, set()
        while any(p.poll() is None for p in procs):
            now_s = time.perf_counter()
            if deadline is not None and now_s > deadline:
                _print_tails(files)  # what each node said before it stalled (captured output is deleted below)
                raise subprocess.TimeoutExpired(argvs[0], timeout)
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now_s
            if failed_at is not None and now_s - failed_at > fail_grace:
                for k, p in enumerate(procs):
                    if p.poll() is None:
                        killed.add(k)
                        _kill_group(p)
            time.sleep(0.05)
        links = []
        for k in range(nodes):  # every command has ended: the counters are final
            tx = read_link_counters(f"node{k}", names[k])
            rx = read_link_counters(f"port{k}", f"{prefix}-hub")
            links.append(LinkCounters(node=k, ifname=f"node{k}", tx_bytes=tx[0], tx_packets=tx[1], tx_dropped=tx[2],
                                      rx_bytes=rx[0], rx_packets=rx[1], rx_dropped=rx[2], rate_bits=tx[3]))
        results = []
        for k, p in enumerate(procs):
            o = e = None
            if files:
                o, e = (f.seek(0) or f.read() for f in files[k])
            results.append(NodeResult(node=k, address=node_address(k), ifname=f"node{k}", returncode=p.returncode,
                                      killed=k in killed, stdout=o, stderr=e))
    except BaseException:  # KeyboardInterrupt and timeouts included: clean up, keep the first error
        for p in procs:
            if p is not None:
                _kill_group(p)
        for msg in _delete_all(ip, made):  # do not mask the original error; still say what is left
            print(f"moe_comm.tools.slow_link: {msg}", file=sys.stderr)
        raise
    finally:
        for pair in files:
            for f in pair:
                f.close()
        if outdir is not None:
            shutil.rmtree(outdir, ignore_errors=True)
    errors = _delete_all(ip, made)
    if errors:
        raise RuntimeError("; ".join(errors))
    return ClusterResult(nodes=results, links=links, inter_rate_bits=rate_bits, seconds=time.perf_counter() - t0,
                         namespaces=list(made))


def _print_tails(files, chars: int = 3000) -> None:
    """The last ``chars`` of each node's captured stdout and stderr, to our stderr."""
    for k, pair in enumerate(files):
        for name, f in zip(("stdout", "stderr"), pair):
            f.flush()
            f.seek(0)
            text = f.read()[-chars:]
            if text:
                print(f"moe_comm.tools.slow_link: node {k} {name} (last {chars} chars):\n{text}", file=sys.stderr)


def cluster_available() -> Tuple[bool, str]:
    """(True, "") when an emulated cluster can be made here, else (False, why): root and the tools, then it
    really builds and deletes a two-node cluster (namespaces, bridge, veth pairs, htb), as a container can be
    root yet lack one of them."""
    try:
        ip, tc = _require("the emulated cluster")
    except RuntimeError as err:
        return False, str(err)
    made: List[str] = []
    try:
        _build_cluster(ip, tc, f"mcc-probe-{os.getpid()}-{secrets.token_hex(3)}", 2, 10**9, None, made)
    except RuntimeError as exc:
        return False, f"the emulated cluster cannot be built here: {exc}"
    finally:
        errors = _delete_all(ip, made)
    if errors:
        return False, "; ".join(errors)
    return True, ""


# ------------------------------------------------------------------------------------------ command line
def _raise_on_sigterm(signum, frame):
    # SIGTERM -> an exception, so the cleanup (kill the commands, delete the namespaces) runs.
    raise SystemExit(128 + signum)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m moe_comm.tools.slow_link --nodes N --ranks-per-node L --inter-link RATE [--delay D]
    [--timeout S] [--json PATH] -- CMD ARGS...``: every rank runs CMD under multi-node torchrun on an emulated
    cluster (``--no-torchrun``: CMD once per node). Prints each link's tc counters to stderr afterwards.
    Exit status: 0 when every node exited 0, else the first failing node's (128+N for signal N); 124 on
    --timeout; 130 on Ctrl-C; 2 when the cluster cannot be made here or on bad arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    own, cmd = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m moe_comm.tools.slow_link", description=main.__doc__,
                                usage="%(prog)s --nodes N [--ranks-per-node L] [--inter-link RATE] -- CMD [ARGS...]")
    p.add_argument("--nodes", type=int, required=True, help="namespaces (nodes) in the cluster")
    p.add_argument("--ranks-per-node", type=int, default=1, help="torchrun --nproc-per-node on each node")
    p.add_argument("--inter-link", default="1gbit", help="tc rate of each node's link, each way (e.g. 1gbit)")
    p.add_argument("--delay", default=None, help="one-way netem delay, e.g. 100us (needs the kernel's sch_netem)")
    p.add_argument("--timeout", type=float, default=None, help="kill every node after this many seconds")
    p.add_argument("--no-torchrun", action="store_true", help="run CMD once per node instead of under torchrun")
    p.add_argument("--json", default=None, help="write the per-node results and link counters to this file")
    args = p.parse_args(own)
    if not cmd:
        p.error("give the command to run after '--', e.g. -- python train.py")
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        res = run_on_cluster(cmd, nodes=args.nodes, ranks_per_node=args.ranks_per_node, inter=args.inter_link,
                             delay=args.delay, torchrun=not args.no_torchrun, timeout=args.timeout)
    except (RuntimeError, ValueError, TypeError) as exc:
        print(f"slow_link: {exc}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"slow_link: cluster run killed after --timeout {args.timeout:g} s", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        return 130
    for ln in res.links:
        print(f"slow_link: node {ln.node} ({node_address(ln.node)}, {ln.rate_bits / 1e9:g} Gbit/s each way): "
              f"sent {ln.tx_bytes} B in {ln.tx_packets} packets, received {ln.rx_bytes} B in {ln.rx_packets}",
              file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res.as_dict(), f, indent=1)
    rc = res.returncode
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main())
