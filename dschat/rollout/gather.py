"""The shared parameter-gather scheduler: ZeRO-3 gathers as a planned, accounted step.

Under ZeRO-3 each rank holds 1/N of every weight. Generating through ZeRO's module hooks
fetches and frees every layer on every decode step; here gathering is explicit instead:

- `GatherPlan` (from the model-family registry) cuts a model into ordered groups:
  [embeddings + extra_pre (+ the tied head)], block 0..L-1, [final norm + extra_post],
  [untied head], plus an "other" group for any parameter the registry does not place.
  A parameter shared between modules (a tied head) belongs to exactly one group; LoRA
  parameters of a peft-wrapped model travel with the block that holds them.
- `GatherScheduler`: one per process (`get_scheduler()`), shared by the actor,
  reference, critic and reward. It records bytes and seconds of every gather and the
  peak of the gathered bytes alive at once (`stats`, `pop_stats()`).
- `full` mode: `build_replica` makes a plain HF module once (no ZeRO hooks, eval,
  requires_grad False); `fill_replica` gathers group by group and copies (with dtype
  cast, LoRA merged) into the replica's existing tensors in place, releasing each group
  before gathering the next. Replica tensors keep their addresses across refills.
- `layered` mode: `LayeredReplica` is a skeleton replica whose non-block weights are
  resident and whose blocks share one reusable slot of `group_size` blocks; forward
  pre-hooks fill the slot chunk by chunk while the next chunk's gather is in flight.
- `gathered(module)`: a one-off full gather of a live ZeRO-3 module for a forward pass.

Scoring path (reference / critic / reward): by default these stay with ZeRO's own hooks,
one per transformer block (`dschat.engine.zero.use_block_granularity`). Their one forward
per experience batch fetches every layer once, the same bytes as a full gather, with
ZeRO's prefetch overlapping it and no extra copy in memory; the
actor's log-prob pass reuses the actor's replica instead (`HybridActor.log_probs`).
`gathered(module)` is there for a frozen model small enough to hold whole: one coalesced
gather, then forwards without per-module fetches.

Invariant after every function here returns: no ZeRO-3 parameter that this module
gathered is left AVAILABLE or INFLIGHT, so ZeRO's own hooks keep working for training.
All ZeRO-3 gathers are collectives: every rank of the parameters' group must make the
same calls in the same order.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

from dschat.engine.zero import full_nbytes, full_numel, is_zero3_param
from dschat.registry import family_of, head_is_tied, resolve, unwrap_peft
from dschat.utils.attention import attention_of, use_attention
from dschat.utils.logging import get_logger, is_rank_0

logger = get_logger(__name__)

# Marker put into `param.ds_active_sub_modules` by `gathered()`: ZeRO's post-forward
# release skips parameters that an active submodule still uses, so they stay gathered.
_HOLD_ID = -0x0D5C


# --------------------------------------------------------------------------- plan

@dataclass
class GatherGroup:
    """One unit of gathering: the parameters under `roots` (module paths of the HF LM)."""
    name: str                               # "embed", "block.3", "post", "head", "other"
    kind: str                               # "pre" | "block" | "post" | "head" | "other"
    roots: tuple[str, ...]                  # module paths from the unwrapped HF model
    params: list[tuple[str, nn.Parameter]]  # (name from the HF model, parameter), unique
    recurse: bool = True                    # False: only the roots' own parameters
    block_index: Optional[int] = None

    @property
    def numel(self) -> int:
        return sum(full_numel(p) for _, p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(full_nbytes(p) for _, p in self.params)

    def tensors(self) -> list[nn.Parameter]:
        return [p for _, p in self.params]


@dataclass
class GatherPlan:
    """Ordered gather groups of one model, built from the registry (`GatherPlan.build`)."""
    model: nn.Module                 # the HF causal LM (peft wrapper removed)
    groups: list[GatherGroup]
    tied_head: bool
    is_peft: bool

    @classmethod
    def build(cls, model: nn.Module) -> "GatherPlan":
        """Groups: embeddings (+extra_pre, +tied head), blocks, final norm (+extra_post),
        untied head, then "other" for parameters the registry does not place."""
        hf = unwrap_peft(model)
        fam = family_of(hf)
        tied = head_is_tied(hf)
        n_blocks = len(resolve(hf, fam.blocks))
        specs = [("embed", "pre", [fam.embed_tokens, *fam.extra_pre] + ([fam.lm_head] if tied else []), None)]
        specs += [(f"block.{i}", "block", [f"{fam.blocks}.{i}"], i) for i in range(n_blocks)]
        specs.append(("post", "post", [fam.final_norm, *fam.extra_post], None))
        if not tied:
            specs.append(("head", "head", [fam.lm_head], None))
        seen: set[int] = set()
        groups = []
        for name, kind, roots, index in specs:
            present = tuple(r for r in roots if r and resolve(hf, r) is not None)
            params = []
            for root in present:
                for pname, p in resolve(hf, root).named_parameters(prefix=root):
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append((pname, p))
            if present:
                groups.append(GatherGroup(name, kind, present, params, True, index))
        leftovers = [(n, p) for n, p in hf.named_parameters() if id(p) not in seen]
        if leftovers:
            owners = tuple(dict.fromkeys(n.rsplit(".", 1)[0] if "." in n else "" for n, _ in leftovers))
            if is_rank_0():
                logger.info(f"gather plan of {fam.model_type}: parameters outside the registry's "
                            f"groups go to group 'other': {[n for n, _ in leftovers]}")
            groups.insert(0, GatherGroup("other", "other", owners, leftovers, False, None))
        return cls(model=hf, groups=groups, tied_head=tied, is_peft=hf is not model)

    @property
    def block_groups(self) -> list[GatherGroup]:
        return [g for g in self.groups if g.kind == "block"]

    @property
    def static_groups(self) -> list[GatherGroup]:
        """Groups that stay resident in layered mode (everything but the blocks)."""
        return [g for g in self.groups if g.kind != "block"]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def partitioned(self) -> bool:
        return any(is_zero3_param(p) for g in self.groups for p in g.tensors())

    def describe(self) -> list[dict]:
        return [{"name": g.name, "roots": list(g.roots), "params": len(g.params), "bytes": g.nbytes}
                for g in self.groups]


# ---------------------------------------------------------------------- scheduler

class Lease:
    """`nbytes` of gathered parameters alive until released (accounting only: every gather
    is admitted; the scheduler records the peak of what is alive at once)."""

    def __init__(self, scheduler: "GatherScheduler", nbytes: int, owner: str):
        self.scheduler, self.nbytes, self.owner = scheduler, nbytes, owner
        self.active = True

    def release(self) -> None:
        self.scheduler._release(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class GatherScheduler:
    """Accounts the parameter gathers of every engine of one process: bytes, seconds, calls,
    copy seconds, and the peak of the gathered bytes alive at once (totals, per owner, and
    per window between `pop_stats` calls)."""

    def __init__(self):
        self._live: list[Lease] = []
        self._totals = self._zero_totals()
        self._window = self._zero_totals()
        self._last: dict = {}
        self._by_owner: dict[str, dict] = {}

    @staticmethod
    def _zero_totals() -> dict:
        return {"bytes": 0, "seconds": 0.0, "calls": 0, "copy_seconds": 0.0, "peak_live_bytes": 0}

    @property
    def live_bytes(self) -> int:
        return sum(lease.nbytes for lease in self._live)

    def lease(self, nbytes: int, owner: str) -> Lease:
        """Record `nbytes` gathered for `owner` as alive until the lease is released; use as a
        context manager."""
        lease = Lease(self, int(nbytes), owner)
        self._live.append(lease)
        live = self.live_bytes
        for bucket in (self._totals, self._window):
            bucket["peak_live_bytes"] = max(bucket["peak_live_bytes"], live)
        return lease

    def _release(self, lease: Lease) -> None:
        if lease.active:
            lease.active = False
            self._live.remove(lease)

    # -- accounting
    def record(self, owner: str, *, nbytes: int, seconds: float, calls: int = 1,
               copy_seconds: float = 0.0) -> None:
        """Account one gather: `nbytes` gathered (full size), `seconds` spent waiting for it."""
        for bucket in (self._totals, self._window):
            bucket["bytes"] += int(nbytes)
            bucket["seconds"] += float(seconds)
            bucket["calls"] += int(calls)
            bucket["copy_seconds"] += float(copy_seconds)
        mine = self._by_owner.setdefault(owner, {"bytes": 0, "seconds": 0.0, "calls": 0})
        mine["bytes"] += int(nbytes)
        mine["seconds"] += float(seconds)
        mine["calls"] += int(calls)
        self._last = {"owner": owner, "bytes": int(nbytes), "seconds": float(seconds),
                      "copy_seconds": float(copy_seconds)}

    @property
    def stats(self) -> dict:
        """Totals since construction, the last call, per-owner totals and live bytes."""
        return {"bytes_total": self._totals["bytes"], "seconds_total": self._totals["seconds"],
                "calls_total": self._totals["calls"], "copy_seconds_total": self._totals["copy_seconds"],
                "peak_live_bytes": self._totals["peak_live_bytes"], "live_bytes": self.live_bytes,
                "last": dict(self._last), "by_owner": copy.deepcopy(self._by_owner)}

    def pop_stats(self) -> dict:
        """Metrics since the previous pop (one PPO step): gather/bytes, /seconds, /calls, ..."""
        w, self._window = self._window, self._zero_totals()
        return {"gather/bytes": w["bytes"], "gather/seconds": w["seconds"], "gather/calls": w["calls"],
                "gather/copy_seconds": w["copy_seconds"], "gather/peak_live_bytes": w["peak_live_bytes"]}

    # -- conveniences bound to this scheduler
    def fill_replica(self, src_module: nn.Module, replica: nn.Module, *, owner: str = "replica") -> None:
        fill_replica(src_module, replica, scheduler=self, owner=owner)

    def gathered(self, module: nn.Module, *, owner: str = "gathered"):
        return gathered(module, scheduler=self, owner=owner)


_SCHEDULER: Optional[GatherScheduler] = None


def get_scheduler() -> GatherScheduler:
    """The process-wide scheduler (created on first use)."""
    global _SCHEDULER
    if _SCHEDULER is None:
        _SCHEDULER = GatherScheduler()
    return _SCHEDULER


# -------------------------------------------------------------- gather primitive

class PendingGather:
    """An all-gather of the partitioned (NOT_AVAILABLE) ZeRO-3 params among `params`.

    Started on construction (asynchronously, with DeepSpeed's own coalesced all-gather,
    which also serves parameters offloaded to CPU); `wait()` completes it; `release()`
    re-partitions exactly the parameters this gather fetched. Parameters that are
    already available (persistent ones, or gathered by someone else) are read as they are.
    """

    def __init__(self, params: Iterable[torch.Tensor]):
        self.params = []
        self.handle = None
        zero3 = [p for p in dict.fromkeys(params) if is_zero3_param(p)]
        if zero3:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
            busy = [p.ds_id for p in zero3 if p.ds_status == ZeroParamStatus.INFLIGHT]
            if busy:
                raise RuntimeError(f"ZeRO-3 params {busy} are in flight from another fetch; "
                                   "gather them after that fetch completes")
            self.params = [p for p in zero3 if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        self.nbytes = sum(full_nbytes(p) for p in self.params)
        if self.params:
            self.handle = self.params[0].all_gather_coalesced(self.params)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def release(self) -> None:
        self.wait()
        if self.params:
            self.params[0].partition(param_list=self.params, has_been_updated=False)
            self.params = []


# Replica fills read the ZeRO-3 shards straight into the replica: one all-gather of a
# unit's shards into a flat buffer, then one multi-tensor copy (with the dtype cast) of
# every rank's slice of every parameter into its replica tensor. DeepSpeed's own fetch
# (PendingGather) also rebuilds every param.data with a concatenation and re-partitions it
# afterwards, Python work per parameter that a replica fill does not need. False:
# DeepSpeed's fetch everywhere (A/B).
DIRECT_FILL = True


@functools.cache
def _zero_status():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return ZeroParamStatus


class DirectPlan:
    """How one fill unit (a gather group, or a layered chunk of groups) is copied straight
    from the ZeRO-3 shards into the replica. Built once per unit and per pattern of which
    of its params are partitioned (`pattern`), then reused by every refill: it fixes the
    views a fill would otherwise build per parameter, the host work that dominated a
    refill (each replica tensor split into its ranks' pieces, and the sizes that split the
    gathered buffer into the matching pieces).

    `params`: the unit's partitioned params, in all-gather order: rank r's slice of the
    gathered buffer is its shards of them, concatenated; shard i holds elements
    [r * n_i, (r + 1) * n_i) of the flattened param (the last ones padded). `plain`
    items' sources are whole already (unpartitioned, or persistent ZeRO-3 params).
    `usable` is False where a fill cannot go this way (a LoRA delta to merge; shards
    offloaded, split by ZeRO++, or in mixed groups or dtypes; a non-contiguous replica
    tensor; a partitioned source outside the unit): DeepSpeed's fetch serves those.
    """

    def __init__(self, params: list, items: list):
        NA = _zero_status().NOT_AVAILABLE
        self.params = [p for p in params if is_zero3_param(p) and p.ds_status == NA]
        self.nbytes = sum(full_nbytes(p) for p in self.params)
        self.world, self.rank, self.group, self.part = 1, 0, None, 0
        self.whole_shards = self.local = False
        self.split: list[list[int]] = []           # per rank: [valid_0, pad_0, valid_1, ...]
        self.dst: list[torch.Tensor] = []          # replica pieces, one per (param, rank)
        self.src_index: list[tuple[int, int]] = [] # per dst piece: (rank, param index)
        self.plain_dst: list[torch.Tensor] = []
        self.plain_src: list[torch.Tensor] = []
        self.usable = all(item.lora is None for item in items) and self._direct_shards()
        if not self.usable:
            return
        if self.params:
            from deepspeed import comm as dist
            self.group = self.params[0].ds_process_group
            self.world, self.rank = dist.get_world_size(group=self.group), dist.get_rank(group=self.group)
        shard = [p.ds_tensor.ds_numel for p in self.params]
        self.part = sum(shard)
        self.whole_shards = all(p.ds_tensor.dim() == 1 and p.ds_tensor.numel() == n
                                for p, n in zip(self.params, shard))
        # one rank and no padding: each shard is its whole param, copied from directly
        self.local = self.world == 1 and self.whole_shards and all(
            n == p.ds_numel for p, n in zip(self.params, shard))
        valid = [[max(0, min(n, p.ds_numel - r * n)) for p, n in zip(self.params, shard)]
                 for r in range(self.world)]
        self.split = [[s for v, n in zip(row, shard) for s in (v, n - v)] for row in valid]
        index = {id(p): i for i, p in enumerate(self.params)}
        for item in items:
            i = index.get(id(item.src))
            if i is None:
                if is_zero3_param(item.src) and item.src.ds_status != _zero_status().AVAILABLE:
                    self.usable = False
                    return
                self.plain_dst.append(item.dst)
                self.plain_src.append(item.src)
            elif not item.dst.is_contiguous():
                self.usable = False
                return
            else:
                sizes = [valid[r][i] for r in range(self.world)]
                self.dst.extend(item.dst.view(-1).split([s for s in sizes if s]))
                self.src_index.extend((r, i) for r in range(self.world) if sizes[r])

    def _direct_shards(self) -> bool:
        """One process group and shard dtype, shards on the accelerator (not offloaded to
        CPU or NVMe), no ZeRO++ secondary partition, shards in the parameter's own dtype."""
        if not self.params:
            return True
        from deepspeed.accelerator import get_accelerator
        device = torch.device(get_accelerator().current_device_name())
        first = self.params[0]
        return all(p.ds_process_group is first.ds_process_group and p.ds_tensor.dtype == p.dtype == first.dtype
                   and p.ds_tensor.device == device and getattr(p.ds_tensor, "final_location", None) is None
                   and getattr(p, "ds_secondary_tensor", None) is None for p in self.params)

    @staticmethod
    def pattern(params: list) -> tuple:
        """Which of `params` are partitioned right now (a plan holds for one pattern)."""
        NA = _zero_status().NOT_AVAILABLE
        return tuple(is_zero3_param(p) and p.ds_status == NA for p in params)


class ShardGather:
    """A `DirectPlan`'s all-gather of the shards (`ds_tensor`) into one flat buffer,
    started on construction; no param.data is made available and no ZeRO state changes.
    `copy()` then writes every item of the plan into the replica. At world size 1 the
    shards are the whole params and are copied from directly."""

    def __init__(self, plan: DirectPlan):
        self.plan, self.params, self.nbytes = plan, plan.params, plan.nbytes
        self.handle = self.flat = None
        self.shards = [p.ds_tensor for p in plan.params]
        if not self.shards or plan.local:
            return
        from deepspeed import comm as dist
        shard = self.shards[0]
        self.flat = torch.empty(plan.world * plan.part, dtype=shard.dtype, device=shard.device)
        local = self.flat.narrow(0, plan.rank * plan.part, plan.part)
        torch.cat(self.shards if plan.whole_shards else
                  [s.view(-1).narrow(0, 0, s.ds_numel) for s in self.shards], out=local)
        self.handle = dist.allgather_fn(self.flat, local, group=plan.group, async_op=True)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def copy(self) -> None:
        """Every item of the plan, written into the replica in one multi-tensor copy."""
        self.wait()
        plan = self.plan
        if self.flat is None:
            src = [self.shards[i] for _, i in plan.src_index]
        else:                   # rank r's slice: [valid_0, pad_0, valid_1, pad_1, ...]
            rows = self.flat.view(plan.world, plan.part)
            pieces = [rows[r].split(plan.split[r]) for r in range(plan.world)]
            src = [pieces[r][2 * i] for r, i in plan.src_index]
        with torch.no_grad():
            torch._foreach_copy_(plan.dst + plan.plain_dst, src + plan.plain_src)

    def release(self) -> None:
        self.wait()
        self.flat, self.shards, self.params = None, [], []


def _direct_plan(params: list, items: list, plans: dict, unit: str) -> Optional[DirectPlan]:
    """The plan that fills `items` (_Copy) straight from the shards of `params`, cached in
    `plans` under `unit`; None where DeepSpeed's fetch has to serve (see DirectPlan)."""
    if not DIRECT_FILL:
        return None
    params = list(dict.fromkeys(params))
    pattern = DirectPlan.pattern(params)
    cached = plans.get(unit)
    if cached is None or cached[0] != pattern:
        cached = plans[unit] = (pattern, DirectPlan(params, items))
    return cached[1] if cached[1].usable else None


def _fill_gather(params: list, plan: Optional[DirectPlan]) -> "ShardGather | PendingGather":
    """Start a replica fill's gather: by `plan` where there is one, else DeepSpeed's fetch."""
    return ShardGather(plan) if plan is not None else PendingGather(params)


def _fill_nbytes(params: list, plan: Optional[DirectPlan]) -> int:
    """Bytes a fill's gather will hold (the lease to take before starting it)."""
    return plan.nbytes if plan is not None else sum(full_nbytes(p) for p in params if needs_gather(p))


# --------------------------------------------------------------------- replicas

def _materialize(model: nn.Module, src: nn.Module, dtype: torch.dtype, device: torch.device,
                 slot_of: Optional[Callable[[str], Optional[str]]] = None,
                 tensor_of: Optional[Callable[[str], torch.Tensor]] = None) -> None:
    """Give a meta-built `model` real tensors: parameters empty in `dtype` (shared ones
    stay shared; `slot_of(name)` maps block params onto shared slot tensors), or the
    tensor `tensor_of(name)` where given (no allocation); buffers copied from `src` (same
    dtype as the source: RoPE tables stay fp32)."""
    made: dict[int, nn.Parameter] = {}
    slots: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in made:
                mod._parameters[key] = made[id(p)]
                continue
            pdtype = dtype if p.is_floating_point() else p.dtype
            name = f"{mod_name}.{key}" if mod_name else key
            slot = slot_of(name) if slot_of is not None else None
            if tensor_of is not None:
                tensor = tensor_of(name)
            elif slot is not None:
                if slot not in slots:
                    slots[slot] = torch.empty(p.shape, dtype=pdtype, device=device)
                if slots[slot].shape != p.shape:
                    raise NotImplementedError(f"layered mode needs blocks of identical shapes; "
                                              f"{mod_name}.{key} differs from its slot {slot}")
                tensor = slots[slot]
            else:
                tensor = torch.empty(p.shape, dtype=pdtype, device=device)
            new = nn.Parameter(tensor, requires_grad=False)
            made[id(p)] = new
            mod._parameters[key] = new
        for key, b in list(mod._buffers.items()):
            if b is None:
                continue
            src_owner = _src_module(src, mod_name)
            src_buf = getattr(src_owner, "_buffers", {}).get(key) if src_owner is not None else None
            if src_buf is None:
                raise RuntimeError(f"replica buffer {mod_name}.{key} has no counterpart in the source model")
            mod._buffers[key] = src_buf.detach().to(device=device, copy=True)


def _src_module(src_hf: nn.Module, path: str) -> Optional[nn.Module]:
    """The source module at `path` (a peft LoRA layer where peft wrapped one)."""
    return src_hf if not path else resolve(src_hf, path)


def _infer_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def build_replica(src_module: nn.Module, dtype: Optional[torch.dtype] = None,
                  device: Optional[torch.device | str] = None, *,
                  block_slot: Optional[int] = None) -> nn.Module:
    """A plain HF module of the source's class and config, for inference only.

    Built on the meta device (so outside any `zero.Init` and without random init), then
    given real, uninitialised parameters in `dtype` on `device` (fill it with
    `fill_replica`). No ZeRO hooks, eval mode, requires_grad False; the head is tied
    exactly when the source's is. For a peft-wrapped source the replica is the plain
    base architecture. `block_slot=G`: blocks i and j share tensors when i % G == j % G
    (the layered skeleton; use `LayeredReplica`).
    """
    hf = unwrap_peft(src_module)
    fam = family_of(hf)
    dtype = dtype or _infer_dtype(hf)
    device = torch.device(device) if device is not None else _default_device()
    replica = _skeleton(hf, fam)
    prefix = fam.blocks + "."

    def slot_of(name: str) -> Optional[str]:
        if block_slot is None or not name.startswith(prefix):
            return None
        index, _, rest = name[len(prefix):].partition(".")
        return f"{int(index) % block_slot}.{rest}"

    _materialize(replica, hf, dtype, device, slot_of)
    return _finish_replica(replica, hf)


def _skeleton(hf: nn.Module, fam) -> nn.Module:
    """`hf`'s class and config built on the meta device, tied like `hf`, same attention."""
    config = copy.deepcopy(hf.config)
    with torch.device("meta"):
        replica = type(hf)(config)
    _match_tying(replica, hf, fam)
    attn = getattr(hf.config, "_attn_implementation", None)
    if attn is not None and getattr(replica.config, "_attn_implementation", None) != attn:
        replica.config._attn_implementation = attn
    use_attention(replica, attention_of(hf))  # Bloom's fused attention where the actor has it
    return replica


def _finish_replica(replica: nn.Module, hf: nn.Module) -> nn.Module:
    if any(is_zero3_param(p) or p.device.type == "meta" for p in replica.parameters()):
        raise RuntimeError("the replica has ZeRO-3 or meta parameters; build it outside zero.Init")
    replica.eval()
    replica.requires_grad_(False)
    if getattr(hf, "generation_config", None) is not None:
        replica.generation_config = copy.deepcopy(hf.generation_config)
    return replica


# A ZeRO-3 model on one rank is partitioned into one piece per parameter: its shard
# (`ds_tensor`, a view into the optimizer's flat fp16/bf16 buffer, updated in place by every
# step) is the whole weight. A replica whose parameters are views of those shards costs no
# memory and no refill; only derived tensors (fused projections of the fast decoder) need
# rebuilding after a step.

def _live_tensor(p: torch.Tensor) -> torch.Tensor:
    """What holds `p`'s current values: its ZeRO-3 shard, or the tensor itself."""
    return p.ds_tensor if is_zero3_param(p) else p.data


def shard_views_unsupported_reason(src_module: nn.Module, dtype: torch.dtype,
                                   device: torch.device) -> Optional[str]:
    """None where `build_shard_view_replica` can serve `src_module` for inference in
    `dtype` on `device`; else why not (LoRA to merge, shards over several ranks or padded,
    offloaded, another dtype)."""
    hf = unwrap_peft(src_module)
    if hf is not src_module:
        return "LoRA weights are merged into a copy"
    from deepspeed import comm as ds_dist
    for name, p in hf.named_parameters():
        if is_zero3_param(p):
            world = ds_dist.get_world_size(group=p.ds_process_group)
            if world != 1:
                return f"ZeRO-3 partitions {name} over {world} ranks"
            shard = p.ds_tensor
            if shard is None or shard.numel() != p.ds_numel or getattr(shard, "final_location", None) is not None \
                    or getattr(p, "ds_secondary_tensor", None) is not None:
                return f"{name}'s ZeRO-3 shard is not the whole tensor in memory"
        t = _live_tensor(p)
        if t.dtype != dtype:
            return f"{name} is {t.dtype}, inference runs in {dtype}"
        if t.device.type != device.type or None not in (t.device.index, device.index) \
                and t.device.index != device.index:
            return f"{name} lives on {t.device}, inference runs on {device}"
        if not t.is_contiguous():
            return f"{name} is not contiguous"
    return None


def build_shard_view_replica(src_module: nn.Module) -> nn.Module:
    """A plain HF module of the source's class and config whose parameters are views of the
    source's live tensors (its ZeRO-3 shards at world size 1): no copy, no refill. Check
    `shard_views_unsupported_reason` first and `shard_views_current` before each use."""
    hf = unwrap_peft(src_module)
    sources = dict(hf.named_parameters(remove_duplicate=False))
    replica = _skeleton(hf, family_of(hf))
    views: list[tuple[torch.Tensor, torch.Tensor]] = []

    def tensor_of(name: str) -> torch.Tensor:
        src = sources.get(name)
        if src is None:
            raise RuntimeError(f"replica parameter {name} has no counterpart in the source model")
        live = _live_tensor(src)
        view = live.detach().view(src.ds_shape if is_zero3_param(src) else src.shape)
        views.append((view, src))
        return view

    device = _live_tensor(next(hf.parameters())).device
    _materialize(replica, hf, _infer_dtype(hf), device, tensor_of=tensor_of)
    replica.__dict__["_dschat_shard_views"] = views
    return _finish_replica(replica, hf)


def shard_views_current(replica: nn.Module) -> bool:
    """Whether every view still points at its source's live storage (DeepSpeed rebinds a
    shard's `.data` after each step, to a view of the same flat buffer, normally)."""
    views = replica.__dict__.get("_dschat_shard_views")
    return views is not None and all(v.data_ptr() == _live_tensor(s).data_ptr() for v, s in views)


def _default_device() -> torch.device:
    """The accelerator DeepSpeed computes on (ZeRO-3 params may be empty or offloaded)."""
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def _match_tying(replica: nn.Module, hf: nn.Module, fam) -> None:
    """Tie (or untie) the replica's head like the source instance's, before materialising."""
    head, emb = resolve(replica, fam.lm_head), resolve(replica, fam.embed_tokens)
    if head is None or emb is None:
        return
    if head_is_tied(hf) and head.weight is not emb.weight:
        head.weight = emb.weight
    elif not head_is_tied(hf) and head.weight is emb.weight:
        head.weight = nn.Parameter(torch.empty_like(emb.weight))


@dataclass
class _Copy:
    dst: torch.Tensor
    src: torch.Tensor
    lora: Optional[nn.Module] = None     # a peft LoRA layer whose delta is merged into dst


@dataclass
class ReplicaBinding:
    """Which source tensor (and LoRA delta) goes into which replica tensor, per group."""
    plan: GatherPlan
    copies: dict[str, list[_Copy]] = field(default_factory=dict)
    buffers: list[_Copy] = field(default_factory=list)
    plans: dict = field(default_factory=dict)    # fill unit -> (pattern, DirectPlan)

    @classmethod
    def build(cls, src_module: nn.Module, replica: nn.Module, plan: Optional[GatherPlan] = None
              ) -> "ReplicaBinding":
        plan = plan or GatherPlan.build(src_module)
        hf = plan.model
        binding = cls(plan)
        bound: set[int] = set()
        for group in plan.groups:
            items = []
            for root in group.roots:
                rmod = replica if not root else replica.get_submodule(root)
                modules = rmod.named_modules(prefix=root) if group.recurse else [(root, rmod)]
                for path, mod in modules:
                    for key, dst in mod._parameters.items():
                        if dst is None or id(dst) in bound:
                            continue
                        if not group.recurse and not _owns(group, path, key):
                            continue
                        bound.add(id(dst))
                        items.append(bind_param(hf, path, key, dst))
            binding.copies[group.name] = items
        missing = [n for n, p in replica.named_parameters() if id(p) not in bound]
        if missing:
            raise RuntimeError(f"replica parameters outside the gather plan: {missing}")
        for name, buf in replica.named_buffers():
            owner, _, key = name.rpartition(".")
            src_owner = _src_module(hf, owner)
            binding.buffers.append(_Copy(buf, src_owner._buffers[key]))
        return binding


def _owns(group: GatherGroup, path: str, key: str) -> bool:
    full = f"{path}.{key}" if path else key
    return any(name == full for name, _ in group.params)


def bind_param(hf: nn.Module, path: str, key: str, dst: torch.Tensor) -> _Copy:
    """Source of replica tensor `path.key`: the plain param, or a LoRA layer's base + delta."""
    src_mod = _src_module(hf, path)
    if src_mod is None:
        raise RuntimeError(f"source model has no module {path!r} for the replica")
    if hasattr(src_mod, "get_base_layer") and hasattr(src_mod, "base_layer"):
        if not hasattr(src_mod, "get_delta_weight"):
            raise NotImplementedError(f"peft layer {type(src_mod).__name__} at {path} cannot be merged")
        base = src_mod.get_base_layer()
        return _Copy(dst, base._parameters[key], src_mod if key == "weight" else None)
    src = src_mod._parameters.get(key)
    if src is None:
        raise RuntimeError(f"source module {path!r} has no parameter {key!r}")
    return _Copy(dst, src)


def lora_delta(layer: nn.Module) -> Optional[torch.Tensor]:
    """Sum of active, unmerged LoRA deltas of a peft layer (None when there is nothing)."""
    if getattr(layer, "disable_adapters", False):
        return None
    merged = set(getattr(layer, "merged_adapters", []))
    variants = getattr(layer, "lora_variant", {}) or {}
    delta = None
    for name in layer.active_adapters:
        present = name in getattr(layer, "lora_A", {}) or name in getattr(layer, "lora_embedding_A", {})
        if not present or name in merged:
            continue
        if name in variants:
            raise NotImplementedError(f"LoRA variant {type(variants[name]).__name__} (e.g. DoRA) "
                                      "is not merged by the replica fill")
        d = layer.get_delta_weight(name)
        delta = d if delta is None else delta + d
    return delta


def _copy_group(items: list[_Copy], gather: "ShardGather | PendingGather | None" = None) -> None:
    """Copy (cast) gathered source tensors into replica tensors in place; merge LoRA.
    A ShardGather copies its whole plan at once (its items are the plan's)."""
    if isinstance(gather, ShardGather):
        gather.copy()
        return
    with torch.no_grad():
        for item in items:
            delta = lora_delta(item.lora) if item.lora is not None else None
            if delta is None:
                item.dst.copy_(item.src.data)
            elif item.dst.dtype == item.src.dtype:
                item.dst.copy_(item.src.data)
                item.dst.add_(delta.to(item.dst.dtype))     # the same op as peft's merge
            else:
                item.dst.copy_(item.src.data + delta.to(item.src.dtype))


def _gather_copy(groups: list[GatherGroup], binding: ReplicaBinding, scheduler: GatherScheduler,
                 owner: str) -> None:
    """Gather each group, copy it into the replica, release it; one group ahead in flight.

    The next group's all-gather is started before this group's copy, so the collective
    overlaps the copy instead of waiting behind it.
    The collectives are issued group by group in the same order on every rank either way;
    only when a group's gather starts relative to the previous copy can differ.
    Recorded seconds are the time the caller waited on gathers plus the releases.
    """
    def start(group: GatherGroup):
        """(lease, PendingGather) of the group's gather."""
        params, items = group.tensors(), binding.copies[group.name]
        plan = _direct_plan(params, items, binding.plans, group.name)
        nbytes = _fill_nbytes(params, plan)
        lease = None
        if nbytes:
            lease = scheduler.lease(nbytes, owner)
        try:
            return lease, _fill_gather(params, plan)
        except BaseException:
            if lease is not None:
                lease.release()
            raise

    def finish(entry) -> None:
        lease, pending = entry
        try:
            pending.release()
        finally:
            if lease is not None:
                lease.release()

    ahead = None                   # groups[i]'s gather, started while groups[i - 1] was copied
    try:
        for i, group in enumerate(groups):
            t0 = time.perf_counter()
            current, ahead = ahead or start(group), None
            pending = current[1]
            try:
                pending.wait()
                t1 = time.perf_counter()
                if i + 1 < len(groups):
                    ahead = start(groups[i + 1])
                t2 = time.perf_counter()
                _copy_group(binding.copies[group.name], pending)
                t3 = time.perf_counter()
            finally:
                finish(current)
            t4 = time.perf_counter()
            if pending.nbytes:
                scheduler.record(owner, nbytes=pending.nbytes, seconds=(t1 - t0) + (t4 - t3),
                                 copy_seconds=t3 - t2)
            else:
                scheduler.record(owner, nbytes=0, seconds=0.0, calls=0, copy_seconds=t3 - t2)
    finally:
        if ahead is not None:      # an exception left the next gather in flight
            finish(ahead)


def needs_gather(p: torch.Tensor) -> bool:
    return is_zero3_param(p) and p.ds_status == _zero_status().NOT_AVAILABLE


def _binding_for(src_module: nn.Module, replica: nn.Module) -> ReplicaBinding:
    cache = replica.__dict__.setdefault("_dschat_bindings", {})
    key = id(src_module)
    if key not in cache or cache[key][0] is not src_module:
        cache[key] = (src_module, ReplicaBinding.build(src_module, replica))
    return cache[key][1]


def fill_replica(src_module: nn.Module, replica: nn.Module, *,
                 scheduler: Optional[GatherScheduler] = None, owner: str = "replica") -> None:
    """Refill `replica` from the live (possibly ZeRO-3-partitioned, peft-wrapped) source.

    Group by group: gather, copy with dtype cast (LoRA: W + scaling * B @ A, computed
    into the replica; the trained tensors are never written), release. The replica's
    tensors keep their addresses. Without ZeRO-3 partitioning nothing is gathered.
    A collective under ZeRO-3: call it on every rank.
    """
    scheduler = scheduler or get_scheduler()
    binding = _binding_for(src_module, replica)
    _gather_copy(binding.plan.groups, binding, scheduler, owner)
    _copy_group(binding.buffers)


def release_replica(replica: Optional[nn.Module]) -> None:
    """Free a replica's storage now (`--release_inference_cache`); it must be rebuilt to be used."""
    if replica is None:
        return
    with torch.no_grad():
        for mod in replica.modules():
            for key, p in mod._parameters.items():
                if p is not None:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            for key, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[key] = torch.empty(0, dtype=b.dtype, device=b.device)
    replica.__dict__.pop("_dschat_bindings", None)
    replica.__dict__["_dschat_released"] = True


# ------------------------------------------------------------------- layered mode

class LayeredReplica:
    """Skeleton replica for `--unpin_actor_parameters`: blocks filled chunk by chunk.

    Non-block weights (embeddings, final norm, head) are resident and refilled by
    `fill()`. All blocks share one slot of `group_size` blocks' tensors (block i uses
    position i % group_size); a forward pre-hook on each block makes its chunk resident:
    it waits for that chunk's gather (prefetched while the previous chunk ran), copies it
    into the slot (cast, LoRA merged), releases it, then starts the next chunk's gather.
    Memory beyond the non-block weights: the slot (one chunk) plus one chunk in flight.
    Every forward re-gathers every chunk (unless there is only one), so this is slower
    than `full` mode and uses less memory. Forward passes are collectives under ZeRO-3:
    generate with `synced_gpus=True`. Run forwards inside `session()`, which drains the
    trailing prefetch so nothing is left in flight afterwards.
    """

    def __init__(self, src_module: nn.Module, *, group_size: int, dtype: Optional[torch.dtype] = None,
                 device=None, scheduler: Optional[GatherScheduler] = None, owner: str = "layered"):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.src = src_module
        self.scheduler = scheduler or get_scheduler()
        self.owner = owner
        self.model = build_replica(src_module, dtype, device, block_slot=group_size)
        self.binding = ReplicaBinding.build(src_module, self.model)
        blocks = self.binding.plan.block_groups
        self.chunks = [blocks[i:i + group_size] for i in range(0, len(blocks), group_size)]
        self.group_size = group_size
        self._resident: Optional[int] = None
        self._pending: Optional[tuple[int, PendingGather, Optional[Lease]]] = None
        self._hooks = []
        self.block_gathers = 0
        fam = family_of(self.binding.plan.model)
        for i, block in enumerate(resolve(self.model, fam.blocks)):
            self._hooks.append(block.register_forward_pre_hook(self._make_hook(i // group_size)))

    @property
    def slot_nbytes(self) -> int:
        """Bytes of the shared block slot (what `group_size` blocks take in the replica)."""
        seen, total = set(), 0
        fam = family_of(self.binding.plan.model)
        for block in resolve(self.model, fam.blocks):
            for p in block.parameters():
                key = p.data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += p.numel() * p.element_size()
        return total

    def fill(self) -> None:
        """Refill the resident (non-block) weights and buffers; blocks load on demand."""
        self._drain()
        self._resident = None
        _gather_copy(self.binding.plan.static_groups, self.binding, self.scheduler, self.owner)
        _copy_group(self.binding.buffers)

    @contextlib.contextmanager
    def session(self):
        """Forward passes with prefetching; on exit the in-flight prefetch is released."""
        try:
            yield self.model
        finally:
            self._drain()

    def close(self) -> None:
        self._drain()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.binding.plans.clear()          # their views would keep the slot's storage alive
        release_replica(self.model)

    # -- internals
    def _make_hook(self, chunk: int):
        def hook(module, args):
            if self._resident != chunk:
                self._load(chunk)
        return hook

    def _chunk_params(self, chunk: int) -> list[torch.Tensor]:
        return [p for g in self.chunks[chunk] for p in g.tensors()]

    def _start(self, chunk: int) -> tuple:
        params = self._chunk_params(chunk)
        items = [item for g in self.chunks[chunk] for item in self.binding.copies[g.name]]
        plan = _direct_plan(params, items, self.binding.plans, f"chunk.{chunk}")
        nbytes = _fill_nbytes(params, plan)
        lease = None
        if nbytes:
            lease = self.scheduler.lease(nbytes, self.owner)
        return chunk, _fill_gather(params, plan), lease, time.perf_counter()

    def _load(self, chunk: int) -> None:
        pending = self._pending
        self._pending = None
        if pending is not None and pending[0] != chunk:
            self._finish(pending)
            pending = None
        if pending is None:
            pending = self._start(chunk)
        _, gather, lease, started = pending
        t0 = time.perf_counter()
        try:
            gather.wait()
            t1 = time.perf_counter()
            if isinstance(gather, ShardGather):
                gather.copy()
            else:
                for group in self.chunks[chunk]:
                    _copy_group(self.binding.copies[group.name], gather)
            t2 = time.perf_counter()
            gather.release()
            t3 = time.perf_counter()
        finally:
            self._finish(pending)
        self._resident = chunk
        self.block_gathers += 1
        if gather.nbytes:
            self.scheduler.record(self.owner, nbytes=gather.nbytes, seconds=(t1 - t0) + (t3 - t2),
                                  copy_seconds=t2 - t1)
        if len(self.chunks) > 1:
            self._pending = self._start((chunk + 1) % len(self.chunks))

    @staticmethod
    def _finish(pending) -> None:
        _, gather, lease, _ = pending
        try:
            gather.release()
        finally:
            if lease is not None:
                lease.release()

    def _drain(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._finish(pending)


# ------------------------------------------------------------- one-off gathers

@contextlib.contextmanager
def gathered(module: nn.Module, *, scheduler: Optional[GatherScheduler] = None, owner: str = "gathered"):
    """Gather every partitioned ZeRO-3 param of `module` once, for forward passes.

    The live module keeps its ZeRO hooks; the params are marked as used by an active
    submodule so the hooks neither refetch nor release them during the forward. On exit
    they are re-partitioned. Use under `torch.no_grad()` (inference only: do not
    backward through it). A collective: call on every rank.
    """
    scheduler = scheduler or get_scheduler()
    params = [p for p in dict.fromkeys(module.parameters()) if needs_gather(p)]
    nbytes = sum(full_nbytes(p) for p in params)
    lease = scheduler.lease(nbytes, owner) if nbytes else None
    pending = None
    try:
        t0 = time.perf_counter()
        pending = PendingGather(params)
        pending.wait()
        for p in pending.params:
            p.ds_active_sub_modules.add(_HOLD_ID)
        scheduler.record(owner, nbytes=pending.nbytes, seconds=time.perf_counter() - t0,
                         calls=1 if pending.nbytes else 0)
        yield module
    finally:
        if pending is not None:
            for p in pending.params:
                p.ds_active_sub_modules.discard(_HOLD_ID)
            pending.release()
        if lease is not None:
            lease.release()
