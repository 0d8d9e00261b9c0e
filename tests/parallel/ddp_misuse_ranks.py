"""One rank of the data-parallel misuse check, run in a pair of fresh processes (tests/parallel/test_ddp_misuse.py).

A new user's first try, repeated: build ``Linear -> MoELayer -> Linear`` (EP = the 2 ranks, each holding other
experts), wrap it with a plain data-parallel wrapper, and run forward + backward. Every repeat must raise the
named RuntimeError on every rank, and the group must then still pair collectives correctly: a barrier, then an
all_reduce whose sum is checked (a collective left unmatched by one rank would pair with it and show up there,
or hang). Each repeat builds a fresh model and wrapper, and one rank, picked from the repeat number, arrives
late (0-30 ms) at the wrap or at the forward, so both arrival orders are tried. After the repeats the process
group is destroyed. Results go to ``<out>/rank<r>.json``; ``<out>/rank<r>.progress`` names the last step each
rank reached (what the test prints when a rank hangs).

Kinds: ``ddp`` (DistributedDataParallel on the default group), ``ddp_subgroup`` (DDP on a ``new_group`` over
both ranks), ``fsdp2`` (``fully_shard`` on a 1-D mesh over both ranks).

Launched two ways:
    torchrun --standalone --nproc-per-node 2 tests/parallel/ddp_misuse_ranks.py --kind ddp --repeats 20 --out DIR
    multiprocessing (spawn): ``run_rank(rank, 2, "file:///tmp/x", kind, repeats, out)`` in each process

Shapes legend: T tokens, H hidden.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import time

KINDS = ("ddp", "ddp_subgroup", "fsdp2")
WRAPPER_NAME = {"ddp": "DistributedDataParallel", "ddp_subgroup": "DistributedDataParallel",
                "fsdp2": "fully_shard (FSDP2)"}
H, T = 32, 5
MAX_DELAY_S = 0.03  # the late rank's head start for its peer


def _progress(out: str, rank: int, text: str) -> None:
    with open(os.path.join(out, f"rank{rank}.progress"), "a") as f:
        f.write(text + "\n")


def _make_wrapper(kind: str, world_size: int):
    """kind -> a function model -> wrapped model (groups and meshes built once, before the repeats)."""
    import torch
    import torch.distributed as dist

    if kind == "ddp":
        return lambda model: torch.nn.parallel.DistributedDataParallel(model)
    if kind == "ddp_subgroup":
        sub = dist.new_group(list(range(world_size)))
        return lambda model: torch.nn.parallel.DistributedDataParallel(model, process_group=sub)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world_size,))
        return lambda model: fully_shard(model, mesh=mesh)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def run_rank(rank: int, world_size: int, init_method: str, kind: str, repeats: int, out: str) -> None:
    """Run ``repeats`` misuses of ``kind`` on this rank and write ``<out>/rank<rank>.json``."""
    import torch
    import torch.distributed as dist

    import moe_comm

    torch.set_num_threads(1)  # 2 cores shared by the 2 ranks
    # A gloo timeout well inside the test's own: a collective left unmatched fails the repeat, not the session.
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    wrap = _make_wrapper(kind, world_size)
    results = []
    for i in range(repeats):
        pick = random.Random(1000 + i)  # the same draw on every rank
        late, where, delay = pick.randrange(world_size), pick.choice(("wrap", "forward")), pick.random() * MAX_DELAY_S
        _progress(out, rank, f"repeat {i}: build")
        cfg = moe_comm.MoEConfig(hidden_size=H, ffn_hidden_size=48, num_experts=2 * world_size, top_k=2)
        model = torch.nn.Sequential(torch.nn.Linear(H, H), moe_comm.MoELayer(cfg, seed=i), torch.nn.Linear(H, H))
        if rank == late and where == "wrap":
            time.sleep(delay)
        _progress(out, rank, f"repeat {i}: wrap")
        wrapped = wrap(model)
        if rank == late and where == "forward":
            time.sleep(delay)
        _progress(out, rank, f"repeat {i}: forward")
        x_TH = torch.randn(T, H, generator=torch.Generator().manual_seed(31 * i + rank))
        try:
            wrapped(x_TH).sum().backward()
            error = None
        except Exception as err:  # what the user sees on this rank
            error = f"{type(err).__name__}: {err}"
        _progress(out, rank, f"repeat {i}: barrier")
        dist.barrier()
        check_T = torch.tensor([rank + 1.0, float(i)])
        dist.all_reduce(check_T)  # pairs with the peer's all_reduce of this repeat only if nothing is left over
        paired = check_T.tolist() == [world_size * (world_size + 1) / 2, float(world_size * i)]
        results.append({"error": error, "paired": paired, "late": late, "where": where})
        del wrapped, model
    # Free every holder of a process group (DDP's reducer, the mesh, the sub-group) while the groups are alive,
    # so that destroy_process_group drops their last references. A gloo group freed later by Python (a wrapper
    # outliving destroy_process_group) is destroyed holding the GIL: it joins gloo's worker threads, and an
    # idle worker still holding the barrier's work (which keeps the previous collective's tensors) waits for
    # the GIL to free them - a deadlock at exit (about 1 run in 6 of a 2-rank DDP script here; none in 12 with
    # this cleanup). During interpreter shutdown the same free can abort the process instead ("terminate called
    # without an active exception": seen once in ~30 FSDP2 pairs whose mesh outlived destroy_process_group).
    del wrap
    gc.collect()
    _progress(out, rank, "destroy")
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "kind": kind, "results": results}, f)
    _progress(out, rank, "done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args.kind, args.repeats, args.out)


if __name__ == "__main__":
    main()
