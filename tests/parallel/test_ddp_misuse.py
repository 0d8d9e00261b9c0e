"""A plain data-parallel wrapper over ranks that hold different experts: every rank raises the named error, and
the group stays usable (issue #32: one rank raised, its peer hung in DDP's first forward).

Tier 2 (multi-rank gloo), in fresh processes rather than the rank pool: a hang must not take the pool with it,
and the launcher must be part of the test (torchrun tears a group down when one rank exits with an error, which
would hide a peer left waiting). Per launcher (multiprocessing spawn, torchrun) and per misuse (DDP, DDP on a
sub-group, FSDP2 fully_shard), one pair of processes runs 20 repeats, each with a fresh model and one rank
arriving late; see tests/parallel/ddp_misuse_ranks.py. Every rank of every repeat must raise the RuntimeError
naming ``moe_comm.parallel.wrap_ddp`` (the same text on every rank), then pass a barrier and a checked
all_reduce; the group is destroyed at the end and both ranks exit 0. Runtime: 6 pairs, 35-55 s measured on 2 shared
CPU cores (almost all of it starting the processes and importing torch; the 20 repeats take ~1 s).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from ddp_misuse_ranks import KINDS, WRAPPER_NAME, run_rank

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD_SIZE, REPEATS = 2, 20
DEADLINE_S = 150  # one pair: 4-12 s measured (starting and importing; the 20 repeats take ~1 s)


def _progress(out) -> str:
    lines = []
    for r in range(WORLD_SIZE):
        path = out / f"rank{r}.progress"
        last = path.read_text().splitlines()[-1] if path.exists() else "(not started)"
        lines.append(f"rank {r} last reached: {last}")
    return "; ".join(lines)


def _check_results(out, kind: str) -> None:
    by_rank = []
    for r in range(WORLD_SIZE):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no results: {_progress(out)}"
        results = json.loads(path.read_text())["results"]
        assert len(results) == REPEATS, (r, len(results))
        by_rank.append(results)
        for i, res in enumerate(results):
            where = f"rank {r}, repeat {i} (rank {res['late']} late at the {res['where']})"
            error = res["error"]
            assert error is not None, f"{where}: the forward did not raise"
            assert error.startswith("RuntimeError: MoELayer: " + WRAPPER_NAME[kind]), f"{where}: {error}"
            assert "moe_comm.parallel.wrap_ddp" in error and "ranks [0, 1]" in error, f"{where}: {error}"
            assert res["paired"], f"{where}: the all_reduce after the error paired with another collective"
    for i in range(REPEATS):  # the same error, word for word, on every rank
        texts = {res[i]["error"] for res in by_rank}
        assert len(texts) == 1, f"repeat {i}: the ranks raised different errors: {sorted(texts)}"


@pytest.mark.multirank
@pytest.mark.parametrize("kind", KINDS)
def test_misuse_raises_on_every_rank_under_spawn(tmp_path, kind):
    ctx = multiprocessing.get_context("spawn")
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=run_rank, args=(r, WORLD_SIZE, init, kind, REPEATS, str(tmp_path)))
             for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} still running after {DEADLINE_S} s: {_progress(tmp_path)}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0] * WORLD_SIZE, f"exit codes {codes}: {_progress(tmp_path)}"
    _check_results(tmp_path, kind)


@pytest.mark.multirank
@pytest.mark.parametrize("kind", KINDS)
def test_misuse_raises_on_every_rank_under_torchrun(tmp_path, kind):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
           os.path.join(HERE, "ddp_misuse_ranks.py"), "--kind", kind, "--repeats", str(REPEATS),
           "--out", str(tmp_path)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:  # subprocess.run killed torchrun; its workers die with it (pdeathsig)
        pytest.fail(f"torchrun still running after {DEADLINE_S} s: {_progress(tmp_path)}")
    # Exit 0: no rank failed, so the launcher tore nothing down; both ranks wrote every repeat.
    assert r.returncode == 0, f"torchrun exit {r.returncode}: {_progress(tmp_path)}\n{r.stderr[-3000:]}"
    _check_results(tmp_path, kind)
