"""Resumable checkpoints for the three steps, and the non-finite update guard.

Layout under `--output_dir` (the final HF model at its root is written separately):

    checkpoints/
      step_00000010/              a complete checkpoint: it has COMPLETE (written last)
        COMPLETE                  {"step", "world_size", "time"}
        state.json                counters, data position, resolved configuration
        rng/rank_00000.pt         python / numpy / torch (/ cuda) RNG + named generators, per rank
        actor/ds/...              `engine.save_checkpoint` of each trained engine (ZeRO shards per rank)
        ema/rank_00000.pt         per-rank parameter shards of untrained modules (the EMA)
      .tmp-step_00000012/         being written, or left by a crash: never loaded, removed

Writing is atomic: every rank writes into the temp folder, a barrier, then rank 0 writes
COMPLETE and renames the folder; a folder without COMPLETE is never loaded. The folder
must be on a file system every rank sees (as DeepSpeed's own checkpoints assume).

Resuming needs the same world size (ZeRO shards are per rank). Test-only fault hooks:
DSCHAT_TEST_KILL_AT="step:5" or "save:2" makes rank DSCHAT_TEST_KILL_RANK (default 1)
SIGKILL itself after step 5 / inside its 2nd save (engine states written, no marker yet);
DSCHAT_TEST_NONFINITE="3,4" makes that rank see a NaN loss at those update steps
(DSCHAT_TEST_NONFINITE_NAME picks one check: "loss", "reward", "actor_loss", "critic_loss");
DSCHAT_TEST_FAIL_AT="hf_save:1" makes that rank raise OSError at the point instead of dying
(the writing of the first final model folder); DSCHAT_TEST_KILL_RANK="all" picks every rank.
"""
from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from dschat.utils import dist
from dschat.utils.errors import FinalSaveFailed, TrainingHalted, UserInputError, brief
from dschat.utils.logging import get_logger, print_rank_0
from dschat.utils.run import save_json

logger = get_logger(__name__)

CHECKPOINT_DIR = "checkpoints"
MARKER = "COMPLETE"
STATE_FILE = "state.json"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
DS_TAG = "ds"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- discovery
def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(PREFIX):
        return None
    try:
        return int(name[len(PREFIX):])
    except ValueError:
        return None


def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / MARKER).is_file() and (path / STATE_FILE).is_file()


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := _step_of(p)) is not None and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `output_dir/checkpoints/`, or None."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def incomplete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Temp folders and step folders without their marker (a crash mid-save)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (
        p.name.startswith(TMP_PREFIX) or _step_of(p) is not None and not is_complete(p)))


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete what `incomplete_checkpoints` lists (rank 0 only); returns what went."""
    gone = incomplete_checkpoints(output_dir)
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def prune(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all)."""
    if keep_last <= 0:
        return []
    old = complete_checkpoints(output_dir)[:-keep_last]
    for path in old:
        # drop the marker first: a half-deleted folder must never look complete
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return old


# ------------------------------------------------------------------------------ RNG
def rng_state(generators: dict[str, torch.Generator] | None = None) -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "generators": {k: g.get_state() for k, g in (generators or {}).items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generators: dict[str, torch.Generator] | None = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, gen in (generators or {}).items():
        if name in state["generators"]:
            gen.set_state(state["generators"][name])


# ----------------------------------------------------------------- module shards (EMA)
def module_shards(module: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """This rank's part of `module`'s parameters: its ZeRO-3 partition of each
    partitioned parameter, and (rank 0 only) every parameter that is not partitioned."""
    out = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_tensor"):
            out[name] = p.ds_tensor.detach().to("cpu", copy=True)
        elif rank == 0:
            out[name] = p.detach().to("cpu", copy=True)
    return out


@torch.no_grad()
def load_module_shards(module: torch.nn.Module, own: dict, rank0: dict, where: Path) -> None:
    """Inverse of `module_shards`: partitions from this rank's file, full tensors from rank 0's."""
    for name, p in module.named_parameters():
        if hasattr(p, "ds_tensor"):
            src, dst = own.get(name), p.ds_tensor
        else:
            src, dst = rank0.get(name), p
        if src is None or src.shape != dst.shape:
            raise UserInputError(f"checkpoint {where}: parameter {name} is missing or has shape "
                                 f"{None if src is None else tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.data.copy_(src.to(dst.device, dst.dtype))


# ------------------------------------------------------------------------- data position
class _SkipSampler(Sampler):
    """The first `skip` indices of `base` left out (the sampler is seeded per epoch)."""

    def __init__(self, base: Sampler, skip: int):
        self.base, self.skip = base, skip

    def __iter__(self):
        return itertools.islice(iter(self.base), self.skip, None)

    def __len__(self):
        return max(len(self.base) - self.skip, 0)


def skip_batches(loader: DataLoader, batches: int) -> DataLoader:
    """`loader` without its first `batches` batches of the current epoch, skipped by
    index (nothing is loaded or collated for them). Call after `sampler.set_epoch`."""
    if batches <= 0:
        return loader
    return DataLoader(loader.dataset, batch_size=loader.batch_size,
                      sampler=_SkipSampler(loader.sampler, batches * loader.batch_size),
                      collate_fn=loader.collate_fn, drop_last=loader.drop_last,
                      num_workers=loader.num_workers, generator=loader.generator)


# ----------------------------------------------------------------------- test fault hooks
def _kill_spec(variable: str = "DSCHAT_TEST_KILL_AT") -> tuple[str, int] | None:
    spec = os.environ.get(variable, "")
    if ":" not in spec:
        return None
    kind, _, n = spec.partition(":")
    return kind, int(n)


def _fault_rank() -> int:
    return int(os.environ.get("DSCHAT_TEST_KILL_RANK", "1"))


def fault_point(kind: str, n: int) -> None:
    """SIGKILL this process at the point DSCHAT_TEST_KILL_AT names, or raise OSError at the
    one DSCHAT_TEST_FAIL_AT names (tests only), on rank DSCHAT_TEST_KILL_RANK ("all": every rank)."""
    if os.environ.get("DSCHAT_TEST_KILL_RANK") != "all" and dist.get_rank() != _fault_rank():
        return
    if _kill_spec() == (kind, n):
        print(f"[rank{dist.get_rank()}] DSCHAT_TEST_KILL_AT={kind}:{n}: SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if _kill_spec("DSCHAT_TEST_FAIL_AT") == (kind, n):
        raise OSError(f"DSCHAT_TEST_FAIL_AT={kind}:{n}: injected failure")


def _forced_nonfinite(name: str, step: int, micro: int | None) -> bool:
    """DSCHAT_TEST_NONFINITE="3,5.1": a NaN at step 3 (any micro-batch) and at micro-batch 1
    of step 5, seen by rank DSCHAT_TEST_KILL_RANK only; DSCHAT_TEST_NONFINITE_NAME="critic_loss"
    limits it to that check (tests only)."""
    wanted = os.environ.get("DSCHAT_TEST_NONFINITE", "")
    if not wanted or dist.get_rank() != _fault_rank() % dist.get_world_size():
        return False
    if os.environ.get("DSCHAT_TEST_NONFINITE_NAME", name) != name:
        return False
    wanted = wanted.split(",")
    return str(step) in wanted or micro is not None and f"{step}.{micro}" in wanted


# --------------------------------------------------------------------------- checkpointer
@dataclass
class Resumed:
    """What a loaded checkpoint says about where to continue."""
    path: Path
    step: int
    state: dict                      # state.json (position, counters, config)

    @property
    def position(self) -> tuple[int, int, int]:
        """(optimizer step, epoch, batches consumed in that epoch) to continue from."""
        return self.step, self.state["epoch"], self.state["batches_in_epoch"]


@dataclass
class Checkpointer:
    """Saves and loads everything a step needs to continue exactly.

    engines: trained DeepSpeed engines by name (saved with `save_checkpoint`);
    modules: untrained modules whose weights still change (the EMA), saved as shards;
    generators: extra RNGs (the hybrid actor's sampling generator).
    """
    output_dir: str
    save_interval: int = 0
    keep_last: int = 0
    engines: dict = field(default_factory=dict)
    modules: dict = field(default_factory=dict)
    generators: dict = field(default_factory=dict)
    saves: int = 0
    last_saved_step: int = 0

    def due(self, step: int) -> bool:
        """A multiple of --save_interval was reached since the last save (step 3 saves only
        where its experience buffer is empty, so it may come a little later)."""
        return self.save_interval > 0 and step // self.save_interval > self.last_saved_step // self.save_interval

    def save(self, step: int, state: dict) -> Path:
        """Write checkpoint `step` atomically (a collective: every rank calls it)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        root = checkpoint_root(self.output_dir)
        final = root / checkpoint_name(step)
        tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}"
        start = time.time()
        self.saves += 1
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        for name, engine in self.engines.items():
            engine.save_checkpoint(str(tmp / name), tag=DS_TAG, save_latest=False)
        for name, module in self.modules.items():
            (tmp / name).mkdir(exist_ok=True)
            torch.save(module_shards(module, rank), tmp / name / f"rank_{rank:05d}.pt")
        torch.save(rng_state(self.generators), tmp / "rng" / f"rank_{rank:05d}.pt")
        if rank == 0:
            save_json({"format": FORMAT_VERSION, "step": step, "world_size": world, **state},
                      tmp / STATE_FILE)
        fault_point("save", self.saves)
        dist.barrier()  # every rank's files are written: only now may the marker appear
        if rank == 0:
            save_json({"step": step, "world_size": world, "time": time.time()}, tmp / MARKER)
            if final.exists():  # a re-save of the same step (e.g. the halt checkpoint)
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in prune(self.output_dir, self.keep_last):
                print_rank_0(f"removed old checkpoint {old}")
        dist.barrier()
        self.last_saved_step = step
        print_rank_0(f"saved checkpoint {final} ({time.time() - start:.1f}s)")
        return final

    def save_final(self, write_models, save, where: str, host_bytes_needed: int = 0) -> None:
        """Write the run's final models with `write_models()` (a collective) without risking
        the run: if it fails on any rank, the trained state is saved first with `save()` (a
        complete checkpoint), then `FinalSaveFailed` says in one line how to get the models
        from it (rerun with --resume: a run resumed at its last step only writes them).

        A process the host kills for memory cannot save anything, so when rank 0 (which
        gathers the weights) has less host memory available than `host_bytes_needed`, the
        checkpoint is written before the models are; if that checkpoint fails on every rank
        (a full disk), the models are still written.

        Every rank must reach the agreement after `write_models`, so a failure is caught
        wherever it happens on a rank; one inside a collective that another rank never
        joins would still hang (DeepSpeed's own timeouts apply).
        """
        path = None
        available = dist.broadcast_object(dist.host_available_bytes() if dist.get_rank() == 0 else None)
        if available is not None and available < host_bytes_needed:
            need = (f"the final save needs about {host_bytes_needed / 2 ** 30:.1f} GiB of host memory on rank 0 "
                    f"and {available / 2 ** 30:.1f} GiB are available")
            try:
                path = save()
                print_rank_0(f"{need}: the trained state is saved in {path} first (if the save is killed, rerun "
                             "the same command with --resume to write the model from it)")
            except Exception as e:  # e.g. a full disk: the models may still fit; try them rather than stop here
                logger.exception(f"rank {dist.get_rank()}: the checkpoint before the final save failed")
                print_rank_0(f"{need}, and the checkpoint meant to come first failed ({brief(e)}): "
                             "writing the models anyway")
        error = None
        try:
            write_models()
        except Exception as e:  # whatever failed, the trained state must not be lost
            logger.exception(f"rank {dist.get_rank()}: writing the final models to {where} failed")
            error = brief(e)
        failed = [(r, e) for r, e in enumerate(dist.all_gather_object(error)) if e is not None]
        if not failed:
            return
        path = path or save()
        rank, message = failed[0]
        raise FinalSaveFailed(
            f"writing the final model to {where} failed on rank {rank} ({message}); the trained state "
            f"is saved in {path}: rerun the same command with --resume to write the model from it")

    def find(self, resume: bool) -> Path | None:
        """Clean incomplete checkpoints (rank 0); with --resume, agree on the newest complete
        one. None (logged) when there is none: a fresh start."""
        path = None
        if dist.get_rank() == 0:
            for gone in remove_incomplete(self.output_dir):
                print_rank_0(f"removed incomplete checkpoint {gone} (no {MARKER} marker)")
            path = latest_checkpoint(self.output_dir) if resume else None
            if resume and path is None:
                print_rank_0(f"--resume: no complete checkpoint under {checkpoint_root(self.output_dir)}; "
                             "starting from scratch")
        path = dist.broadcast_object(None if path is None else str(path))
        return None if path is None else Path(path)

    def resume_or_start(self, resume: bool, config: dict, guard: "NonFiniteGuard") -> Resumed | None:
        """Load the newest complete checkpoint when `resume` finds one (its non-finite counters
        go back into `guard`); None for a fresh start. A collective."""
        path = self.find(resume)
        if path is None:
            return None
        resumed = self.load(path, config)
        guard.load_state(resumed.state["nonfinite"])
        return resumed

    def load(self, path: Path, config: dict | None = None) -> Resumed:
        """Restore every engine, module and RNG from checkpoint `path` (a collective).

        RNG states are returned in `Resumed.state["_rng"]` and must be applied with
        `restore_rng` once the data iterators of the resumed epoch exist.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        state = json.loads((path / STATE_FILE).read_text())
        if state.get("world_size") != world:
            raise UserInputError(f"--resume: checkpoint {path} was written by {state.get('world_size')} "
                                 f"ranks, this run has {world}; resume with the same number of ranks")
        for name, engine in self.engines.items():
            load_path, _ = engine.load_checkpoint(str(path / name), tag=DS_TAG, load_module_strict=True,
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
            if load_path is None:
                raise UserInputError(f"--resume: checkpoint {path} has no {name} engine state")
        for name, module in self.modules.items():
            own = torch.load(path / name / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=True)
            rank0 = own if rank == 0 else torch.load(path / name / "rank_00000.pt", map_location="cpu",
                                                     weights_only=True)
            load_module_shards(module, own, rank0, path)
        state["_rng"] = torch.load(path / "rng" / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
        self.last_saved_step = state["step"]
        _log_changed_args(path, state.get("config", {}), config or {})
        if rank == 0:
            truncate_metrics(self.output_dir, state["step"])
        dist.barrier()
        print_rank_0(f"resumed from {path} (step {state['step']})")
        return Resumed(path, state["step"], state)

    def restore_rng(self, resumed: Resumed | None) -> None:
        """Apply the checkpoint's RNG states (once; call after creating data iterators)."""
        if resumed is not None and "_rng" in resumed.state:
            set_rng_state(resumed.state.pop("_rng"), self.generators)


def _log_changed_args(path: Path, old: dict, new: dict) -> None:
    old_args, new_args = old.get("args", {}), new.get("args", {})
    changed = sorted(k for k in set(old_args) | set(new_args)
                     if k not in ("local_rank", "resume") and old_args.get(k) != new_args.get(k))
    if changed:
        print_rank_0(f"--resume: flags differ from checkpoint {path}: " + ", ".join(
            f"--{k} {old_args.get(k)!r} -> {new_args.get(k)!r}" for k in changed))


def truncate_metrics(output_dir: str | Path, step: int) -> None:
    """Drop metrics.jsonl records past `step` (logged after the checkpoint by the run that
    died), so the file reads as one run; torn lines go too."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(record.get("step", 0)) <= step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------ non-finite guard
class NonFiniteGuard:
    """Decides, identically on every rank, whether an update may happen.

    `ok(name, step, *tensors)` all-reduces "every tensor is finite on this rank"; when any
    rank sees a NaN or inf, every rank gets False and must skip that update's backward and
    step together (so ZeRO collectives stay matched). `max_in_a_row` skips of one kind in
    a row halt the run (`check_halt`).
    """

    def __init__(self, max_in_a_row: int, device):
        self.max_in_a_row = max_in_a_row
        self.device = device
        self.skipped = 0
        self.in_a_row: dict[str, int] = {}

    def ok(self, name: str, step: int, *tensors: torch.Tensor, micro: int | None = None) -> bool:
        # the test stays on the device up to one read of the reduced count: the host waits for
        # the GPU once per update, not once per tensor and again for the collective
        bad_here = torch.zeros(1, device=self.device)
        for t in tensors:
            bad_here += (~torch.isfinite(t.detach())).any().to(bad_here.device, torch.float32)
        if _forced_nonfinite(name, step, micro):
            bad_here += 1
        bad = int(dist.all_reduce_sum(bad_here.clamp(max=1)).item())
        if not bad:
            self.in_a_row[name] = 0
            return True
        self.skipped += 1
        self.in_a_row[name] = self.in_a_row.get(name, 0) + 1
        print_rank_0(f"WARNING step {step}: non-finite {name} on {bad} rank(s); update skipped "
                     f"({self.in_a_row[name]} in a row, {self.skipped} in total)")
        return False

    @property
    def halted(self) -> str | None:
        worst = max(self.in_a_row.items(), key=lambda kv: kv[1], default=(None, 0))
        return worst[0] if worst[1] >= self.max_in_a_row else None

    def check_halt(self, step: int, save) -> None:
        """After `max_in_a_row` skips in a row: `save()` the last good state, then raise."""
        name = self.halted
        if name is None:
            return
        path = save()
        raise TrainingHalted(
            f"step {step}: {self.in_a_row[name]} non-finite {name} values in a row "
            f"(--max_nonfinite_in_a_row {self.max_in_a_row}); stopped. The last good state is in "
            f"{path}; lower the learning rate or check the data, then rerun with --resume")

    def state(self) -> dict:
        return {"skipped": self.skipped, "in_a_row": dict(self.in_a_row)}

    def load_state(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.in_a_row = {k: int(v) for k, v in state.get("in_a_row", {}).items()}
