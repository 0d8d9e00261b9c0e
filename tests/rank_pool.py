"""A pool of gloo ranks in spawned processes, reused across tests (tier 2: multi-rank on CPU).

``pool.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and returns the list of
results by rank. A rank that raises fails the call with its traceback; a call that does not finish
within ``timeout`` fails and the pool is torn down (the next call starts a fresh one), so no test hangs.

``pool.nccl_rules`` (set per test by tests/conftest.py): the ranks run the call under
``moe_comm.testing.nccl_rules``. When a rank's rules side group broke (a side check timed out), the pool
closes after that call, so the next test gets a fresh one.
Ranks hold CPU tensors on any machine, so Triton kernels run there under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import sys
import tempfile
import traceback

import torch.multiprocessing as mp

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _worker(rank: int, world_size: int, init_file: str, inq, outq) -> None:
    # Before anything imports triton (torch does not): kernels are decorated in interpreter mode at import.
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, _TESTS_DIR)
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.distributed as dist

    from moe_comm.testing import nccl_rules

    torch.set_num_threads(1)  # 2 cores shared by up to 4 ranks
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    while True:
        msg = inq.get()
        if msg is None:
            break
        fn, args, rules = msg
        if rules != nccl_rules.installed():
            (nccl_rules.install if rules else nccl_rules.uninstall)()
        try:
            # Pickle here, not in the queue's feeder thread, where a failure would be silent.
            ok, value = True, bytes(ForkingPickler.dumps(fn(rank, world_size, *args)))
        except BaseException:  # report every failure, keep serving
            ok, value = False, traceback.format_exc()
        # A broken rules side group may pair stale messages: the pool closes after reading this call's
        # results (tensors in them are fetched from this process, which must stay up until then).
        outq.put((rank, ok, value, nccl_rules.broken() is not None))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="moe_comm_pool_")
        init_file = os.path.join(self._dir, "store")
        self._inqs = [ctx.Queue() for _ in range(world_size)]
        self._outq = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, self._inqs[r], self._outq),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._open = True
        self.nccl_rules = False

    @property
    def alive(self) -> bool:
        return self._open and all(p.is_alive() for p in self._procs)

    def run(self, fn, *args, timeout: float = 120.0):
        if not self.alive:
            raise RuntimeError("rank pool was torn down")
        for q in self._inqs:
            q.put((fn, args, self.nccl_rules))
        results, errors, broken = [None] * self.world_size, {}, False
        for _ in range(self.world_size):
            try:
                # After a failure, give the others a short grace period: they may be stuck in a collective.
                rank, ok, value, rules_broken = self._outq.get(timeout=15.0 if errors else timeout)
            except queue.Empty:
                self.close(kill=True)
                missing = "timeout" if not errors else "stuck after another rank failed"
                msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors.items())
                raise AssertionError(f"{fn.__name__} on {self.world_size} ranks: {missing} "
                                     f"(limit {timeout:.0f}s); pool torn down\n{msg}") from None
            broken |= rules_broken
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors[rank] = value
        if broken:
            self.close(kill=True)  # a rank's rules side group broke: the next call gets a fresh pool
        if errors:
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"{fn.__name__} failed on rank(s) {sorted(errors)}:\n{msg}")
        return results

    def close(self, kill: bool = False) -> None:
        if not self._open:
            return
        self._open = False
        for q, p in zip(self._inqs, self._procs):
            if kill:
                p.kill()
            else:
                q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
