"""Slow-link emulation (moe_comm.tools.slow_link): a command run in a fresh network namespace with a tc-shaped lo.

Tier 2: needs root and iproute2 (``ip``, ``tc``) and a kernel that allows network namespaces and htb;
these tests are skipped with the reason from ``link_available()`` otherwise. The rate/delay parsing tests
are tier 1 (pure logic) and always run. Each namespace test checks the namespace is gone afterwards.
Whole file: ~3 s here.
"""
import json
import os
import secrets
import subprocess
import sys
import time

import pytest

from moe_comm.tools.slow_link import link_available, namespace_exists, parse_delay, parse_rate, run_on_slow_link

_AVAILABLE, _WHY_NOT = link_available()
needs_link = pytest.mark.skipif(not _AVAILABLE, reason=_WHY_NOT or "slow-link emulation unavailable")

# Sends N bytes to itself over one TCP connection on 127.0.0.1 and writes the receive-side throughput as
# JSON to argv[2]. Timed at the receiver: sendall() returns once bytes are in the kernel's socket buffer.
_THROUGHPUT_PROBE = r"""
import json, socket, sys, threading, time
n, out_path = int(sys.argv[1]), sys.argv[2]
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
done = {}
def receive():
    conn, _ = srv.accept(); got = 0
    while got < n:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    done["t1"], done["got"] = time.perf_counter(), got
    conn.close()
receiver = threading.Thread(target=receive); receiver.start()
sender = socket.create_connection(("127.0.0.1", srv.getsockname()[1]))
t0 = time.perf_counter(); sender.sendall(bytes(n)); receiver.join(); sender.close()
seconds = done["t1"] - t0
with open(out_path, "w") as f:
    json.dump({"bytes": done["got"], "seconds": seconds, "bits_per_s": done["got"] * 8 / seconds}, f)
"""


def _fresh_name() -> str:
    return f"moecomm-test-{os.getpid()}-{secrets.token_hex(3)}"


# ---- tier 1: parsing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, bits", [("1gbit", 10**9), ("100mbit", 10**8), ("2.5gbit", 25 * 10**8),
                                        ("500kbit", 5 * 10**5), ("1GBIT", 10**9), ("10mbps", 8 * 10**7),
                                        ("1mibit", 2**20), ("8bit", 8)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["", "fast", "10", "1gbits", "-1gbit", "0bit", "1 g bit", "gbit", "1.2.3mbit"])
def test_bad_rate_raises_value_error_naming_rate(bad):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(bad)
    with pytest.raises(ValueError, match="rate"):  # rejected before any namespace is made, root or not
        run_on_slow_link([sys.executable, "-c", "pass"], rate=bad)


def test_rate_of_wrong_type_raises_type_error():
    with pytest.raises(TypeError, match="rate"):
        parse_rate(10**9)


def test_parse_delay():
    assert parse_delay("1ms") == pytest.approx(1e-3)
    assert parse_delay("250us") == pytest.approx(250e-6)
    for bad in ["1", "1 minute", "-1ms", "fast"]:
        with pytest.raises(ValueError, match="delay"):
            parse_delay(bad)


def test_bad_cmd_is_rejected():
    with pytest.raises(TypeError, match="cmd"):
        run_on_slow_link("python -c pass")
    with pytest.raises(ValueError, match="cmd"):
        run_on_slow_link([])


# ---- tier 2: real namespaces ----------------------------------------------------------------------------

@needs_link
def test_command_runs_in_own_namespace_with_only_lo_and_namespace_is_deleted(tmp_path):
    name = _fresh_name()
    out = tmp_path / "inside.json"
    script = ("import json, os, socket, subprocess, sys\n"
              "here = subprocess.run(['ip', 'netns', 'identify', str(os.getpid())],"
              " capture_output=True, text=True).stdout.strip()\n"
              "json.dump({'ifaces': [n for _, n in socket.if_nameindex()], 'netns': here},"
              " open(sys.argv[1], 'w'))\n")
    rc = run_on_slow_link([sys.executable, "-c", script, str(out)], rate="100mbit", netns_name=name)
    assert rc == 0
    inside = json.loads(out.read_text())
    assert inside["ifaces"] == ["lo"], inside
    assert inside["netns"] == name
    assert not namespace_exists(name)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed


@needs_link
def test_shaped_rate_is_close_to_configured(tmp_path):
    nbytes, rate_bits = 4 * 10**6, 100 * 10**6  # 4 MB at 100 Mbit/s: 0.32 s
    unshaped, shaped = tmp_path / "unshaped.json", tmp_path / "shaped.json"
    subprocess.run([sys.executable, "-c", _THROUGHPUT_PROBE, str(nbytes), str(unshaped)], check=True)
    rc = run_on_slow_link([sys.executable, "-c", _THROUGHPUT_PROBE, str(nbytes), str(shaped)],
                          rate="100mbit")
    assert rc == 0
    base, got = json.loads(unshaped.read_text()), json.loads(shaped.read_text())
    assert got["bytes"] == nbytes
    # Measured here: 100.3 Mbit/s shaped (0.32 s), ~6 Gbit/s unshaped.
    assert got["seconds"] >= 0.25, got
    assert 0.5 * rate_bits <= got["bits_per_s"] <= 1.3 * rate_bits, got
    assert base["bits_per_s"] > 2 * rate_bits, f"plain loopback too slow to show shaping: {base}"


@needs_link
def test_exit_code_propagates():
    name = _fresh_name()
    assert run_on_slow_link([sys.executable, "-c", "import sys; sys.exit(7)"], netns_name=name) == 7
    assert not namespace_exists(name)
    assert run_on_slow_link([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]) == -9


@needs_link
def test_timeout_kills_command_and_deletes_namespace(tmp_path):
    name = _fresh_name()
    pid_file = tmp_path / "pid"
    script = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    t0 = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired):
        run_on_slow_link([sys.executable, "-c", script, str(pid_file)], netns_name=name, timeout=1.0)
    assert time.perf_counter() - t0 < 10
    assert not namespace_exists(name)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


@needs_link
def test_existing_namespace_name_is_refused_and_left_alone():
    name = _fresh_name()
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        with pytest.raises(RuntimeError, match=name):
            run_on_slow_link([sys.executable, "-c", "pass"], netns_name=name)
        assert namespace_exists(name)
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)
