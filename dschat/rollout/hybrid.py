"""The hybrid actor: one DeepSpeed-trained actor that also generates fast.

`HybridActor` wraps the actor's DeepSpeed engine and replaces DeepSpeed's hybrid engine
(which refuses Bloom on transformers 5 and computes its ALiBi wrongly on ranks > 0):

- hybrid engine on, `full` mode: a persistent inference replica (a plain HF module of
  the actor's architecture, see `gather.build_replica`) is refilled in place from the
  ZeRO-3 shards whenever the weights changed (`mark_weights_updated()`, or the engine's
  `global_steps` moved), LoRA merged into the replica; decoding runs on the replica with
  `dschat.rollout.decode.FastGenerator` where supported (on CUDA by default), else with
  HF `generate`. The same replica serves `logits` / `log_probs` (the experience's actor
  log-prob pass), so the weights are gathered once per rollout.
- ZeRO-3 on one rank (path "shards"): each parameter's shard is the whole weight, so the
  replica's parameters are views of the shards themselves (`gather.build_shard_view_replica`):
  no second copy of the actor, no refill (the optimizer updates the shards in place); only
  the fast decoder's derived tensors are rebuilt after a step. Needs the training dtype,
  no LoRA and the shards on the accelerator (not offloaded); else `full` (or `layered`).
- `layered` mode (`--unpin_actor_parameters`): a skeleton replica whose blocks are
  filled `tp_gather_partition_size` at a time during every forward (`gather.LayeredReplica`);
  HF generate with `synced_gpus` under ZeRO-3 with more than one rank.
- ZeRO 0-2 (nothing partitioned): nothing is gathered. Without LoRA and with the
  training dtype, the "replica" is the live module itself (an alias, switched to eval
  for the call); otherwise a replica is filled by copy/cast (+ LoRA merge).
- `inference_tp_size > 1` (path "tp"): each rank holds 1/tp of the replica and the TP group
  decodes its ranks' prompts together (`dschat.rollout.tensor_parallel.TPActorPath`).
- hybrid engine off: HF generate on the live module through ZeRO-3's hooks, with
  `synced_gpus=True` under ZeRO-3 with more than one rank (as upstream).

Every rank must make the same calls (generate / logits / refill are collectives under
ZeRO-3). Greedy by default; sampling draws from a per-rank generator (seed + rank).
Forward passes of `logits` use `position_ids_for(model, attention_mask)` (positions from
the attention mask, as HF generate computes them); the training forward must use the
same helper for its log-probs to match.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.nn as nn

from dschat.engine.zero import is_zero3_param
from dschat.registry import logits_to_keep_kwargs, position_ids_for, unwrap_peft
from dschat.rollout.gather import (
    GatherScheduler,
    LayeredReplica,
    build_replica,
    build_shard_view_replica,
    fill_replica,
    get_scheduler,
    release_replica,
    shard_views_current,
    shard_views_unsupported_reason,
)
from dschat.utils import dist
from dschat.utils.errors import UserInputError
from dschat.utils.logging import get_logger, is_rank_0
from dschat.utils.tensor_ops import gather_log_probs

logger = get_logger(__name__)

MODES = ("full", "layered")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
def _parse_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise UserInputError(f"inference dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")


class HybridActor:
    """Train <-> generate switching for the actor engine (see the module docstring).

    Public API: `generate`, `logits`, `log_probs`, `mark_weights_updated`, `train`,
    `eval`, `release_inference_cache`, `pop_stats`, and the properties `inference_model`
    (what decoding runs on) and `path` ("hooks" | "alias" | "shards" | "full" | "layered" | "tp").
    """

    def __init__(self, engine, *, enable_hybrid_engine: bool, mode: str = "full",
                 tp_gather_partition_size: int = 8, release_inference_cache: bool = False,
                 inference_dtype=None, use_fast_decode: Optional[bool] = None,
                 scheduler: Optional[GatherScheduler] = None, max_prompt_len: int,
                 max_new_tokens: int, seed: int = 1234, owner: str = "actor",
                 inference_tp_size: int = 1, shard_views: bool = True):
        if mode not in MODES:
            raise UserInputError(f"hybrid actor mode must be one of {MODES} "
                                 f"(--unpin_actor_parameters selects 'layered'), got {mode!r}")
        if int(tp_gather_partition_size) < 1:
            raise UserInputError(f"--tp_gather_partition_size must be >= 1, got {tp_gather_partition_size}")
        if max_prompt_len < 1 or max_new_tokens < 1:
            raise UserInputError(f"--max_prompt_seq_len ({max_prompt_len}) and --max_answer_seq_len "
                                 f"({max_new_tokens}) must be >= 1")
        self.engine = engine
        self.module: nn.Module = engine.module
        self.hf: nn.Module = unwrap_peft(self.module)
        self.enable_hybrid_engine = bool(enable_hybrid_engine)
        self.mode = mode
        self.tp_gather_partition_size = int(tp_gather_partition_size)
        self.release_inference_cache_after_rollout = bool(release_inference_cache)
        self.use_fast_decode = use_fast_decode
        self.shard_views = bool(shard_views)     # False: a copied replica even on one rank
        self._shard_views_reason: Optional[str] = None
        self.scheduler = scheduler or get_scheduler()
        self.max_prompt_len, self.max_new_tokens = int(max_prompt_len), int(max_new_tokens)
        self.owner = owner
        self.zero3 = any(is_zero3_param(p) for p in self.module.parameters())
        self.is_peft = self.hf is not self.module
        self.train_dtype = next((p.dtype for p in self.module.parameters() if p.is_floating_point()),
                                torch.float32)
        self.inference_dtype = _parse_dtype(inference_dtype) or self.train_dtype
        self.device = torch.device(getattr(engine, "device", None) or self._accel_device())
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._generator = torch.Generator(device="cpu").manual_seed(int(seed) + self.rank)
        self._version = 0
        self._filled_key = None
        self._replica: Optional[nn.Module] = None
        self._layered: Optional[LayeredReplica] = None
        self._fast = None
        self._fast_unavailable = False
        self._logged: set[str] = set()
        self._stats = self._empty_stats()
        # --inference_tp_size > 1: generate/logits run tensor-parallel in groups of ranks
        # (dschat/rollout/tensor_parallel.py); validates the size (UserInputError)
        self._tp = None
        if int(inference_tp_size) > 1:
            from dschat.rollout.tensor_parallel import TPActorPath
            self._tp = TPActorPath(self, int(inference_tp_size))

    # ------------------------------------------------------------------ state
    @staticmethod
    def _accel_device() -> str:
        from deepspeed.accelerator import get_accelerator
        return get_accelerator().current_device_name()

    @staticmethod
    def _empty_stats() -> dict:
        return {"gen/seconds": 0.0, "gen/calls": 0, "gen/tokens": 0, "gen/fill_seconds": 0.0,
                "gen/refills": 0, "gen/logits_seconds": 0.0, "gen/builds": 0}

    @property
    def path(self) -> str:
        """What generation runs on: "hooks" (hybrid off), "alias", "shards", "full",
        "layered" or "tp"."""
        if not self.enable_hybrid_engine:
            return "hooks"
        if self._tp is not None:
            return "tp"
        if self.zero3 and self._shard_views_usable():
            return "shards"
        if self.mode == "layered" and self.zero3:
            return "layered"
        if (not self.zero3 and not self.is_peft and self.inference_dtype == self.train_dtype
                and self.device.type == next(self.module.parameters()).device.type):
            return "alias"
        return "full"

    def _shard_views_usable(self) -> bool:
        """ZeRO-3 on one rank with views of the shards as the replica (checked once)."""
        if not self.shard_views or self.world_size != 1 or self.is_peft \
                or self.inference_dtype != self.train_dtype:
            return False
        if self._shard_views_reason is None:
            self._shard_views_reason = shard_views_unsupported_reason(
                self.module, self.inference_dtype, self.device) or ""
            if self._shard_views_reason:
                self._log_once("shards", f"HybridActor: a copied replica; views of the ZeRO-3 shards "
                                         f"are not usable: {self._shard_views_reason}")
        return not self._shard_views_reason

    def mark_weights_updated(self) -> None:
        """The trainer calls this after each optimizer step (on every rank)."""
        self._version += 1

    def _weights_key(self):
        return self._version, int(getattr(self.engine, "global_steps", 0) or 0)

    def _log_once(self, key: str, msg: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            if is_rank_0():
                logger.info(msg)

    @property
    def inference_model(self) -> nn.Module:
        """The module decoding runs on, built and refilled as needed (a collective)."""
        path = self.path
        if path == "hooks":
            return self.module
        if path == "tp":            # this rank's slice of the replica (not runnable by HF)
            return self._tp.inference().model
        if path == "alias":
            self._sync_alias()
            return self.hf
        if path == "shards":
            self._ensure_shard_views()
            return self._replica
        self._ensure_filled(path)
        return self._layered.model if path == "layered" else self._replica

    def _sync_alias(self) -> None:
        """The alias is the live weights (the optimizer updates them in place); only the
        fast decoder's derived tensors (fused projections) need a refresh after a step."""
        key = self._weights_key()
        if self._filled_key != key:
            if self._fast is not None:
                self._fast.refresh()
            self._filled_key = key

    def _ensure_shard_views(self) -> None:
        """Build the views once (again if a shard moved); after a step only the fast
        decoder's derived tensors need rebuilding, as for the alias."""
        if self._replica is None or not shard_views_current(self._replica):
            if self._replica is not None:
                self._log_once("shards-moved", "HybridActor: a ZeRO-3 shard moved; replica views rebuilt")
            self._replica = build_shard_view_replica(self.module)
            self._log_once("shards-built", "HybridActor: ZeRO-3 on one rank; generation reads the shards "
                                           "themselves (no replica copy, no refill)")
            self._filled_key = None
            self._stats["gen/builds"] += 1
        key = self._weights_key()
        if self._filled_key != key:
            t0 = time.perf_counter()
            if self._fast is not None:
                self._fast.refresh()
            self._filled_key = key
            self._stats["gen/fill_seconds"] += time.perf_counter() - t0
            self._stats["gen/refills"] += 1

    def _ensure_filled(self, path: str) -> None:
        """Build the replica once; refill it when the weights changed since the last fill."""
        key = self._weights_key()
        if path == "layered" and self._layered is None:
            self._layered = LayeredReplica(self.module, group_size=self.tp_gather_partition_size,
                                           dtype=self.inference_dtype, device=self.device,
                                           scheduler=self.scheduler, owner=self.owner)
            self._filled_key = None
            self._stats["gen/builds"] += 1
        if path == "full" and self._replica is None:
            self._replica = build_replica(self.module, self.inference_dtype, self.device)
            self._filled_key = None
            self._stats["gen/builds"] += 1
        if self._filled_key == key:
            return
        t0 = time.perf_counter()
        if path == "layered":
            self._layered.fill()
        else:
            fill_replica(self.module, self._replica, scheduler=self.scheduler, owner=self.owner)
            if self._fast is not None:
                self._fast.refresh()
        self._filled_key = key
        self._stats["gen/fill_seconds"] += time.perf_counter() - t0
        self._stats["gen/refills"] += 1

    @contextlib.contextmanager
    def _running(self, model: nn.Module):
        """Eval mode for the live module while it generates; a prefetch session if layered."""
        live = model is self.module or model is self.hf
        was_training = self.module.training
        if live:
            self.module.eval()
        try:
            if self._layered is not None and model is self._layered.model:
                with self._layered.session():
                    yield
            else:
                yield
        finally:
            if live and was_training:
                self.module.train()

    # -------------------------------------------------------------- generate
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                 max_new_tokens: Optional[int] = None, min_new_tokens: int = 0, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_token_id=None,
                 pad_token_id: int, generator: Optional[torch.Generator] = None) -> torch.LongTensor:
        """Left-padded prompts [B, P] -> sequences [B, P + T], as HF generate returns them."""
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if self._tp is not None:    # tensor-parallel: the group decodes all its ranks' prompts
            return self._tp.generate(
                input_ids, attention_mask, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                generator=generator if generator is not None else self._generator)
        t0 = time.perf_counter()
        model = self.inference_model
        path = self.path
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        generator = generator if generator is not None else self._generator
        args = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, do_sample=do_sample,
                    temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id)
        with torch.no_grad(), self._running(model):
            fast = self._fast_generator(model, path, input_ids.shape[1], max_new_tokens)
            if fast is not None:
                out = fast.generate(input_ids, attention_mask, generator=generator, **args)
            else:
                synced = (path == "hooks" and self.zero3 or path == "layered") and self.world_size > 1
                out = self._hf_generate(model, input_ids, attention_mask, synced, generator, **args)
        self._stats["gen/seconds"] += time.perf_counter() - t0
        self._stats["gen/calls"] += 1
        self._stats["gen/tokens"] += int(out.shape[0] * (out.shape[1] - input_ids.shape[1]))
        return out

    def _hf_generate(self, model, input_ids, attention_mask, synced: bool, generator, *,
                     max_new_tokens, min_new_tokens, do_sample, temperature, top_k, top_p,
                     eos_token_id, pad_token_id) -> torch.LongTensor:
        """HF generate with an explicit config; sampling seeded from `generator` without
        touching the caller's global RNG state."""
        from transformers import GenerationConfig
        kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or None,
                      do_sample=bool(do_sample), num_beams=1, use_cache=True,
                      eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        if do_sample:
            kwargs.update(temperature=temperature, top_k=top_k or 0, top_p=top_p)
        config = GenerationConfig(**kwargs)
        call = dict(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                    synced_gpus=synced)
        if not do_sample:
            return model.generate(**call)
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        devices = [input_ids.device] if input_ids.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return model.generate(**call)

    def _fast_generator(self, model, path: str, prompt_len: int, max_new_tokens: int):
        """The fast decoder for the replica, or None (reason logged once) for HF generate."""
        if path not in ("full", "alias", "shards") or self.use_fast_decode is False:
            return None
        if prompt_len > self.max_prompt_len or max_new_tokens > self.max_new_tokens:
            self._log_once("fast-shape", f"fast decode skipped: prompt {prompt_len} / new tokens "
                           f"{max_new_tokens} exceed {self.max_prompt_len} / {self.max_new_tokens}")
            return None
        if self._fast is not None:
            return self._fast
        if self._fast_unavailable:
            return None
        reason = None
        if self.use_fast_decode is None and self.device.type != "cuda":
            reason = f"inference runs on {self.device.type}, the fast path is CUDA-only by default"
        else:
            # an unsupported model or shape is a reason (logged once, HF generate); any other
            # error in the decode module is a bug and raises instead of a quiet fall-back
            from dschat.rollout import decode
            reason = decode.fast_decode_unsupported_reason(model, max_total_len=self.max_prompt_len
                                                           + self.max_new_tokens)
            if reason is None:
                self._fast = decode.FastGenerator(model, max_prompt_len=self.max_prompt_len,
                                                  max_new_tokens=self.max_new_tokens)
        if reason is not None:
            self._fast_unavailable = True
            self._log_once("fast", f"HybridActor: HF generate on the replica; fast decode off: {reason}")
        return self._fast

    # ---------------------------------------------------------------- scoring
    @contextlib.contextmanager
    def scoring_model(self):
        """The module to score sequences on without grad, in eval mode for the block: the
        replica when the hybrid engine is on (no new gather unless the weights changed), else
        the live module; None under tensor parallelism (no runnable model on one rank: use
        `logits`). The caller runs the forward, so it can swap the output layer
        (dschat.models.fused_head) and never hold [B, S, V] logits."""
        if self._tp is not None:
            yield None
            return
        t0 = time.perf_counter()
        model = self.inference_model
        try:
            with torch.no_grad(), self._running(model):
                yield model
        finally:
            self._stats["gen/logits_seconds"] += time.perf_counter() - t0

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: Optional[torch.Tensor] = None, keep_last: int = 0) -> torch.Tensor:
        """fp32 logits [B, S, V] of the current weights without grad (see `scoring_model`);
        only the last `keep_last` columns when it is > 0 ([B, keep_last, V])."""
        if self._tp is not None:
            logits = self._tp.logits(input_ids, attention_mask, position_ids)
            return logits[:, -keep_last:] if keep_last > 0 else logits
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        with self.scoring_model() as model:
            if position_ids is None:
                position_ids = position_ids_for(model, attention_mask)
            kwargs = {} if position_ids is None else {"position_ids": position_ids.to(self.device)}
            kwargs.update(logits_to_keep_kwargs(model, keep_last))
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        logits = out.logits[:, -keep_last:] if keep_last > 0 else out.logits
        return logits.float()

    def log_probs(self, seq: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """log p(seq[:, 1:]) under the current weights: [B, S - 1], fp32, no grad."""
        logits = self.logits(seq, attention_mask)
        return gather_log_probs(logits[:, :-1], seq[:, 1:].to(logits.device))

    # ---------------------------------------------------------------- switches
    def train(self, mode: bool = True) -> "HybridActor":
        """Back to training; frees the inference cache here when `release_inference_cache`."""
        self.engine.train(mode)
        if mode and self.release_inference_cache_after_rollout:
            self.release_inference_cache()
        return self

    def eval(self) -> "HybridActor":
        self.engine.eval()
        return self

    def release_inference_cache(self) -> None:
        """Free the replica (or skeleton), the fast decoder's cache and graphs."""
        if self._tp is not None:
            self._tp.release()
        if self._fast is not None:
            self._fast.release()
            self._fast = None
        if self._layered is not None:
            self._layered.close()
            self._layered = None
        if self._replica is not None:
            release_replica(self._replica)
            self._replica = None
        self._fast_unavailable = False
        self._filled_key = None

    def pop_stats(self) -> dict:
        """This actor's generation metrics since the last pop. The shared scheduler's
        gather metrics are popped once per step with `get_scheduler().pop_stats()`."""
        stats, self._stats = self._stats, self._empty_stats()
        return stats
