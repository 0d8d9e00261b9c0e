"""Tier 2: multi-rank on CPU. ``benchmarks/peers.py`` end to end, without any peer library installed: two
adapters written here (a moe_comm layer with the reference's weights, and one with a perturbed router)
stand in for peers, so the cross-check, the timing and the verdicts all run; plus the adapters' contract
and the no-peer exit.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCH, "peers.py")

ADAPTER = '''
import dataclasses

import torch
import moe_comm

NAME = "{name}"
INSTALL = "nothing"


def missing():
    return None


def build(ref, group):
    if ref.cfg.top_k != 2:
        raise ValueError("this adapter computes top-2 routing only")
    layer = moe_comm.MoELayer(dataclasses.replace(ref.cfg, dedup=True), group)  # another path: one copy per rank
    with torch.no_grad():
        layer.router.weight.copy_(ref.router.weight)
        layer.router.weight[0] += {shift}  # expert 0's logit only (a shift of every row cancels in softmax)
        for k in ("w1", "w3", "w2"):
            getattr(layer.experts, k).copy_(getattr(ref.experts, k))
    return layer
'''


def _run(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.multirank
def test_peers_bench_cross_checks_times_and_flags_a_peer_computing_another_function(tmp_path):
    pkg = tmp_path / "my_peers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "same.py").write_text(textwrap.dedent(ADAPTER.format(name="same", shift=0.0)))
    (pkg / "other.py").write_text(textwrap.dedent(ADAPTER.format(name="other", shift=0.5)))
    path = tmp_path / "peers.json"
    proc = _run(["--world-sizes", "2", "--shapes", "64x32x48x4x2,32x32x48x4x1", "--warmup", "1", "--repeats", "3",
                 "--peers", "my_peers.same,my_peers.other", "--json", str(path)], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"exit code {proc.returncode}:\n{out[-4000:]}"
    assert "other computed another function than moe_comm" in proc.stderr, out[-4000:]
    assert "MISMATCH" in proc.stdout
    res = json.loads(path.read_text())
    (run,) = res["results"]
    shape, top1 = run["shapes"]
    closing = "moe_comm, end exchanges"
    floor = "plain + moe_comm's protocol"
    assert set(top1["layers"]) == {"moe_comm", closing, "plain torch", floor}
    assert top1["layers"]["moe_comm"]["step_s"] > 0
    assert top1["skipped"] == {n: "ValueError: this adapter computes top-2 routing only" for n in ("same", "other")}
    assert shape["skipped"] == {}
    assert shape["shape"] == {"T": 64, "H": 32, "F": 48, "E": 4, "K": 2} and shape["world_size"] == 2
    assert shape["bare_gemm_s"] > 0 and shape["raw_a2a_s"] > 0 and shape["control_s"] > 0
    layers = shape["layers"]
    assert set(layers) == {"moe_comm", closing, "plain torch", floor, "same", "other"}
    # moe_comm's own variant closing each phase with an exchange: the same function, no verdict
    assert layers[closing]["check"]["y_rel_diff"] == 0 and "pass" not in layers[closing]
    for e in layers.values():
        assert e["step_s"] > 0
    same, other = layers["same"], layers["other"]
    assert same["check"]["agrees"] and same["check"]["y_rel_diff"] < 1e-6 and same["check"]["dx_rel_diff"] < 1e-6
    assert not other["check"]["agrees"] and other["check"]["y_rel_diff"] > 1e-3
    assert other["pass"] is False  # no verdict on a mismatch, whatever the times
    assert same["pass"] == (same["ours_over_theirs"] <= res["goal_ours_over_theirs"])
    # the floor: the raw all-to-all time over each peer's overhead, as the table prints it
    assert same["floor_ratio"] == pytest.approx(shape["raw_a2a_s"] / same["overhead_s"])
    assert "4 x raw all-to-all" in proc.stdout and "(floor " in proc.stdout
    # the plain PyTorch layer: the same function (its check passes), no verdict of its own, its overhead /
    # each peer's printed beside the floor
    plain = layers["plain torch"]
    assert plain["check"]["agrees"] and plain["check"]["y_rel_diff"] < 1e-5 and "pass" not in plain
    assert same["plain_ratio"] == pytest.approx(plain["overhead_s"] / same["overhead_s"])
    assert ", plain " in proc.stdout
    # the failure protocol's price: the plain layer plus moe_comm's extra control exchanges
    assert same["protocol_ratio"] == pytest.approx((plain["overhead_s"] + shape["control_s"]) / same["overhead_s"])
    # a small call carries its phases' status in their last transfer: the backward's check-in is the one extra
    assert shape["control_exchanges"] == 1 and "1 x control exchange" in proc.stdout and ", +checks " in proc.stdout
    # the protocol floor: the plain layer with moe_comm's exchanges and status rows on the wire, measured; the same
    # function, no verdict, one collective more than the plain layer (the check-in), as many as moe_comm
    assert layers[floor]["check"]["agrees"] and "pass" not in layers[floor]
    assert same["protocol_layer_ratio"] == pytest.approx(layers[floor]["overhead_s"] / same["overhead_s"])
    assert ", +protocol " in proc.stdout
    work = {n: layers[n]["work"] for n in ("moe_comm", "plain torch", floor)}
    assert work[floor]["collectives_per_step"] == work["moe_comm"]["collectives_per_step"] \
        == work["plain torch"]["collectives_per_step"] + 1, work
    # the main thread's CPU time per step, for moe_comm, the plain layer and the floor, in the JSON and the table
    host = {n: w["host_cpu_s_per_step"] for n, w in work.items()}
    assert all(0 < v < shape["layers"][n]["step_s"] * 20 for n, v in host.items()), host
    assert (f"moe_comm {host['moe_comm'] * 1e3:.2f} ms, plain {host['plain torch'] * 1e3:.2f}, +protocol "
            f"{host[floor] * 1e3:.2f}") in proc.stdout


ABSENT = '''
NAME = "{name}"
INSTALL = "pip install {name}-not-here"


def missing():
    return "ModuleNotFoundError: No module named '{name}'"


def build(ref, group):
    raise AssertionError("never built: missing() said why")
'''


def test_peers_bench_without_any_peer_names_each_install_line_and_fails(tmp_path):
    """Hermetic: two adapters that are missing here (whatever frameworks this machine has installed)."""
    pkg = tmp_path / "absent_peers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("alpha", "beta"):
        (pkg / f"{name}.py").write_text(textwrap.dedent(ABSENT.format(name=name)))
    proc = _run(["--world-sizes", "2", "--peers", "absent_peers.alpha,absent_peers.beta"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no peer is installed" in proc.stderr
    for name in ("alpha", "beta"):
        assert f"skipping {name}:" in proc.stdout and f"pip install {name}-not-here" in proc.stdout


@pytest.mark.parametrize("adapter", ["torchtitan_moe", "deepspeed_moe", "megatron_moe"])
def test_peer_adapters_follow_the_contract(adapter):
    m = importlib.import_module(f"peer_adapters.{adapter}")
    assert isinstance(m.NAME, str) and m.NAME and "pip install " in m.INSTALL
    why = m.missing()
    assert why is None or (isinstance(why, str) and why)
    assert callable(m.build)


@pytest.mark.parametrize("args, message", [
    (["--peers", "nosuchpeer"], "--peers: unknown ['nosuchpeer']"),
    (["--shapes", "64x32"], "--shapes: '64x32' is not TxHxFxExK"),
    (["--shapes", "64x32x48x6x2", "--world-sizes", "2,4"], "E = 6 experts do not split over world size 4"),
    (["--world-sizes", "1"], "--world-sizes: '1' is not a comma list of integers >= 2"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_arguments_are_named(capsys, args, message):
    peers = importlib.import_module("peers")
    with pytest.raises(SystemExit) as exit_:
        peers.main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err


@pytest.fixture(autouse=True)
def _benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
