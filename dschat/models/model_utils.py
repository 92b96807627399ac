"""Load, create and save HF causal LMs and their tokenizers.

A `model_name_or_path` may be a local model folder (weights loaded by `from_pretrained`,
partitioned at load time under ZeRO-3), a `config.json` file or a folder holding only a
config (seeded random init: the demo and the tests), or a hub name.
"""
from __future__ import annotations

import json
import math
import os
import types
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from dschat.data.assets import bundled_tokenizer_path
from dschat.registry import family_of, get_family, unwrap_peft
from dschat.utils.attention import hf_attn_kwargs, use_attention
from dschat.utils.checkpoint import fault_point
from dschat.utils.errors import UserInputError
from dschat.utils.logging import get_logger

logger = get_logger(__name__)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# files a saved model folder has besides its weights: their presence means weights are missing
SAVED_MODEL_FILES = TOKENIZER_FILES + ("generation_config.json",)


def _is_local(path: str) -> bool:
    return os.path.exists(path)


def has_weights(folder: str | Path) -> bool:
    folder = Path(folder)
    return folder.is_dir() and any((folder / f).exists() for f in WEIGHT_FILES)


def _config_file(path: str) -> Path | None:
    p = Path(path)
    if p.is_file() and p.suffix == ".json":
        return p
    if p.is_dir() and (p / "config.json").exists():
        return p / "config.json"
    return None


def load_config(model_name_or_path: str):
    """HF config from a config.json file, a model folder or a hub name."""
    cfg_file = _config_file(model_name_or_path)
    if cfg_file is not None:
        with open(cfg_file) as f:
            data = json.load(f)
        if "model_type" not in data:
            raise UserInputError(f"{cfg_file}: not a model config (no 'model_type')")
        get_family(data["model_type"])  # unknown types fail here, listing the known ones
        return AutoConfig.for_model(**data)
    if _is_local(model_name_or_path):
        raise UserInputError(f"{model_name_or_path}: no config.json there; pass a model folder "
                             "or a config.json file")
    try:
        return AutoConfig.from_pretrained(model_name_or_path)
    except (OSError, ValueError) as e:
        raise UserInputError(
            f"cannot load model {model_name_or_path!r} from the hub ({type(e).__name__}); "
            "download it and pass the local folder instead") from None


def load_tokenizer(model_name_or_path: str | None, *, add_eot_token: bool = False,
                   eot_token: str = "<|endoftext|>"):
    """The model's own tokenizer when its folder has one, else the bundled tokenizer.

    The pad token follows the family convention: families whose tokenizers ship none
    (llama, gpt2, gpt_neox) pad with eos, as upstream does.
    """
    source = model_name_or_path
    if source is None:
        source = str(bundled_tokenizer_path())
    elif _is_local(source):
        folder = Path(source) if Path(source).is_dir() else Path(source).parent
        if not any((folder / f).exists() for f in TOKENIZER_FILES):
            source = str(bundled_tokenizer_path())
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, fast_tokenizer=True)
    except (OSError, ValueError) as e:
        raise UserInputError(f"cannot load a tokenizer from {source!r} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]}); pass a local model folder") from None
    if add_eot_token and eot_token not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [eot_token]})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def apply_dropout(config, dropout: float | None) -> None:
    """Set every dropout key of the family to `dropout` (None keeps the model's own)."""
    if dropout is None:
        return
    for key in family_of(config).dropout_keys:
        if hasattr(config, key):
            setattr(config, key, dropout)


def padded_vocab_size(tokenizer_len: int, current: int) -> int:
    """Embedding rows: at least the tokenizer's size, rounded up to a multiple of 8."""
    return int(8 * math.ceil(max(tokenizer_len, current) / 8.0))


def create_hf_model(model_name_or_path: str, tokenizer, *, ds_config: dict | None = None,
                    dropout: float | None = None, seed: int = 1234,
                    model_class=AutoModelForCausalLM, attn_implementation: str = "sdpa") -> nn.Module:
    """A causal LM ready for `deepspeed.initialize`, with `attn_implementation`
    (dschat.utils.attention: "sdpa" gives Bloom our fused attention; "eager" HF's everywhere):
    saved weights in `ds_config`'s training dtype (`weights_dtype`), a random init in fp32.

    Under ZeRO-3 (`ds_config` stage 3) weights from a folder load partitioned; random init
    from a config happens outside `zero.Init` (transformers' OPT init indexes the padding
    row of a partitioned, empty weight there) and `deepspeed.initialize` partitions it.
    """
    from dschat.engine.config import hf_zero3_loading, weights_dtype

    config = load_config(model_name_or_path)
    apply_dropout(config, dropout)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.end_token_id = tokenizer.eos_token_id  # upstream's name, read by old checkpoints
    attn = hf_attn_kwargs(attn_implementation)
    folder = Path(model_name_or_path)
    if _config_file(model_name_or_path) is not None and not has_weights(folder):
        if folder.is_dir() and any((folder / f).exists() for f in SAVED_MODEL_FILES):
            raise UserInputError(
                f"{model_name_or_path}: a saved model folder without weights (no {' or '.join(WEIGHT_FILES)}); "
                "an incomplete copy? For a random init pass a config.json file instead")
        torch.manual_seed(seed)
        model = model_class.from_config(config, dtype=torch.float32, **attn)
        logger.info(f"random init of a {config.model_type} model from {model_name_or_path} (seed {seed})")
    else:
        from safetensors import SafetensorError
        try:
            with hf_zero3_loading(ds_config):
                model, info = model_class.from_pretrained(model_name_or_path, config=config,
                                                          dtype=weights_dtype(ds_config),
                                                          output_loading_info=True, **attn)
        except (OSError, ValueError, EOFError, SafetensorError) as e:
            # a truncated safetensors file raises SafetensorError ("invalid header length")
            raise UserInputError(f"cannot load weights from {model_name_or_path!r}: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
        _check_loaded_keys(info, model_name_or_path, config)
    model.config.pad_token_id = tokenizer.pad_token_id
    want = padded_vocab_size(len(tokenizer), model.get_input_embeddings().num_embeddings)
    if want != model.get_input_embeddings().num_embeddings:
        with hf_zero3_loading(ds_config):
            model.resize_token_embeddings(want)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    logger.info(f"{config.model_type} attention: {use_attention(model, attn_implementation)}")
    return model


def enable_activation_checkpointing(model: nn.Module, every_n_layers: int = 1) -> int:
    """HF activation checkpointing of `model` (a causal LM or the reward model), recomputing
    only every `every_n_layers`-th transformer block in backward (the first, then every N-th;
    transformers' own `every_n_layers` rule): the other blocks keep their activations, which
    costs their memory and saves their recomputation. Returns how many blocks recompute."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    if every_n_layers < 1:
        raise ValueError(f"every_n_layers must be >= 1, got {every_n_layers}")
    model.gradient_checkpointing_enable()
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for i, block in enumerate(blocks):
        block.gradient_checkpointing = i % every_n_layers == 0
    return sum(b.gradient_checkpointing for b in blocks)


# keywords under which a block is handed a KV cache: such calls run the block as HF wrote it
_CACHE_KWARGS = ("use_cache", "cache", "layer_past", "past_key_values", "past_key_value")


def _compiled_training_forward(block: nn.Module, *args, **kwargs):
    """A transformer block's forward: in training with gradients and no cache, its own forward
    compiled by torch.compile (inside HF's activation checkpointing, which stays eager and
    recomputes the compiled forward); anything else, the forward as HF wrote it."""
    if not (block.training and torch.is_grad_enabled()) or any(kwargs.get(k) for k in _CACHE_KWARGS):
        return type(block).forward(block, *args, **kwargs)
    if block.gradient_checkpointing:
        return block._gradient_checkpointing_func(partial(block._dschat_compiled, block, **kwargs), *args)
    return block._dschat_compiled(block, *args, **kwargs)


def compile_blocks(model: nn.Module) -> int:
    """torch.compile each transformer block of `model` (a causal LM or the reward model) for its
    training forwards and backwards: a block's elementwise work and norms fuse into fewer
    kernels launched with less host work than eager autograd's, where host time bounds a small
    model's training step on a GPU (benchmarks/RESULTS.md, table 11). One compiled function per
    block class, shapes dynamic, so the 24 blocks of a model and every sequence length share
    its graphs after the first step (which compiles: tens of seconds). Scoring and generation
    (no gradients) run the blocks eagerly. Needs the parameters whole in each block (ZeRO
    0-2): ZeRO-3's hooks gather them around calls inside the block. Returns how many blocks."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    compiled = {}
    for block in blocks:
        cls = type(block)
        if cls not in compiled:
            # the class's own forward, without the checkpointing wrapper transformers adds
            inner = getattr(cls.forward, "__wrapped__", cls.forward)
            compiled[cls] = torch.compile(inner, dynamic=True)
        block._dschat_compiled = compiled[cls]
        block.forward = types.MethodType(_compiled_training_forward, block)   # deep copies rebind it
    return len(blocks)


def build_lm_engine(args, tokenizer, ds_config: dict, num_update_steps: int):
    """The DeepSpeed engine of a trained causal LM from step 1's flags (--model_name_or_path,
    --dropout, LoRA, --gradient_checkpointing, optimizer and LR schedule): step 1's model and
    the DPO policy."""
    from dschat.models.lora import apply_lora

    model = create_hf_model(args.model_name_or_path, tokenizer, ds_config=ds_config,
                            dropout=args.dropout, seed=args.seed, attn_implementation=args.attn_implementation)
    model = apply_lora(model, args.lora_dim, args.lora_module_name, args.only_optimize_lora)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(model, args.checkpoint_every_n_layers)
        model.config.use_cache = False
    return train_engine(model, args, ds_config, num_update_steps)


def train_engine(model, args, ds_config: dict, num_update_steps: int):
    """`model` in a DeepSpeed training engine with the optimizer and LR schedule of steps 1-2's
    flags (--learning_rate, --weight_decay, --lora_learning_rate, --offload, --lr_scheduler_type,
    --num_warmup_steps, --zero3_hook_granularity)."""
    from dschat.engine.optim import build_lr_scheduler, build_optimizer
    from dschat.engine.zero import initialize_engine

    optimizer = build_optimizer(model, lr=args.learning_rate, weight_decay=args.weight_decay,
                                lora_lr=args.lora_learning_rate, offload=args.offload,
                                adam_kernel=args.adam_kernel, optimizer_dtype=args.optimizer_dtype)
    scheduler = build_lr_scheduler(optimizer, args.lr_scheduler_type, args.num_warmup_steps,
                                   num_update_steps)
    return initialize_engine(model, ds_config, args.zero3_hook_granularity, optimizer=optimizer,
                             lr_scheduler=scheduler, dist_init_required=True)


def _check_loaded_keys(info: dict, path: str, config) -> None:
    """transformers only warns when checkpoint keys do not fit the model and leaves the
    missing weights randomly initialised (e.g. OPT weights under a Bloom config); here
    that is an error naming a few of the keys."""
    missing = sorted(info.get("missing_keys") or [])
    if not missing:
        return
    unexpected = sorted(info.get("unexpected_keys") or [])
    raise UserInputError(
        f"{path}: its weights do not fit a {config.model_type} model (config.json): {len(missing)} weights "
        f"missing, e.g. {missing[:3]}; the file has {len(unexpected)} unexpected ones, e.g. {unexpected[:3]}. "
        "A checkpoint of another model family?")


def save_hf_format(model, tokenizer, output_dir: str | Path, *, rank: int = 0,
                   extra_files: dict[str, dict] | None = None) -> None:
    """Write `model` (a DeepSpeed engine or a module) as an HF model folder (config,
    safetensors, tokenizer, generation config).

    Works under every ZeRO stage: parameters are gathered one at a time (collective: every
    rank must call this), only rank 0 writes; pass the engine so that ZeRO-3 prefetches
    left in flight by an evaluation are settled first. LoRA is merged into the saved
    weights (the trained tensors stay as they are); tied weights are saved once and stay
    tied on load.
    """
    from dschat.engine.zero import engine_and_module, full_state_dict
    from dschat.models.lora import merged_state_dict

    state = full_state_dict(model, rank=rank)
    fault_point("hf_save", 1)
    _, module = engine_and_module(model)
    if rank != 0:
        return
    base = unwrap_peft(module)
    state = merged_state_dict(module, state)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    # A model with ZeRO-3-partitioned (empty) tensors cannot serialise itself: build a
    # plain copy of the architecture on the meta device and save the gathered weights.
    with torch.device("meta"):
        skeleton = type(base)(base.config)
    skeleton.load_state_dict(state, strict=False, assign=True)
    skeleton.tie_weights()
    skeleton.save_pretrained(output_dir, safe_serialization=True)
    save_tokenizer_and_config(base.config, tokenizer, output_dir,
                              getattr(base, "generation_config", None))
    for name, payload in (extra_files or {}).items():
        with open(output_dir / name, "w") as f:
            json.dump(payload, f, indent=2, sort_keys=True, default=str)


def save_tokenizer_and_config(config, tokenizer, output_dir: str | Path, generation_config=None) -> None:
    """The non-weight files of a model folder: config, tokenizer, generation config."""
    config.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    gen = generation_config or GenerationConfig.from_model_config(config)
    gen.save_pretrained(output_dir)
