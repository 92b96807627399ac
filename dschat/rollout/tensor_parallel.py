"""Inference tensor parallelism for the hybrid engine (`--inference_tp_size`).

Training stays ZeRO-3 over all ranks; generation runs tensor-parallel inside groups of
`--inference_tp_size` consecutive ranks (ranks 0..t-1, t..2t-1, ...):

- `get_tp_group(t)`: the process groups (created once, collectively, on every rank).
- `TPReplica`: each rank of a group holds only its slice of the inference replica, cut
  by the registry's TP layout (`ModelFamily.tp_column` / `tp_row` / `tp_qkv_layout`):
  column-parallel linears (QKV, up/gate, fc1) keep a contiguous run of whole heads (or
  of MLP channels) of their output rows and bias; row-parallel linears (attention out,
  down, fc2) the matching input columns, their bias replicated and added once after the
  all-reduce. Embedding and LM head are vocab-parallel (rows split in ceil(V/t) chunks;
  a tied head shares the embedding slice); norms and position tables are replicated.
  The replica is an HF module of the source's class built on the meta device and given
  sliced tensors. `fill()` gathers from the ZeRO-3 shards unit by unit: each non-block
  group alone, the blocks `gather_group_size` (`--tp_gather_partition_size`) at a time;
  per unit: lease from the shared `GatherScheduler`, all-gather, copy this rank's slices
  (cast, LoRA delta merged and sliced alike), release. The full model never exists at once.
- `TPInference`: the family's maths is the single-GPU fast path's own decode block
  (rollout.decode, built with a `TPShard`): over the slices it sees 1/t of the heads, and
  its three TP seams add the group's collectives: the row-parallel outputs are summed
  (one all-reduce after the attention's output projection, one after the MLP's), the
  embedding lookup is vocab-parallel (one all-reduce) and the head's vocab slices are
  all-gathered, so every rank holds identical full logits. The group decodes the prompts
  of all its ranks together: per call it exchanges batch/prompt sizes, left-pads every
  rank's prompts to the longest (and pads each rank to the largest batch with finished
  dummy rows), gathers them and steps eagerly (no graph replay) over a static KV cache of
  this rank's heads; greedy / sampling runs on the full logits and the group leader's
  tokens are broadcast (cheap, and it keeps the group in lockstep whatever the rounding).
  Each rank returns its own rows, trimmed as HF generate trims them (to the longest own
  answer when all own rows hit eos). `logits()` (the experience's log-prob pass) pads
  rows on the right and returns each rank's own rows of the full-vocab logits.
- `TPActorPath`: `HybridActor`'s branch for `inference_tp_size > 1` (build, refill when the
  weights changed, stats).

Collectives: `fill()` is a ZeRO-3 collective over all ranks; `generate` / `logits` are
collectives of the TP group only (groups may finish decoding at different steps).
Numerics: row-parallel sums reduce in a different order than one full GEMM, so logits
differ from HF's by rounding (fp32: ~1e-6); greedy tokens match unless two logits tie
to that precision. 16-bit partial sums are all-reduced in fp32 and rounded once; bf16
tokens can still drift from HF's where a row's top logits tie to bf16 precision. The
logits of a left pad's own (fully masked) query row are arbitrary here and in HF alike,
and differ between the two; no caller reads them.
"""
from __future__ import annotations

import copy
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from dschat.registry import REGISTRY, family_of, head_is_tied, resolve, tp_head_counts, unwrap_peft
from dschat.rollout import kernels
from dschat.rollout.decode import (
    LENGTH_BUCKET,
    TPShard,
    build_block,
    fast_decode_supported_block,
    fast_decode_unsupported_reason,
)
from dschat.rollout.gather import (
    GatherPlan,
    GatherScheduler,
    PendingGather,
    bind_param,
    full_nbytes,
    get_scheduler,
    lora_delta,
    needs_gather,
    release_replica,
)
from dschat.utils import dist
from dschat.utils.errors import UserInputError
from dschat.utils.logging import get_logger, is_rank_0
from dschat.utils.tensor_ops import positions_from_mask

logger = get_logger(__name__)

FLAG = "--inference_tp_size"


# ----------------------------------------------------------------- validation

def tp_layout(fam) -> bool:
    """The family has a tensor-parallel layout (registry tp_column / tp_row) and a decode
    block to run over the slices."""
    return bool(fam.tp_column) and fast_decode_supported_block(fam)


def tp_size_problems(tp_size: int, world_size: int, config=None, *, hybrid: bool = True) -> list[str]:
    """Every problem of `--inference_tp_size` for this world size and actor config
    (config None: only the world-size checks). Messages name the flag and the numbers."""
    out = []
    tp_size = int(tp_size)
    if tp_size < 1:
        return [f"{FLAG} must be >= 1, got {tp_size}"]
    if world_size % tp_size:
        out.append(f"{FLAG} {tp_size} does not divide world size {world_size}")
    if tp_size == 1:
        return out
    if not hybrid:
        out.append(f"{FLAG} {tp_size} needs --enable_hybrid_engine (tensor-parallel generation runs "
                   "on the hybrid engine's replica)")
    if config is None:
        return out
    fam = family_of(config)
    if not tp_layout(fam):
        known = sorted(k for k, f in REGISTRY.items() if tp_layout(f))
        out.append(f"{FLAG} {tp_size}: model type {config.model_type!r} has no tensor-parallel layout "
                   f"(supported: {', '.join(known)})")
        return out
    heads, kv = tp_head_counts(config)
    head_attr = next((a for a in fam.tp_heads if getattr(config, a, None)), fam.tp_heads[0])
    if heads and heads % tp_size:
        out.append(f"{FLAG} {tp_size} does not divide the actor's attention head count {heads} "
                   f"({config.model_type} config {head_attr}={heads})")
    if kv and kv != heads and kv % tp_size:
        kv_attr = next((a for a in fam.tp_kv_heads if getattr(config, a, None)), "kv heads")
        out.append(f"{FLAG} {tp_size} does not divide the actor's key/value head count {kv} "
                   f"({config.model_type} config {kv_attr}={kv})")
    return out


def check_tp_size(tp_size: int, world_size: int, config=None, *, hybrid: bool = True) -> None:
    """Raise one UserInputError listing every `tp_size_problems`."""
    problems = tp_size_problems(tp_size, world_size, config, hybrid=hybrid)
    if problems:
        raise UserInputError("; ".join(problems))


# --------------------------------------------------------------------- groups

@dataclass
class TPGroup:
    """One tensor-parallel group as seen from one of its ranks."""
    size: int
    rank: int                    # rank inside the group
    index: int                   # which group (global rank // size)
    ranks: tuple[int, ...]       # global ranks, consecutive
    handle: object = None        # torch ProcessGroup; None for a group of one

    @property
    def leader(self) -> int:
        return self.ranks[0]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(t, group=self.handle)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [t]
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        torch.distributed.all_gather(out, t, group=self.handle)
        return out

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """The leader's `t` on every rank of the group (in place)."""
        if self.size > 1:
            torch.distributed.broadcast(t, src=self.leader, group=self.handle)
        return t


_GROUPS: dict[tuple[int, int], TPGroup] = {}


def get_tp_group(tp_size: int) -> TPGroup:
    """This rank's TP group of `tp_size` consecutive ranks. The first call for a size is a
    collective: every rank creates every group, in the same order."""
    d = dist.active()
    world, rank = (d.get_world_size(), d.get_rank()) if d else (1, 0)
    if tp_size == 1:
        return TPGroup(1, 0, rank, (rank,), None)
    if d is None:
        raise RuntimeError(f"{FLAG} {tp_size} needs torch.distributed initialised")
    check_tp_size(tp_size, world)
    key = (tp_size, world)
    if key not in _GROUPS:
        mine = None
        for start in range(0, world, tp_size):
            ranks = tuple(range(start, start + tp_size))
            handle = d.new_group(list(ranks))
            if rank in ranks:
                mine = TPGroup(tp_size, rank - start, start // tp_size, ranks, handle)
        _GROUPS[key] = mine
    return _GROUPS[key]


# ------------------------------------------------------------------ splitting

@dataclass(frozen=True)
class Cut:
    """The slice [start, stop) along `dim` of a full tensor that one rank keeps."""
    dim: int
    start: int
    stop: int

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.stop - self.start)


def vocab_bounds(vocab: int, size: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of a vocab-parallel embedding/head: chunks of ceil(V / size)."""
    chunk = -(-vocab // size)
    return min(vocab, rank * chunk), min(vocab, (rank + 1) * chunk)


def unit_cut(n: int, units: int, size: int, rank: int, dim: int) -> Cut:
    """Cut `n` rows (dim `dim`) made of `units` equal runs (heads, or single channels) into
    `size` contiguous parts of whole units; parts differ by at most one unit."""
    if n % units:
        raise RuntimeError(f"tensor-parallel split: {n} rows are not {units} equal units")
    per = n // units
    lo, hi = units * rank // size, units * (rank + 1) // size
    return Cut(dim, lo * per, hi * per)


def cut_table(model: nn.Module, size: int, rank: int, *, vocab_parallel: bool = True) -> dict[str, Cut]:
    """Parameter name -> this rank's Cut for an HF model of a TP-capable family (names as
    `named_parameters()` gives them; a tied head appears under the embedding's name).
    Parameters without an entry are replicated."""
    hf = unwrap_peft(model)
    fam = family_of(hf)
    if fam.tp_qkv_layout not in ("separate", "per_head"):     # e.g. [3, heads, D]: not contiguous per head
        raise NotImplementedError(f"tensor-parallel split of a {fam.tp_qkv_layout!r} fused QKV")
    heads, kv = tp_head_counts(hf.config)
    units = {"heads": heads, "kv_heads": kv}
    col, row = dict(fam.tp_column), dict(fam.tp_row)
    prefix = fam.blocks + "."
    vocab_names = {fam.embed_tokens + ".weight", fam.lm_head + ".weight"}
    cuts = {}
    for name, p in hf.named_parameters():
        if name in vocab_names:
            if vocab_parallel:
                cuts[name] = Cut(0, *vocab_bounds(p.shape[0], size, rank))
            continue
        if not name.startswith(prefix):
            continue
        mod, _, key = name[len(prefix):].partition(".")[2].rpartition(".")
        if mod in col:
            cuts[name] = unit_cut(p.shape[0], units.get(col[mod]) or p.shape[0], size, rank, 0)
        elif mod in row and key == "weight":
            cuts[name] = unit_cut(p.shape[1], units.get(row[mod]) or p.shape[1], size, rank, 1)
    return cuts


# -------------------------------------------------------------------- replica

@dataclass
class _TPCopy:
    dst: torch.Tensor
    src: torch.Tensor
    cut: Optional[Cut]
    lora: Optional[nn.Module] = None


def _copy_cut(items: list[_TPCopy]) -> None:
    """Copy each source's slice (cast) into the replica; merge the LoRA delta's slice."""
    with torch.no_grad():
        for it in items:
            src = it.src.data if it.cut is None else it.cut.apply(it.src.data)
            delta = lora_delta(it.lora) if it.lora is not None else None
            if delta is not None and it.cut is not None:
                delta = it.cut.apply(delta)
            if delta is None:
                it.dst.copy_(src)
            elif it.dst.dtype == it.src.dtype:
                it.dst.copy_(src)
                it.dst.add_(delta.to(it.dst.dtype))     # the same op as peft's merge
            else:
                it.dst.copy_(src + delta.to(src.dtype))


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _default_device() -> torch.device:
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


class TPReplica:
    """This rank's slice of the inference replica of `src_module` (see the module docstring).

    Attributes for reports: `nbytes` (the sliced replica), `full_nbytes` (what the full
    replica would hold in the same dtype), `block_nbytes` / `full_block_nbytes` (block 0),
    `peak_gathered_bytes` (largest unit gathered by `fill`), `fills`.
    """

    def __init__(self, src_module: nn.Module, group: TPGroup, *, dtype: Optional[torch.dtype] = None,
                 device=None, gather_group_size: int = 8, scheduler: Optional[GatherScheduler] = None,
                 owner: str = "actor-tp", vocab_parallel: bool = True):
        if int(gather_group_size) < 1:
            raise UserInputError(f"--tp_gather_partition_size must be >= 1, got {gather_group_size}")
        hf = unwrap_peft(src_module)
        self.src, self.hf, self.fam, self.group = src_module, hf, family_of(hf), group
        check_tp_size(group.size, group.size, hf.config)
        self.dtype = dtype or next((p.dtype for p in hf.parameters() if p.is_floating_point()), torch.float32)
        self.device = torch.device(device) if device is not None else _default_device()
        self.scheduler = scheduler or get_scheduler()
        self.owner, self.vocab_parallel = owner, bool(vocab_parallel)
        self.gather_group_size = int(gather_group_size)
        with torch.device("meta"):
            skeleton = type(hf)(copy.deepcopy(hf.config))
        self._tie_like_source(skeleton)
        names = {id(p): n for n, p in skeleton.named_parameters()}
        cuts = cut_table(skeleton, group.size, group.rank, vocab_parallel=self.vocab_parallel)
        self.full_nbytes = sum(p.numel() * self._dtype_of(p).itemsize for p in skeleton.parameters())
        block0 = resolve(skeleton, self.fam.blocks)[0]
        self.full_block_nbytes = sum(p.numel() * self._dtype_of(p).itemsize for p in block0.parameters())
        head = resolve(skeleton, self.fam.lm_head).weight
        self.vocab = int(head.shape[0])
        self.vocab_lo, self.vocab_hi = (vocab_bounds(self.vocab, group.size, group.rank) if self.vocab_parallel
                                        else (0, self.vocab))
        self.model = skeleton
        self._cut_of = self._materialize(skeleton, {pid: cuts.get(n) for pid, n in names.items()})
        self.model.eval()
        self.model.requires_grad_(False)
        self.model.__dict__["_dschat_tp"] = (group.size, group.rank)
        self.plan = GatherPlan.build(src_module)
        self.units = self._units()
        self.copies, self.buffers = self._bind()
        self.nbytes = _nbytes(self.model.parameters())
        self.block_nbytes = _nbytes(resolve(self.model, self.fam.blocks)[0].parameters())
        self.peak_gathered_bytes = 0
        self.fills = 0

    # -- construction
    def _dtype_of(self, p) -> torch.dtype:
        return self.dtype if p.is_floating_point() else p.dtype

    def _tie_like_source(self, skeleton: nn.Module) -> None:
        head, emb = resolve(skeleton, self.fam.lm_head), resolve(skeleton, self.fam.embed_tokens)
        if head is None or emb is None:
            return
        if head_is_tied(self.hf) and head.weight is not emb.weight:
            head.weight = emb.weight
        elif not head_is_tied(self.hf) and head.weight is emb.weight:
            head.weight = nn.Parameter(torch.empty_like(emb.weight))

    def _materialize(self, skeleton: nn.Module, cut_by_id: dict) -> dict[int, Optional[Cut]]:
        """Real, uninitialised sliced parameters (shared ones stay shared); buffers copied
        from the source. Returns id(new parameter) -> its Cut."""
        made: dict[int, nn.Parameter] = {}
        cut_of: dict[int, Optional[Cut]] = {}
        for mod_name, mod in skeleton.named_modules(remove_duplicate=False):
            for key, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in made:
                    cut = cut_by_id.get(id(p))
                    shape = list(p.shape)
                    if cut is not None:
                        shape[cut.dim] = cut.stop - cut.start
                    new = nn.Parameter(torch.empty(shape, dtype=self._dtype_of(p), device=self.device),
                                       requires_grad=False)
                    made[id(p)] = new
                    cut_of[id(new)] = cut
                mod._parameters[key] = made[id(p)]
            for key, b in list(mod._buffers.items()):
                if b is None:
                    continue
                src_owner = self.hf if not mod_name else resolve(self.hf, mod_name)
                src_buf = getattr(src_owner, "_buffers", {}).get(key) if src_owner is not None else None
                if src_buf is None:
                    raise RuntimeError(f"TP replica buffer {mod_name}.{key} has no counterpart in the source")
                mod._buffers[key] = src_buf.detach().to(device=self.device, copy=True)
        return cut_of

    def _units(self) -> list[list]:
        """Gather units: every non-block group alone, blocks `gather_group_size` at a time."""
        units, chunk = [], []
        for group in self.plan.groups:
            if group.kind == "block":
                chunk.append(group)
                if len(chunk) == self.gather_group_size:
                    units.append(chunk)
                    chunk = []
                continue
            if chunk:
                units.append(chunk)
                chunk = []
            units.append([group])
        if chunk:
            units.append(chunk)
        return units

    def _bind(self):
        """Per gather group: (replica slice, source tensor, cut, LoRA layer); and buffers."""
        owner_of = {id(p): g.name for g in self.plan.groups for _, p in g.params}
        copies: dict[str, list[_TPCopy]] = defaultdict(list)
        seen: set[int] = set()
        for path, mod in self.model.named_modules():
            for key, dst in mod._parameters.items():
                if dst is None or id(dst) in seen:
                    continue
                seen.add(id(dst))
                bound = bind_param(self.hf, path, key, dst)
                group = owner_of.get(id(bound.src))
                if group is None:
                    raise RuntimeError(f"TP replica parameter {path}.{key} is outside the gather plan")
                copies[group].append(_TPCopy(dst, bound.src, self._cut_of[id(dst)], bound.lora))
        buffers = []
        for name, buf in self.model.named_buffers():
            owner, _, key = name.rpartition(".")
            src_owner = self.hf if not owner else resolve(self.hf, owner)
            buffers.append(_TPCopy(buf, src_owner._buffers[key], None))
        return dict(copies), buffers

    # -- filling
    def fill(self) -> None:
        """Refill this rank's slices from the live (ZeRO-3) source, unit by unit. A ZeRO-3
        collective: every rank calls it."""
        for unit in self.units:
            params = [p for g in unit for p in g.tensors()]
            nbytes = sum(full_nbytes(p) for p in params if needs_gather(p))
            lease = self.scheduler.lease(nbytes, self.owner) if nbytes else None
            pending = None
            try:
                t0 = time.perf_counter()
                pending = PendingGather(params)
                pending.wait()
                t1 = time.perf_counter()
                for g in unit:
                    _copy_cut(self.copies.get(g.name, []))
                t2 = time.perf_counter()
                pending.release()
                t3 = time.perf_counter()
                self.peak_gathered_bytes = max(self.peak_gathered_bytes, pending.nbytes)
                self.scheduler.record(self.owner, nbytes=pending.nbytes, seconds=(t1 - t0) + (t3 - t2),
                                      calls=1 if pending.nbytes else 0, copy_seconds=t2 - t1)
            finally:
                if pending is not None:
                    pending.release()
                if lease is not None:
                    lease.release()
        _copy_cut(self.buffers)
        self.fills += 1

    def release(self) -> None:
        release_replica(self.model)

    def stats(self) -> dict:
        return {"tp_size": self.group.size, "tp_rank": self.group.rank, "replica_bytes": self.nbytes,
                "full_replica_bytes": self.full_nbytes, "block_bytes": self.block_nbytes,
                "full_block_bytes": self.full_block_nbytes, "peak_gathered_bytes": self.peak_gathered_bytes,
                "gather_units": len(self.units), "fills": self.fills}


# -------------------------------------------------------------------- decoding


class TPInference:
    """A TP group's replica slice, decoded by the family's own fast-decode block
    (rollout.decode) with the group's collectives in its row-parallel outputs, embedding
    and head. `generate` and `logits` are collectives of the group; `fill` is a ZeRO-3
    collective of all ranks."""

    def __init__(self, src_module: nn.Module, *, tp_size: int, dtype: Optional[torch.dtype] = None,
                 device=None, gather_group_size: int = 8, scheduler: Optional[GatherScheduler] = None,
                 owner: str = "actor-tp", vocab_parallel: bool = True):
        hf = unwrap_peft(src_module)
        d = dist.active()
        check_tp_size(tp_size, d.get_world_size() if d else 1, hf.config)
        self.group = get_tp_group(int(tp_size))
        self.replica = TPReplica(src_module, self.group, dtype=dtype, device=device,
                                 gather_group_size=gather_group_size, scheduler=scheduler, owner=owner,
                                 vocab_parallel=vocab_parallel)
        r = self.replica
        # the replica (LoRA merged into it) has the source's config; lengths are checked per call
        reason = fast_decode_unsupported_reason(r.model, max_total_len=1)
        if reason is not None:
            raise UserInputError(f"{FLAG} {tp_size}: tensor-parallel decode does not support this actor: {reason}")
        self.device = r.device
        on_cuda = self.device.type == "cuda"
        shard = TPShard(self.group, r.vocab, r.vocab_lo, r.vocab_hi, r.vocab_parallel)
        # eager steps (no graph replay: the group's collectives are not captured)
        self.block = build_block(
            r.model, numerics="fast", fuse_qkv=on_cuda, on_cuda=on_cuda,
            use_triton=on_cuda and kernels.available(), tp=shard)
        self.last_stats: dict = {}
        if is_rank_0():
            logger.info(f"tensor-parallel replica ({FLAG} {tp_size}): {r.nbytes} of {r.full_nbytes} bytes "
                        f"per rank; gathered in {len(r.units)} units of up to {gather_group_size} blocks")

    @property
    def model(self) -> nn.Module:
        return self.replica.model

    def fill(self) -> None:
        self.replica.fill()
        self.block.bind()        # the slices are refilled in place; derived (fused) weights follow
        self.block.rebuild()

    def release(self) -> None:
        self.replica.release()

    # -- group exchange
    def _exchange(self, header: list[int]) -> torch.Tensor:
        """Every rank's header ints: [size, len(header)]."""
        h = torch.tensor(header, dtype=torch.long, device=self.device)
        return torch.stack(self.group.all_gather(h))

    def _kv(self, rows: int, length: int) -> torch.Tensor:
        """A static KV cache of this rank's K/V heads, as FastGenerator's workspace holds it."""
        blk = self.block
        return torch.zeros(blk.n_layers, rows, blk.n_kv_heads, length, 2, blk.head_dim,
                           dtype=blk.dtype, device=self.device)

    # -- generate
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 min_new_tokens: int = 0, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, eos_token_id=None, pad_token_id: int,
                 generator: Optional[torch.Generator] = None) -> torch.LongTensor:
        """This rank's left-padded prompts [B, P] -> [B, P + T] as HF generate returns them;
        the group decodes every rank's rows together (see the module docstring). Each rank's
        max/min new tokens, eos and pad apply to its own rows; sampling settings must agree."""
        g, dev, blk = self.group, self.device, self.block
        B, P = input_ids.shape
        eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(int(e) for e in (eos_token_id or ()))
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        hdr = self._exchange([B, P, int(max_new_tokens), int(min_new_tokens or 0), int(pad_token_id), len(eos)])
        sampling = torch.tensor([float(bool(do_sample)), float(temperature), float(top_k or 0), float(top_p)],
                                dtype=torch.float64, device=dev)
        every = torch.stack(g.all_gather(sampling))
        if do_sample and not bool((every == every[0]).all()):
            raise RuntimeError(f"ranks {g.ranks} of a tensor-parallel group sample with different settings "
                               f"(do_sample, temperature, top_k, top_p): {every.tolist()}")
        E = int(hdr[:, 5].max())
        eos_pad = torch.tensor(list(eos) + [eos[0] if eos else 0] * (E - len(eos)), dtype=torch.long, device=dev)
        eos_all = torch.stack(g.all_gather(eos_pad)) if E else None      # [size, E], padded by repeats
        Bm, Pm, T = max(int(hdr[:, 0].max()), 1), int(hdr[:, 1].max()), int(hdr[:, 2].max())
        reason = fast_decode_unsupported_reason(blk.model, max_total_len=Pm + T)
        if reason is not None:
            raise NotImplementedError(f"tensor-parallel decode: {reason}")
        ids = torch.full((Bm, Pm), int(pad_token_id), dtype=torch.long, device=dev)
        mask = torch.zeros((Bm, Pm), dtype=torch.long, device=dev)
        ids[:B, Pm - P:] = input_ids.to(dev)
        mask[:B, Pm - P:] = attention_mask.to(dev).long()
        mask[B:, -1] = 1                             # dummy rows: one visible key, finished at once
        ids, mask = torch.cat(g.all_gather(ids)), torch.cat(g.all_gather(mask))
        rows = self._row_settings(hdr, eos_all, Bm)
        N = ids.shape[0]
        L = -(-(Pm + T) // LENGTH_BUCKET) * LENGTH_BUCKET
        ext = torch.ones((N, L), dtype=torch.long, device=dev)
        ext[:, :Pm] = mask
        key_bias = blk.key_bias(ext)
        key_start = (mask != 0).int().argmax(-1).int()
        arange = torch.arange(L, device=dev)
        kv = self._kv(N, L)
        t0 = time.perf_counter()
        logits = blk.prefill(ids, mask, blk.prompt_positions(mask), kv, key_bias[:, :, :Pm])
        t1 = time.perf_counter()
        row_pos = mask.sum(-1) - 1
        finished = ~rows["real"] | (rows["max_new"] < 1)
        out = rows["pad"][:, None].repeat(1, T)
        made = 0
        for t in range(T):
            nxt = self._select(logits, t, rows, bool(do_sample), float(temperature), int(top_k or 0),
                               float(top_p), generator)
            nxt = torch.where(finished, rows["pad"], nxt)
            if rows["eos"] is not None:
                finished |= (nxt[:, None] == rows["eos"]).any(-1) & rows["has_eos"]
            out[:, t] = nxt
            made = t + 1
            finished |= rows["max_new"] <= made
            if made == T or bool(finished.all()):
                break
            slot = Pm + t                             # the fed token's cache slot
            row_pos += 1
            pos = torch.tensor([slot], dtype=torch.long, device=dev)
            Lb = min(L, -(-(slot + 1) // LENGTH_BUCKET) * LENGTH_BUCKET)
            logits = blk.decode(nxt, row_pos, pos, kv, blk.step_bias(key_bias, arange, pos, Lb), Lb, key_start)
        mine = out[g.rank * Bm:g.rank * Bm + B, :min(made, int(max_new_tokens))]
        if eos and B:
            is_eos = torch.isin(mine, torch.tensor(eos, dtype=torch.long, device=dev))
            if bool(is_eos.any(-1).all()):          # HF stops when all of its own rows are done
                mine = mine[:, :int(is_eos.int().argmax(-1).max()) + 1]
        self.last_stats = dict(prefill_ms=1e3 * (t1 - t0), decode_ms=1e3 * (time.perf_counter() - t1),
                               steps=made, group_rows=N, group_prompt_len=Pm)
        return torch.cat([input_ids, mine.to(input_ids.device)], dim=1)

    def _row_settings(self, hdr: torch.Tensor, eos_all: Optional[torch.Tensor], Bm: int) -> dict:
        """Per group row: real (not a dummy), max/min new tokens, pad, eos ids [N, E]."""
        size = self.group.size
        rank_of_row = torch.arange(size * Bm, device=self.device) // Bm
        per = hdr.to(self.device)[rank_of_row]
        rows = {"real": (torch.arange(size * Bm, device=self.device) % Bm) < per[:, 0],
                "max_new": per[:, 2], "min_new": per[:, 3], "pad": per[:, 4].clone(),
                "has_eos": per[:, 5] > 0, "eos": None if eos_all is None else eos_all[rank_of_row]}
        return rows

    def _select(self, logits, t: int, rows: dict, do_sample: bool, temperature: float, top_k: int,
                top_p: float, generator) -> torch.Tensor:
        """Next token per row, HF's processor order (eos blocked below min_new_tokens), on
        identical logits everywhere; the leader's choice is broadcast to the group."""
        if rows["eos"] is not None:
            blocked = ((t < rows["min_new"]) & rows["has_eos"])[:, None].expand_as(rows["eos"])
            vals = logits.gather(1, rows["eos"]).masked_fill(blocked, float("-inf"))
            logits = logits.scatter(1, rows["eos"], vals)    # repeats of one id write one value
        if not do_sample:
            nxt = logits.argmax(-1)
        elif self.group.rank == 0:
            nxt = _sample(logits, temperature, top_k, top_p, generator)
        else:
            nxt = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        return self.group.broadcast_(nxt.contiguous())

    # -- scoring
    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 logits [B, S, V] of this rank's rows; the group's rows are padded on the
        right to a common length and run together."""
        g, dev, blk = self.group, self.device, self.block
        B, S = input_ids.shape
        hdr = self._exchange([B, S])
        Bm, Sm = max(int(hdr[:, 0].max()), 1), int(hdr[:, 1].max())
        ids = torch.zeros((Bm, Sm), dtype=torch.long, device=dev)
        mask = torch.zeros((Bm, Sm), dtype=torch.long, device=dev)
        ids[:B, :S] = input_ids.to(dev)
        mask[:B, :S] = attention_mask.to(dev).long()
        mask[B:, 0] = 1
        ids, mask = torch.cat(g.all_gather(ids)), torch.cat(g.all_gather(mask))
        # the training forward's positions (HF generate's: masked slots at 1), not the prompt's
        # own rule: a masked slot inside an answer predicts the next token in both passes
        pos = None if blk.prompt_positions(mask) is None else positions_from_mask(mask)
        if pos is not None and position_ids is not None:   # the caller's positions for its own rows
            own = pos[g.rank * Bm:(g.rank + 1) * Bm].clone()
            own[:B, :S] = position_ids.to(dev)
            pos = torch.cat(g.all_gather(own))
        h = blk.prefill(ids, mask, pos, self._kv(ids.shape[0], Sm), blk.key_bias(mask), hidden=True)
        if not self.replica.vocab_parallel or g.size == 1:
            return F.linear(h[g.rank * Bm:g.rank * Bm + B], blk.head)[:, :S].float()
        return self._own_rows_logits(h, Bm)[:B, :S].float()

    def _own_rows_logits(self, h: torch.Tensor, Bm: int) -> torch.Tensor:
        """Full-vocab logits of this rank's `Bm` rows: each rank's vocab slice of rank r's
        rows is gathered on rank r only ([Bm, S, V] per rank, not the group's [N, S, V])."""
        g, rep = self.group, self.replica
        local = self.block.tp.pad_vocab_slice(F.linear(h, self.block.head))
        mine = None
        for r in range(g.size):
            part = local[r * Bm:(r + 1) * Bm].contiguous()
            parts = [torch.empty_like(part) for _ in range(g.size)] if r == g.rank else None
            torch.distributed.gather(part, parts, dst=g.ranks[r], group=g.handle)
            if parts is not None:
                mine = torch.cat(parts, dim=-1)[..., :rep.vocab]
        return mine


def _sample(logits, temperature: float, top_k: int, top_p: float, generator) -> torch.Tensor:
    """Temperature, top-k, top-p (HF's order), then one categorical draw per row."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if top_k > 0:
        kth = torch.topk(x, min(top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        asc, order = torch.sort(x, dim=-1)
        drop = asc.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = x.softmax(-1)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


# ---------------------------------------------------------------- hybrid hook

class TPActorPath:
    """`HybridActor`'s branch for `inference_tp_size > 1`: builds the TP replica once,
    refills it when the actor's weights changed, and runs generate / logits on it with
    the actor's stats. Validates the size on construction (UserInputError)."""

    def __init__(self, actor, tp_size: int):
        check_tp_size(tp_size, actor.world_size, actor.hf.config, hybrid=actor.enable_hybrid_engine)
        self.actor, self.tp_size = actor, int(tp_size)
        self.engine: Optional[TPInference] = None
        self.filled_key = None
        if actor.mode == "layered" and is_rank_0():
            logger.info(f"{FLAG} {tp_size}: --unpin_actor_parameters has no effect; the tensor-parallel "
                        "replica slice stays resident (1/tp of the model per rank)")

    def inference(self) -> TPInference:
        """The TP engine, built and refilled as needed (a collective of all ranks)."""
        a = self.actor
        if self.engine is None:
            self.engine = TPInference(a.module, tp_size=self.tp_size, dtype=a.inference_dtype, device=a.device,
                                      gather_group_size=a.tp_gather_partition_size, scheduler=a.scheduler,
                                      owner=a.owner)
            self.filled_key = None
            a._stats["gen/builds"] += 1
        key = a._weights_key()
        if self.filled_key != key:
            t0 = time.perf_counter()
            self.engine.fill()
            self.filled_key = key
            a._stats["gen/fill_seconds"] += time.perf_counter() - t0
            a._stats["gen/refills"] += 1
        return self.engine

    def generate(self, input_ids, attention_mask, **kwargs) -> torch.LongTensor:
        a = self.actor
        t0 = time.perf_counter()
        engine = self.inference()
        out = engine.generate(input_ids.to(a.device), attention_mask.to(a.device), **kwargs)
        a._stats["gen/seconds"] += time.perf_counter() - t0
        a._stats["gen/calls"] += 1
        a._stats["gen/tokens"] += int(out.shape[0] * (out.shape[1] - input_ids.shape[1]))
        return out

    def logits(self, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inference().logits(input_ids, attention_mask, position_ids)
        self.actor._stats["gen/logits_seconds"] += time.perf_counter() - t0
        return out

    def release(self) -> None:
        if self.engine is not None:
            self.engine.release()
        self.engine, self.filled_key = None, None
