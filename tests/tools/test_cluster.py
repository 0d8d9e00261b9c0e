"""The emulated cluster (moe_comm.tools.slow_link.run_on_cluster) and the multi-node benchmark on it.

Tier 1 (pure logic, always run): bad arguments are rejected, naming the argument, before any namespace exists.
Tier 2 (needs root, iproute2's ip and tc, and a kernel that allows network namespaces, veth, bridges and
htb: skipped with the reason from ``cluster_available()`` otherwise): namespaces are made and always deleted
(success, a failing node, a timeout), the links are shaped at the configured rate, real multi-node torchrun
runs a gloo all_to_all on 2 x 1 and 2 x 2 ranks, and ``benchmarks/multinode.py --quick`` runs (multirank).
Every namespace test checks that nothing with its prefix is left. Whole file: ~60 s here (2 shared cores),
most of it the benchmark's imports and torchrun start-ups.
"""
import json
import os
import secrets
import subprocess
import sys

import pytest

from moe_comm.tools.slow_link import cluster_available, namespace_exists, node_address, run_on_cluster

_AVAILABLE, _WHY_NOT = cluster_available()
needs_cluster = pytest.mark.skipif(not _AVAILABLE, reason=_WHY_NOT or "the emulated cluster is unavailable")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A gloo all_to_all_single whose payload names its source rank; each rank checks what it got and prints one line.
_A2A = r"""
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
r, W = dist.get_rank(), dist.get_world_size()
out = torch.empty(W, 3)
dist.all_to_all_single(out, torch.full((W, 3), float(r)))
assert out[:, 0].tolist() == [float(i) for i in range(W)], out
# one write(2) per line: print's text and newline are two writes under PYTHONUNBUFFERED, and ranks interleave
node, group = os.environ["MOE_COMM_NODE_RANK"], os.environ["GROUP_RANK"]
os.write(1, f"rank {r} of {W} on node {node} group {group} ok\n".encode())
dist.destroy_process_group()
"""

# Node 1 sends N bytes to node 0 over TCP; node 0 times the receipt and writes JSON to argv[2].
_TRANSFER = r"""
import json, os, socket, sys, time
n, out = int(sys.argv[1]), sys.argv[2]
addrs = os.environ["MOE_COMM_NODE_ADDRS"].split(",")
if os.environ["MOE_COMM_NODE_RANK"] == "0":
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addrs[0], 29999)); srv.listen(1)
    conn, _ = srv.accept(); got = 0; t0 = None
    while got < n:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        t0 = t0 or time.perf_counter(); got += len(chunk)
    json.dump({"bytes": got, "seconds": time.perf_counter() - t0}, open(out, "w"))
else:
    for _ in range(200):
        try:
            s = socket.create_connection((addrs[0], 29999)); break
        except OSError:
            time.sleep(0.05)
    s.sendall(bytes(n)); s.close()
"""


def _prefix() -> str:
    return f"mcc-test-{os.getpid()}-{secrets.token_hex(2)}"


def _gone(prefix: str, nodes: int) -> bool:
    return not any(namespace_exists(f"{prefix}-{s}") for s in ["hub", *(f"n{k}" for k in range(nodes))])


# ---- tier 1 ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(nodes=0), "nodes"), (dict(nodes=2.0), "nodes"), (dict(ranks_per_node=0), "ranks_per_node"),
    (dict(inter="fast"), "rate"), (dict(delay="1"), "delay"), (dict(timeout=0), "timeout"),
    (dict(fail_grace=-1), "fail_grace"), (dict(prefix="bad name"), "prefix")])
def test_bad_arguments_raise_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_on_cluster([sys.executable, "-c", "pass"], **kwargs)


def test_bad_command_raises_naming_it():
    with pytest.raises(TypeError, match="cmd_for_node"):
        run_on_cluster("python -c pass")
    with pytest.raises(ValueError, match="cmd_for_node"):
        run_on_cluster(lambda k: [] if k == 1 else ["true"])


def test_node_addresses_sort_as_strings_in_node_order():
    # torchrun's c10d rendezvous orders the nodes by the string of --local-addr: node k must be group k
    addrs = [node_address(k) for k in range(64)]
    assert sorted(addrs) == addrs


# ---- tier 2 ---------------------------------------------------------------------------------------------

@needs_cluster
def test_nodes_have_own_namespace_interface_and_address_and_are_deleted():
    prefix = _prefix()
    script = ("import os, socket, subprocess\n"
              "ns = subprocess.run(['ip', 'netns', 'identify', str(os.getpid())], capture_output=True,"
              " text=True).stdout.strip()\n"
              "addr = subprocess.run(['ip', '-4', '-o', 'addr', 'show', os.environ['GLOO_SOCKET_IFNAME']],"
              " capture_output=True, text=True).stdout.split()[3]\n"
              "print(ns, sorted(n for _, n in socket.if_nameindex()), addr)\n")
    res = run_on_cluster([sys.executable, "-c", script], nodes=3, inter="100mbit", torchrun=False, capture=True,
                         prefix=prefix, timeout=60)
    assert res.returncode == 0, [n.stderr for n in res.nodes]
    for k, n in enumerate(res.nodes):
        ns, ifaces, addr = n.stdout.split(" ", 1)[0], n.stdout.split(" ", 1)[1].rsplit(" ", 1)[0], n.stdout.split()[-1]
        assert ns == f"{prefix}-n{k}"
        assert ifaces == str(["lo", f"node{k}"])
        assert addr == f"{node_address(k)}/24"
    assert sorted(res.namespaces) == sorted([f"{prefix}-hub", *(f"{prefix}-n{k}" for k in range(3))])
    assert _gone(prefix, 3)


@needs_cluster
def test_links_are_shaped_at_the_rate_and_counted(tmp_path):
    nbytes, rate = 2_500_000, 100 * 10**6  # 2.5 MB at 100 Mbit/s: 0.2 s
    out = tmp_path / "recv.json"
    res = run_on_cluster([sys.executable, "-c", _TRANSFER, str(nbytes), str(out)], nodes=2, inter="100mbit",
                         torchrun=False, capture=True, timeout=60)
    assert res.returncode == 0, [n.stderr for n in res.nodes]
    got = json.loads(out.read_text())
    assert got["bytes"] == nbytes
    assert [ln.rate_bits for ln in res.links] == [rate, rate]  # what tc reports back for each link
    assert got["bytes"] * 8 / got["seconds"] <= 1.3 * rate, got  # loosely: the link is not faster than its rate
    # node 1 sent it, node 0 received it; headers add ~1% at MTU 9000 (the ACKs go the other way)
    assert nbytes <= res.links[1].tx_bytes <= 1.05 * nbytes
    assert nbytes <= res.links[0].rx_bytes <= 1.05 * nbytes
    assert res.links[0].tx_bytes < 0.05 * nbytes


@needs_cluster
def test_failing_node_returns_its_code_others_are_killed_and_all_is_deleted():
    prefix = _prefix()
    res = run_on_cluster(lambda k: [sys.executable, "-c", "import sys, time; time.sleep(60) if sys.argv[1] == '0'"
                                    " else sys.exit(3)", str(k)],
                         nodes=2, torchrun=False, fail_grace=0.5, prefix=prefix, timeout=60)
    assert res.returncode == -15  # node 0 (first in node order) was killed by SIGTERM
    assert [n.killed for n in res.nodes] == [True, False]
    assert res.nodes[1].returncode == 3
    assert _gone(prefix, 2)


@needs_cluster
@pytest.mark.parametrize("capture", [False, True])
def test_timeout_kills_every_node_and_deletes_the_cluster(tmp_path, capsys, capture):
    prefix = _prefix()
    pid_file = tmp_path / "pid"
    script = ("import os, sys, time; open(sys.argv[1] + os.environ['MOE_COMM_NODE_RANK'], 'w')"
              ".write(str(os.getpid())); print('node', os.environ['MOE_COMM_NODE_RANK'], 'waits', flush=True); "
              "time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        run_on_cluster([sys.executable, "-c", script, str(pid_file)], nodes=2, torchrun=False, prefix=prefix,
                       timeout=2.0, capture=capture)
    assert _gone(prefix, 2)
    for k in range(2):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"pid{k}").read_text()), 0)
    if capture:  # what each node said before the timeout is printed (its captured output is deleted after)
        err = capsys.readouterr().err
        assert all(f"node {k} stdout" in err and f"node {k} waits" in err for k in range(2)), err


@needs_cluster
def test_delay_needs_netem_and_says_so():
    prefix = _prefix()
    try:
        res = run_on_cluster([sys.executable, "-c", "pass"], nodes=2, delay="100us", torchrun=False, prefix=prefix,
                             timeout=30)
    except RuntimeError as err:  # this kernel has no sch_netem (the case on the machine these tests were written on)
        assert "netem" in str(err) and "delay" in str(err)
    else:
        assert res.returncode == 0
    assert _gone(prefix, 2)


@pytest.mark.multirank
@needs_cluster
@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_multinode_torchrun_all_to_all(ranks_per_node):
    prefix = _prefix()
    res = run_on_cluster([sys.executable, "-c", _A2A], nodes=2, ranks_per_node=ranks_per_node, capture=True,
                         prefix=prefix, timeout=120)
    assert res.returncode == 0, [n.stderr[-2000:] for n in res.nodes]
    W = 2 * ranks_per_node
    lines = sorted(ln for n in res.nodes for ln in n.stdout.splitlines() if ln.startswith("rank"))
    # node k holds ranks k*L .. k*L+L-1 and is torchrun's group k
    assert lines == [f"rank {r} of {W} on node {r // ranks_per_node} group {r // ranks_per_node} ok" for r in range(W)]
    assert all(ln.tx_bytes > 0 and ln.rx_bytes > 0 for ln in res.links)  # the rendezvous and the exchange crossed
    assert _gone(prefix, 2)


@pytest.mark.multirank
@needs_cluster
def test_multinode_benchmark_quick(tmp_path):
    out = tmp_path / "multinode.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "multinode.py"), "--quick",
                           "--modes", "flat,flat_dedup,hier", "--json", str(out), "--timeout", "240"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    modes = res["result"]["modes"]
    assert res["result"]["nodes"] == 2 and res["result"]["ranks_per_node"] == 2
    assert {"flat", "flat_dedup", "hier"} <= set(modes), res["result"].get("skipped")
    hier = modes["hier"]
    assert "exact_error" not in hier and hier["exact_max_rel_err"] is not None, hier
    # one row per (token, destination node) crossed: exactly the routing's distinct remote nodes
    assert hier["inter_rows_per_token_measured"] == pytest.approx(hier["inter_rows_per_token_expected"], rel=1e-9)
    for name, m in modes.items():
        assert m["step_s"] > 0
        if m["exact_max_rel_err"] is not None:
            assert m["exact_max_rel_err"] <= 1e-5, name
        assert m["tc_sent_bytes_one_call"] > 0, name  # each node read its link's counters around the call
    # flat sends one row per remote slot; one copy per rank never more
    assert modes["flat_dedup"]["inter_rows_per_token_expected"] <= modes["flat"]["inter_rows_per_token_expected"]


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_cli_cluster_flags_are_checked_before_any_namespace(command, capsys):
    from moe_comm.tools.cli import main

    assert main([command, "--nodes", "3", "--world-size", "4"]) == 2
    assert "--nodes 3 must divide --world-size 4" in capsys.readouterr().err
    assert main([command, "--nodes", "2", "--link", "1gbit"]) == 2
    assert "--link and --nodes" in capsys.readouterr().err
