"""Expert parallelism x data parallelism: DDP and FSDP2 around models that hold MoELayers.

Shapes legend: EP expert-parallel size, DP data-parallel size, N = EP x DP ranks, E experts, e = E / EP.

Layout. N ranks form a DP x EP grid, ``mesh = init_device_mesh(dev, (DP, EP), mesh_dim_names=("dp", "ep"))``
and ``MoELayer(cfg, ep_group=mesh)`` (or ``ep_group=..., dp_group=...`` process groups). Each row (an EP
group) holds all E experts, e per rank; each column (a DP group) holds the same e experts; every rank
feeds its own tokens.

- Replicated parameters (embeddings, attention, norms, routers, shared experts) are equal on all N ranks:
  DDP or FSDP2 over all N averages their gradients (sum over N ranks / N).
- Expert parameters are equal within a DP group and differ across an EP group, so a data-parallel
  wrapper over all N ranks must leave them alone: plain ``DistributedDataParallel(model)`` would
  broadcast rank 0's experts to every rank when it wraps the model and average different experts'
  gradients (``MoELayer`` raises at its first forward under such a wrapper). After backward, an expert's
  gradient on a rank already sums the contributions of every token of its EP group (the all-to-all
  backward brings them), so the gradient of the mean loss over the N ranks is

      expert grad = (sum over the DP group of the local expert gradients) / N  =  (mean over DP) / EP.

  A data-parallel reduction of the experts over their DP group alone (DDP or FSDP2 on the DP group)
  divides by DP only: the missing / EP is the "extra / EP" of hand-made FSDP2 recipes.

``wrap_ddp`` and ``fully_shard_moe`` set this up. The expert parameters are left out of the wrapper
(DDP: ignored parameters; FSDP2: ``ignored_params``, so they are NOT sharded: every rank holds its e
experts whole, replicated over its DP group, as with DDP). An ``ExpertGradReducer`` sums their gradients
over each layer's dp_group: one async all_reduce per expert weight, issued as soon as that layer's
backward is done (so it overlaps the backward of the layers below), waited and divided by N at the end
of the backward. Gradient accumulation: it reduces only on the backward that DDP / FSDP2 synchronise on
(not inside ``ddp.no_sync()`` / after ``model.set_requires_gradient_sync(False)``), as they do.
``check_expert_replicas`` (opt-in, e.g. every k steps) verifies that the DP replicas of every expert are
still bit-identical, naming the ranks that differ.

Why ``fully_shard_moe`` does not shard the experts over DP (measured on 4 gloo ranks, torch 2.13):
``fully_shard(layer.experts, mesh=mesh["dp"])`` does give the right gradients once they are divided by
EP (C = 1 and 2 chunks), but FSDP2 then reduce-scatters once per pipeline chunk (its hooks run inside the
pipeline's nested per-chunk backward), and its way to add the / EP, ``set_gradient_divide_factor``,
uses ``ReduceOp.PREMUL_SUM``, which gloo rejects ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Expert
memory is divided by EP only.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from moe_comm._checks import check_float
from moe_comm.comm.agree import agree
from moe_comm.comm.collectives import check_usable, group_rank, group_size, issuing, wait_work
from moe_comm.modules.experts import GroupedExperts
from moe_comm.modules.layer import MoELayer

__all__ = ["moe_layers", "moe_buffers", "expert_parameters", "wrap_ddp", "recover_ddp", "fully_shard_moe",
           "ExpertGradReducer", "check_expert_replicas", "clip_grad_norm_"]

_WEIGHTS = ("w1", "w3", "w2")
_CHECKSUM_BLOCK = 1 << 24  # elements per block of the replica checksum: bounds its int64 scratch (128 MiB)


def moe_layers(model: nn.Module) -> List[Tuple[str, MoELayer]]:
    """(name, layer) of every MoELayer in ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def moe_buffers(model: nn.Module) -> List[str]:
    """Names (as ``model.named_buffers()`` gives them) of the MoELayers' buffers: the router's expert_bias."""
    return [f"{name}.{b}" if name else b for name, layer in moe_layers(model) for b, _ in layer.named_buffers()]


def expert_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """(name, parameter) of every expert weight (``GroupedExperts`` w1/w3/w2) in ``model``; names as
    ``model.named_parameters()`` gives them."""
    ids = {id(getattr(m, w)) for m in model.modules() if isinstance(m, GroupedExperts) for w in _WEIGHTS}
    return [(name, p) for name, p in model.named_parameters() if id(p) in ids]


def _timeout(model: nn.Module) -> Optional[float]:
    """Seconds the helpers here wait for a collective: the largest ``timeout=`` of the model's MoELayers
    (None, the process group's own timeout, when none sets one)."""
    given = [layer.dispatcher.timeout for _, layer in moe_layers(model) if layer.dispatcher.timeout is not None]
    return max(given) if given else None


def _mesh_grid_error(name: str, layer: MoELayer, mesh) -> Optional[ValueError]:
    """For a 2-D mesh: an error when ``layer``'s EP group (or DP group) is not this rank's group of the mesh's
    EP dim (its "ep" dim, else dim 1, the dim FSDP2 shards over) or DP dim; None when they match. The text
    names the mesh's whole layout, so every rank whose layer was built alike words it alike."""
    names = tuple(mesh.mesh_dim_names or ())
    ep_dim = names.index("ep") if "ep" in names else 1
    dp_dim = 1 - ep_dim
    label = [repr(names[d]) if names else f"{d} (unnamed)" for d in (0, 1)]
    table = mesh.mesh.tolist()  # host sync: none, the mesh's CPU rank table
    ep_groups = table if ep_dim == 1 else [list(c) for c in zip(*table)]
    dp_groups = [list(c) for c in zip(*ep_groups)]
    me = dist.get_rank()
    mesh_ep = next(g for g in ep_groups if me in g)
    mesh_dp = next(g for g in dp_groups if me in g)
    layer_ep = dist.get_process_group_ranks(layer.ep_group) if layer.ep_group is not None else [me]
    layer_dp = dist.get_process_group_ranks(layer.dp_group) if layer.dp_group is not None else [me]
    if sorted(layer_ep) == sorted(mesh_ep) and sorted(layer_dp) == sorted(mesh_dp):
        return None
    return ValueError(
        f"fully_shard_moe: MoELayer {name!r} was built on EP group {sorted(layer_ep)} (EP {len(layer_ep)}, "
        f"DP {len(layer_dp)}), but the mesh's EP dim {label[ep_dim]} groups the ranks as {ep_groups} (EP "
        f"{len(mesh_ep)}, DP {len(mesh_dp)} over dim {label[dp_dim]}): the layer would run as EP {len(layer_ep)} "
        f"instead. Build the layer on the mesh: MoELayer(cfg, ep_group=mesh) with "
        f"init_device_mesh(dev, (DP, EP), mesh_dim_names=('dp', 'ep')) (or ep_group=mesh['ep'], "
        f"dp_group=mesh['dp']); or pass fully_shard_moe a 1-D mesh over all ranks")


def _check_grid(model: nn.Module, group: Optional[dist.ProcessGroup], what: str, mesh=None) -> int:
    """Collective over ``group`` (None: WORLD): every MoELayer must tile the wrapper's N ranks as EP x DP, and
    with a 2-D ``mesh`` its EP and DP groups must be the mesh's. Returns N; raises on every rank otherwise
    (``agree``)."""
    group = group if group is not None else dist.group.WORLD
    N = dist.get_world_size(group)
    members = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    local_error = None
    try:
        for name, layer in moe_layers(model):
            ep, dp = group_size(layer.ep_group), group_size(layer.dp_group)
            ranks = set(dist.get_process_group_ranks(layer.ep_group)) if layer.ep_group is not None else set()
            if layer.dp_group is not None:
                ranks |= set(dist.get_process_group_ranks(layer.dp_group))
            if ep * dp != N or not ranks <= members:
                raise ValueError(
                    f"{what}: MoELayer {name!r} has EP size {ep} x DP size {dp} = {ep * dp} ranks, the wrapper's "
                    f"group has {N} ({sorted(members)}); build the layers with the data-parallel group too: "
                    f"MoELayer(cfg, ep_group=mesh) with a ('dp', 'ep') DeviceMesh, or dp_group=...")
            if mesh is not None and mesh.ndim == 2:
                error = _mesh_grid_error(name, layer, mesh)
                if error is not None:
                    raise error
    except ValueError as err:
        local_error = err
    agree(group, {"MoE layers": len(moe_layers(model))}, what=what, local_error=local_error, timeout=_timeout(model))
    return N


# --------------------------------------------------------------------------------- gradient reduction
class _AfterLayerBackward(torch.autograd.Function):
    """Identity on a layer's input x. Every gradient of the layer flows into x, so this backward runs once
    the layer's whole backward (the experts' included) is done: it starts the layer's expert reduction.
    ``anchor`` (an empty leaf that requires grad) makes it run even when x needs no gradient."""

    @staticmethod
    def forward(ctx, x, anchor, reducer, layer):
        ctx.reducer, ctx.layer = reducer, layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.reducer._layer_done(ctx.layer)
        return grad, None, None, None


class ExpertGradReducer:
    """Sums the expert gradients of ``model``'s MoELayers over each layer's dp_group and divides them by
    ``world_size`` (N = EP x DP), at the end of every synchronised backward. ``wrap_ddp`` and
    ``fully_shard_moe`` install one; build one yourself for another data-parallel scheme.

    Args:
        model: holds the MoELayers (their forward pre-hooks are installed here).
        world_size: N, the ranks the mean loss is taken over (the wrapper's group size).
        sync_enabled: called at each layer's forward: False skips the reduction of that backward (gradient
            accumulation without communication). Default: always.
        sync_group: the wrapper's process group (all N ranks), or None. When given, every forward of ``model``
            checks that every rank of it has the same gradient-sync setting (``sync_enabled()``, and whether
            grad is enabled): one ``all_gather`` of one int per rank on a private gloo group over its ranks (host
            memory: no device sync), issued as the forward starts and waited, with the layers' ``timeout``, as it
            ends. A rank inside ``ddp.no_sync()`` while its peers synchronise would otherwise leave them waiting
            in the gradient reduction (DDP fails with an internal assert); instead every rank raises ValueError
            naming the ranks of each setting at the end of that forward, before any gradient moves. ``wrap_ddp``
            and ``fully_shard_moe`` pass it.
    Per layer and synchronised backward: one async all_reduce per expert weight over the dp_group (none
    when DP = 1), issued when the layer's backward is done, waited and divided by N in an autograd
    end-of-backward callback. gloo has no 16-bit reductions: bf16/fp16 gradients travel as fp32 copies
    there. ``remove()`` uninstalls it.
    """

    def __init__(self, model: nn.Module, world_size: int, sync_enabled: Optional[Callable[[], bool]] = None,
                 *, sync_group: Optional[dist.ProcessGroup] = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ExpertGradReducer: world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.sync_enabled = sync_enabled or (lambda: True)
        self.layers = [layer for _, layer in moe_layers(model)]
        self.timeout = _timeout(model)
        self._pending: List[Tuple[MoELayer, list]] = []
        self._queued_for: Optional[int] = None  # autograd graph task whose end runs _finish
        self._handles = [layer.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
                         for layer in self.layers]
        self._sync_ranks: List[int] = []
        self._sync_check: Optional[dist.ProcessGroup] = None  # private gloo group over sync_group's ranks
        if sync_group is not None and dist.get_world_size(sync_group) > 1:
            self._sync_ranks = dist.get_process_group_ranks(sync_group)
            # Collective over sync_group's ranks only (use_local_synchronization): the wrapper's group may be
            # a subgroup. gloo whatever the wrapper's backend: the check reads one int per rank on the host.
            self._sync_check = dist.new_group(self._sync_ranks, backend="gloo", use_local_synchronization=True)
            self._handles.append(model.register_forward_pre_hook(self._issue_sync_check))
            self._handles.append(model.register_forward_hook(self._read_sync_check))
        self._sync_work = None  # (work, every rank's mode) of the check issued by this forward, read at its end

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    _SYNC_PHASE = "gradient-sync setting check of the data-parallel wrapper"

    def _issue_sync_check(self, model: nn.Module, args: tuple) -> None:
        """Forward pre-hook of the wrapped model: issue this forward's check (every rank has the same
        gradient-sync setting, see ``sync_group``), not waited here. A blocking check would deadlock against
        the layers' exchanges: a rank that raised mid-step and went on would wait in it while its peers wait
        in the previous step's exchange for that rank. Issued at every forward's start, the checks of all
        ranks pair in order whatever the layers' exchanges do; the layers' exchanges name such a rank."""
        group, me = self._sync_check, dist.get_rank(self._sync_check)
        check_usable(group, me)
        if self._sync_work is not None:  # the last forward raised before its end: every rank issued that check
            work, _ = self._sync_work
            self._sync_work = None
            wait_work(work, self._SYNC_PHASE, timeout=self.timeout, rank=me, what="all_gather", group=group)
        mode = 0 if not torch.is_grad_enabled() else (1 if self.sync_enabled() else 2)
        mine = torch.tensor([mode], dtype=torch.int64, device="cpu")
        every = [torch.empty_like(mine) for _ in self._sync_ranks]
        with issuing(group, self._SYNC_PHASE, me):
            self._sync_work = (dist.all_gather(every, mine, group=group, async_op=True), every)

    def _read_sync_check(self, model: nn.Module, args: tuple, output) -> None:
        """Forward hook of the wrapped model: every rank of the wrapper ran this forward with the same
        gradient-sync setting, or every rank raises ValueError naming who differs, before its backward (where
        the gradients would be reduced on some ranks only)."""
        if self._sync_work is None:
            return
        (work, every), self._sync_work = self._sync_work, None
        group, me = self._sync_check, dist.get_rank(self._sync_check)
        wait_work(work, self._SYNC_PHASE, timeout=self.timeout, rank=me, what="all_gather", group=group)
        modes = torch.cat(every).tolist()  # host sync: none, host tensors of the private gloo group
        if len(set(modes)) == 1:
            return
        text = {0: "no gradient (torch.no_grad() / inference)", 1: "gradient synchronised",
                2: "gradient NOT synchronised (inside ddp.no_sync() / after set_requires_gradient_sync(False))"}
        by_mode = "; ".join(f"{text[m]} on ranks {[self._sync_ranks[i] for i, x in enumerate(modes) if x == m]}"
                            for m in sorted(set(modes)))
        raise ValueError(f"moe_comm.parallel: the data-parallel wrapper's ranks ran this forward with different "
                         f"gradient-sync settings: {by_mode}. Every rank must accumulate (ddp.no_sync() / "
                         f"model.set_requires_gradient_sync(False)) or synchronise together, and run its forwards "
                         f"with grad enabled or disabled together; every rank raised here, at the end of the "
                         f"forward, before any gradient moved: the next forward with equal settings works")

    def _pre_forward(self, layer: MoELayer, args: tuple, kwargs: dict):
        if torch._C._current_graph_task_id() == -1 and self._pending:
            self._pending = []  # left by a backward that raised before its end (the group is rebuilt then)
        if not torch.is_grad_enabled() or not self.sync_enabled():
            return None
        if args:
            x = args[0]
        elif "x" in kwargs:
            x = kwargs["x"]
        else:
            raise TypeError("ExpertGradReducer: MoELayer was called without its input x")
        if not isinstance(x, torch.Tensor):
            return None  # the layer rejects it, on every rank
        anchor = torch.empty(0, device=x.device, requires_grad=True)
        marked = _AfterLayerBackward.apply(x, anchor, self, layer)
        if args:
            return (marked,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "x": marked}

    def _layer_done(self, layer: MoELayer) -> None:
        params = [getattr(layer.experts, w) for w in _WEIGHTS]
        for p in params:
            if p.grad is None:  # every rank reduces the same tensors
                p.grad = torch.zeros_like(p)
        group = layer.dp_group if group_size(layer.dp_group) > 1 else None
        if group is not None:
            check_usable(group, group_rank(group))  # an earlier failure: raise now, issue nothing
        reductions = []
        for p in params:
            buf, work = p.grad, None
            if group is not None:
                low = buf.dtype in (torch.bfloat16, torch.float16) and "gloo" in str(dist.get_backend(group))
                buf = buf.float() if low else buf
                with issuing(group, "expert gradient all_reduce over the data-parallel group", group_rank(group)):
                    work = dist.all_reduce(buf, group=group, async_op=True)
            reductions.append((p, buf, work))
        self._pending.append((layer, reductions))
        task = torch._C._current_graph_task_id()
        if self._queued_for != task:
            self._queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        pending, self._pending, self._queued_for = self._pending, [], None
        for layer, reductions in pending:
            group = layer.dp_group
            for p, buf, work in reductions:
                wait_work(work, "expert gradient all_reduce over the data-parallel group",
                          timeout=layer.dispatcher.timeout, rank=group_rank(group), what="all_reduce", group=group)
                if buf is p.grad:
                    p.grad.div_(self.world_size)
                else:
                    p.grad.copy_(buf.div_(self.world_size))


# -------------------------------------------------------------------------------------------- wrappers
def wrap_ddp(model: nn.Module, *, process_group: Optional[dist.ProcessGroup] = None, **ddp_kwargs):
    """``DistributedDataParallel`` for a model holding MoELayers (collective over ``process_group``).

    Args:
        model: the model; every MoELayer in it must tile the DDP group as EP x DP (built with
            ``ep_group=mesh`` for a ('dp', 'ep') mesh, or ``dp_group=``): checked, every rank raises otherwise.
        process_group: the group over all N = EP x DP ranks (None: WORLD).
        **ddp_kwargs: passed to DistributedDataParallel (``device_ids``, ``bucket_cap_mb``, ...).
    Returns the DDP module. The expert parameters are ignored by DDP (not broadcast, not bucketed); an
    ``ExpertGradReducer`` (``ddp._moe_expert_reducer``) reduces their gradients over each layer's dp_group,
    divided by N, at the end of every backward DDP synchronises (not under ``ddp.no_sync()``; every rank must
    use ``no_sync()`` together: each forward checks it, see ``ExpertGradReducer``'s ``sync_group``). Replicated
    parameters are DDP's: broadcast from rank 0 now, gradients averaged over N. Training code is that of
    plain DDP: ``loss.backward(); optimizer.step()``.
    """
    from torch.nn.parallel import DistributedDataParallel

    _check_grid(model, process_group, "wrap_ddp")
    # The experts are reduced by the ExpertGradReducer. The layers' buffers (the router's expert_bias) are equal on
    # every rank by construction (each rank applies the bias step from the load summed over the group): DDP's
    # broadcast of them at every forward would be a collective outside moe_comm's protocol, which a rank that
    # raised mid-step and went on would enter while its peers wait for it in a layer's exchange (a hang).
    ignored = [name for name, _ in expert_parameters(model)] + moe_buffers(model)
    known = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(known | set(ignored)))
    ddp = DistributedDataParallel(model, process_group=process_group, **ddp_kwargs)
    ddp._moe_expert_reducer = ExpertGradReducer(model, dist.get_world_size(ddp.process_group),
                                                lambda: ddp.require_backward_grad_sync, sync_group=ddp.process_group)
    return ddp


def recover_ddp(ddp) -> None:
    """Make a ``wrap_ddp`` module usable again after a training step that raised on every rank in its backward
    (moe_comm's failure protocol: a layer's backward failed on one rank, ``PeerFailed`` / ``ProtocolError`` on the
    others). Call it on every rank before the next forward. DDP's reducer was left mid-step and would refuse the
    next forward ("Expected to have finished reduction in the prior iteration"): this resets it (torch's
    ``Reducer._reset_state``, as DDP's own ``_update_process_group`` does) and drops the expert-gradient reducer's
    unfinished reductions. The failed step's partial gradients stay in ``.grad``: zero them
    (``optimizer.zero_grad()``) before the next backward. Not for DDP's own errors (unused parameters): the step
    they refuse did not fail."""
    experts = getattr(ddp, "_moe_expert_reducer", None)
    if experts is None or not hasattr(ddp, "reducer"):
        raise TypeError(f"recover_ddp: ddp must be the module wrap_ddp returned, got {type(ddp).__name__}")
    dp = [name for name, layer in moe_layers(ddp) if group_size(layer.dp_group) > 1]
    if dp:  # the failing EP group never issued its expert reductions over DP: its peers' are left open there
        raise ValueError(f"recover_ddp: supported with DP = 1 only; {dp} reduce their experts over a data-parallel "
                         "group, whose reductions the failed step left unpaired: rebuild the process group")
    experts._pending, experts._queued_for = [], None
    ddp.reducer._reset_state()


def _fsdp_syncs(model: nn.Module) -> bool:
    """Whether FSDP2 reduces gradients on this backward (False after ``set_requires_gradient_sync(False)``);
    reads torch 2.13's param-group flag (tests/parallel pins it)."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in m._get_fsdp_state()._fsdp_param_groups:
                return bool(g.reduce_grads)
    return True


def fully_shard_moe(model: nn.Module, mesh, *, blocks: Sequence[nn.Module] = (), **fsdp_kwargs) -> nn.Module:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) for a model holding MoELayers (collective).

    Args:
        model: the model; every MoELayer in it must tile the mesh's N ranks as EP x DP (checked).
        mesh: a DeviceMesh over all N = EP x DP ranks: 1-D (parameters sharded over N), or the 2-D
            ('dp', 'ep') mesh the layers were built with (HSDP: replicated over 'dp', sharded over 'ep'):
            every layer's EP and DP groups must then be the mesh's (checked: a layer built on WORLD next
            to a 2-D mesh raises on every rank).
        blocks: submodules to make their own FSDP units first (transformer blocks), then the root.
        **fsdp_kwargs: passed to every ``fully_shard`` call (reshard_after_forward, mp_policy, ...).
    Returns ``model`` (now an FSDPModule). The expert parameters are every unit's ``ignored_params``: not
    sharded (replicated over each DP group), their gradients reduced by an ``ExpertGradReducer``
    (``model._moe_expert_reducer``) over each layer's dp_group and divided by N, on the backwards FSDP2
    synchronises (every rank alike: each forward checks it, see ``ExpertGradReducer``'s ``sync_group``). The
    other parameters become DTensors as usual; gradients averaged over N.
    """
    from torch.distributed.fsdp import fully_shard

    N = int(mesh.size())
    if N != dist.get_world_size():
        raise ValueError(f"fully_shard_moe: mesh must span every EP x DP rank, the whole world of "
                         f"{dist.get_world_size()} ranks, got a mesh of {N}")
    _check_grid(model, None, "fully_shard_moe", mesh)
    experts = {p for _, p in expert_parameters(model)}
    for block in blocks:
        fully_shard(block, mesh=mesh, ignored_params={p for p in block.parameters() if p in experts}, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, ignored_params=experts, **fsdp_kwargs)
    model._moe_expert_reducer = ExpertGradReducer(model, N, lambda: _fsdp_syncs(model), sync_group=dist.group.WORLD)
    return model


# -------------------------------------------------------------------------------------- replica check
def _checksum(t: torch.Tensor) -> torch.Tensor:
    """[2] int64: the sum of the tensor's words, and their sum weighted by position (mod 65521, + 1), in
    wrapping int64 arithmetic (order-independent: bit-identical tensors, identical sums). Blocks of
    2**24 elements bound the scratch memory."""
    flat = t.detach().contiguous().reshape(-1)
    words = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHECKSUM_BLOCK):
        w = words[start:start + _CHECKSUM_BLOCK].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=t.device, dtype=torch.int64) % 65521 + 1
        out[0] += w.sum()
        out[1] += (w * pos).sum()
    return out


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Collective over the layers' EP groups: ``torch.nn.utils.clip_grad_norm_`` (2-norm) for a model holding
    MoELayers, after its backward (``wrap_ddp`` / ``fully_shard_moe``: the gradients are reduced by then).

    torch's own clip computes the norm of the gradients this rank holds: the replicated parameters' (equal on
    every rank) plus this rank's experts', which differ per EP rank, so every rank scales its replicated
    gradients by another factor and the replicas drift apart, silently. Here the norm is the whole model's:
    the replicated gradients counted once, every expert's once (this rank's experts summed over its layers'
    EP group by one all_reduce; its DP replicas hold the same gradient). Every rank gets the same norm and
    scales by the same factor. Returns the total norm before clipping (a 0-dim float64 tensor, equal on
    every rank). A physical replica of an expert (``apply_placement``) counts as an expert of its own.
    """
    if max_norm != float("inf"):  # inf: measure the norm, scale by 1
        check_float("clip_grad_norm_: max_norm", max_norm, 0.0)
    experts = {id(p) for _, p in expert_parameters(model)}
    layers = [layer for _, layer in moe_layers(model)]
    params = [p for p in model.parameters() if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    if len({id(layer.ep_group) for layer in layers}) > 1:
        raise ValueError("clip_grad_norm_: the model's MoELayers use different EP groups; one EP group is supported")
    sq = {k: torch.zeros((), dtype=torch.float64, device=device) for k in ("replicated", "experts")}
    for p in params:
        g = p.grad.detach()
        n2 = torch.linalg.vector_norm(g, dtype=torch.float64).square()
        if hasattr(n2, "full_tensor"):  # a DTensor gradient (FSDP2): its norm over the shards
            n2 = n2.full_tensor()
        key = "experts" if id(p) in experts else "replicated"
        sq[key] = sq[key] + n2.to(device)
    if layers:  # every rank of the EP group joins, also one without expert gradients
        group = layers[0].ep_group
        if group_size(group) > 1:
            me, phase = group_rank(group), "expert gradient norm over the EP group (clip_grad_norm_)"
            check_usable(group, me)
            with issuing(group, phase, me):
                work = dist.all_reduce(sq["experts"], group=group, async_op=True)
            wait_work(work, phase, timeout=_timeout(model), rank=me, what="all_reduce", group=group)
    total = torch.sqrt(sq["replicated"] + sq["experts"])
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    factor = None
    for p in params:
        if hasattr(p.grad, "full_tensor"):  # a DTensor gradient takes a number
            factor = float(scale) if factor is None else factor  # host sync: FSDP2 gradients only
            p.grad.detach().mul_(factor)
        else:
            p.grad.detach().mul_(scale.to(p.grad.dtype))
    return total


def check_expert_replicas(model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> int:
    """Collective: check that the data-parallel replicas of every expert are bit-identical.

    Every rank of ``group`` (None: WORLD; it must hold every rank of every layer's EP x DP grid) calls it.
    Per MoELayer, each rank computes a checksum of its expert weights (two int64 sums per weight: one pass
    over the weights, no copy) and of its expert ids; the checksums travel in one ``all_gather`` per
    distinct dp_group, then one ``agree`` over ``group`` spreads the verdict. Raises ValueError on every
    rank when two DP replicas differ, naming the layer, the weight and the (global) ranks holding each
    version; returns the number of layers checked. Opt-in: call it when you want (e.g. every 100 steps,
    after ``optimizer.step()``); layers without data parallelism are skipped. Waits at most the layers'
    ``timeout=`` for its peers (CollectiveError naming them); a group an earlier failure poisoned raises
    CollectiveError at once ("rebuild the process group").
    """
    group = group if group is not None else dist.group.WORLD
    timeout = _timeout(model)
    layers = [(name, layer) for name, layer in moe_layers(model) if group_size(layer.dp_group) > 1]
    by_group: Dict[int, List[Tuple[str, MoELayer]]] = {}
    for name, layer in layers:
        by_group.setdefault(id(layer.dp_group), []).append((name, layer))
    # A group poisoned by an earlier failure (a timed-out collective may still be pending on it): raise at
    # once, before issuing anything; the ranks that go on wait at most ``timeout`` for this one.
    check_usable(group, dist.get_rank(group))
    for members in by_group.values():
        check_usable(members[0][1].dp_group, group_rank(members[0][1].dp_group))
    problems: List[str] = []
    for members in by_group.values():
        dp = members[0][1].dp_group
        rows = []
        for _, layer in members:
            ids = torch.tensor(layer.local_expert_ids, dtype=torch.int64, device=layer.experts.w1.device)
            parts = [_checksum(ids)] + [_checksum(getattr(layer.experts, w)) for w in _WEIGHTS]
            rows.append(torch.cat(parts))
        local = torch.stack(rows)  # [layers, 8]
        every = [torch.empty_like(local) for _ in range(group_size(dp))]
        phase = "check_expert_replicas checksum exchange over the data-parallel group"
        with issuing(dp, phase, group_rank(dp)):
            work = dist.all_gather(every, local, group=dp, async_op=True)
        wait_work(work, phase, timeout=timeout, rank=group_rank(dp), what="all_gather", group=dp)
        ranks = dist.get_process_group_ranks(dp)
        table = torch.stack(every).cpu()  # host sync: the check reads the checksums
        for li, (name, layer) in enumerate(members):
            for k, what in enumerate(("expert ids",) + tuple(f"experts.{w}" for w in _WEIGHTS)):
                versions: Dict[tuple, List[int]] = {}
                for r in range(len(ranks)):
                    key = tuple(table[r, li, 2 * k:2 * k + 2].tolist())  # host sync: opt-in replica check
                    versions.setdefault(key, []).append(ranks[r])
                if len(versions) > 1:
                    problems.append(f"layer {name!r} (experts {layer.local_expert_ids}): {what} differs between "
                                    + " and ".join(f"ranks {rs}" for rs in versions.values()))
    error = ValueError("check_expert_replicas: data-parallel replicas of the experts differ: " + "; ".join(problems)
                       + " (were the expert gradients reduced over dp_group? moe_comm.parallel.wrap_ddp / "
                       "fully_shard_moe do it)") if problems else None
    agree(group, {}, what="check_expert_replicas", local_error=error, timeout=timeout)
    return len(layers)
