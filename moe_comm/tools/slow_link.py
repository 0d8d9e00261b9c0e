"""Slow-link emulation on one machine: run a command inside a fresh network namespace whose loopback is
rate-limited with ``tc`` (htb), optionally with a netem delay.

On plain loopback gloo moves data at memcpy speed, so comm looks free and CPU "overlap" is mostly
contention. Inside the namespace every TCP byte between ranks crosses a shaped ``lo``, so the all-to-all
costs what it would on a real link of that rate. Only the namespace's own loopback is touched; the
namespace is created for the run and always deleted afterwards.

    from moe_comm.tools.slow_link import run_on_slow_link
    rc = run_on_slow_link(["python", "train.py"], rate="1gbit", timeout=600)

Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN), Linux, and iproute2's ``ip`` and ``tc``.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["run_on_slow_link", "run_json_worker", "json_worker_main", "parse_rate",
           "parse_delay", "link_available", "namespace_exists"]

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


def _require() -> Tuple[str, str]:
    missing = _missing_requirements()
    if missing:
        raise RuntimeError("slow-link emulation needs " + "; ".join(missing))
    ip, tc = _tools()
    assert ip is not None and tc is not None
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
    missing = _missing_requirements()
    if missing:
        return False, "slow-link emulation needs " + "; ".join(missing)
    ip, tc = _tools()
    assert ip is not None and tc is not None
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
