"""Rank-0 metrics sinks: a JSONL file always, TensorBoard and wandb when asked for.

Keys are namespaced (`train/loss`, `eval/ppl`, `ppo/reward_mean`, `gen/answer_len`,
`time/generate_s`, `perf/tokens_per_s`). Values are expected to be reduced across ranks
already: only global rank 0 (env RANK) writes, every other rank's logger does nothing.
TensorBoard and wandb are imported only when enabled.
"""
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from dschat.utils.logging import global_rank

METRICS_FILE = "metrics.jsonl"


def _to_float(key: str, value: Any) -> float:
    """A metric value (python/numpy scalar, 0-d tensor) as float; TypeError naming the key."""
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise TypeError(f"metric {key!r}: value {value!r} is not a number") from err


class MetricsLogger:
    """Append metrics to ``output_dir/metrics.jsonl`` (+ TensorBoard / wandb) on rank 0.

    One JSON object per `log` call: ``{"step": int, "time": unix seconds, **metrics}``,
    flushed at once so a crashed run keeps everything logged before the crash. The file
    is appended to, so a resumed run continues the same file.

    wandb runs offline unless the user configured it (WANDB_MODE or WANDB_API_KEY set);
    its files go to WANDB_DIR if set, else ``output_dir``.
    """

    def __init__(self, output_dir, *, enable_tensorboard: bool = False,
                 tensorboard_path: Optional[str] = None, enable_wandb: bool = False,
                 wandb_project: str = "dschat", run_name: Optional[str] = None,
                 config: Optional[dict] = None):
        self.output_dir = Path(output_dir)
        self.enabled = global_rank() == 0
        self.path = self.output_dir / METRICS_FILE
        self._file = None
        self._tb = None
        self._wandb_run = None
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if enable_tensorboard:
            self._tb = self._open_tensorboard(tensorboard_path, config)
        if enable_wandb:
            self._wandb_run = self._open_wandb(wandb_project, run_name, config)

    def _open_tensorboard(self, tensorboard_path: Optional[str], config: Optional[dict]):
        from torch.utils.tensorboard import SummaryWriter  # optional dependency

        log_dir = Path(tensorboard_path) if tensorboard_path else self.output_dir / "tensorboard"
        writer = SummaryWriter(log_dir=str(log_dir))
        if config:
            writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
        return writer

    def _open_wandb(self, project: str, run_name: Optional[str], config: Optional[dict]):
        import wandb  # optional dependency

        user_configured = "WANDB_MODE" in os.environ or "WANDB_API_KEY" in os.environ
        # no network by default: a training run must never hang on a login prompt
        mode = None if user_configured else "offline"
        wandb_dir = os.environ.get("WANDB_DIR") or str(self.output_dir)
        Path(wandb_dir).mkdir(parents=True, exist_ok=True)
        return wandb.init(project=project, name=run_name, config=config, dir=wandb_dir, mode=mode)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` (name -> number) at ``step``; no-op off rank 0."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError("MetricsLogger.log called after close()")
        values: Dict[str, float] = {k: _to_float(k, v) for k, v in metrics.items()}
        record = {"step": int(step), "time": time.time(), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, global_step=int(step))
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=int(step))

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path) -> list:
    """Records of a metrics.jsonl file, in order; lines that are not JSON (a line torn by a crash) are skipped.

    The file is appended to, so a run restarted after a crash (from scratch, or resumed from a
    checkpoint older than its last logged step) logs some steps again: where the step counter
    goes back, the records of the earlier attempt from that step on are dropped."""
    records = []
    last = None
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and isinstance(last, int) and step < last:
                records = [r for r in records if not (isinstance(r.get("step"), int) and r["step"] >= step)]
            if isinstance(step, int):
                last = step
            records.append(record)
    return records


def metrics_logger_for(args, config: dict) -> "MetricsLogger":
    """The logger of an entry point, from its logging flags (see dschat/cli/flags.add_logging_args);
    a relative --tensorboard_path lives under --output_dir."""
    from dschat.utils.run import resolve_under
    tb_path = resolve_under(args.output_dir, args.tensorboard_path)
    return MetricsLogger(args.output_dir, enable_tensorboard=args.enable_tensorboard, tensorboard_path=tb_path,
                         enable_wandb=args.enable_wandb, wandb_project=args.wandb_project, config=config)
