"""Per phase of a profiled step: wall time against the GPU time of the kernels it launched.

Reads the `step_<N>.trace.json` that `--profile_step N` writes (torch.profiler's Chrome
trace). Each `dschat/...` range of the trainer is a phase; the kernels of a phase are those
whose launch (a CUDA runtime call, matched by correlation id) lies inside it. A phase whose
kernel time is well below its wall time is bound by the host (Python, hooks, launches), not
by the GPU:

    python benchmarks/trace_phases.py OUT/profile/step_4.trace.json [--top 8]

prints one row per phase: wall ms, kernel ms (the union of its kernels' intervals), their
ratio, and the phase's largest kernels and host ops.
"""
from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals in microseconds, as ms."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def analyse(events: list[dict], top: int = 6) -> list[dict]:
    # the host's ranges ("gpu_user_annotation" events repeat them on the GPU's timeline)
    phases = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and str(e.get("name", "")).startswith("dschat/")]
    # runtime and driver launches (Triton's kernels go through the driver API)
    launches = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in (e.get("args") or {})]
    kernels = {e["args"]["correlation"]: e for e in events
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and "correlation" in (e.get("args") or {})}
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"
                  and not str(e.get("name", "")).startswith("dschat/")), key=lambda e: e["ts"])
    op_starts = [e["ts"] for e in ops]
    launches.sort(key=lambda e: e["ts"])
    starts = [e["ts"] for e in launches]
    rows = []
    for ph in sorted(phases, key=lambda e: e["ts"]):
        t0, t1 = ph["ts"], ph["ts"] + ph["dur"]
        inside = launches[bisect.bisect_left(starts, t0):bisect.bisect_right(starts, t1)]
        ks = [kernels[c] for c in (e["args"]["correlation"] for e in inside) if c in kernels]
        by_name = defaultdict(float)
        for k in ks:
            by_name[k["name"][:70]] += k["dur"] / 1e3
        # host ops directly under the phase: top level cpu_ops (not nested in another op)
        host = defaultdict(float)
        end = float("-inf")
        for op in ops[bisect.bisect_left(op_starts, t0):bisect.bisect_right(op_starts, t1)]:
            if op["ts"] >= end:
                host[op["name"][:70]] += op["dur"] / 1e3
                end = op["ts"] + op["dur"]
        gpu = union_ms([(k["ts"], k["ts"] + k["dur"]) for k in ks])
        span = (max(k["ts"] + k["dur"] for k in ks) - t0) / 1e3 if ks else 0.0
        rows.append({"phase": ph["name"], "wall_ms": ph["dur"] / 1e3, "kernel_ms": gpu,
                     "launches": len(inside), "kernels": len(ks), "until_last_kernel_ms": span,
                     "top_kernels": sorted(by_name.items(), key=lambda kv: -kv[1])[:top],
                     "top_host_ops": sorted(host.items(), key=lambda kv: -kv[1])[:top]})
    return rows


def report(trace_path: str, top: int = 6) -> str:
    """The phase table and each phase's largest kernels and host ops, as markdown text."""
    with open(trace_path) as f:
        data = json.load(f)
    rows = analyse(data["traceEvents"] if isinstance(data, dict) else data, top)
    lines = ["| phase | wall ms | kernel ms | kernel / wall | launches | wall to last kernel ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["kernel_ms"] / r["wall_ms"] if r["wall_ms"] else 0.0
        lines.append(f"| {r['phase']} | {r['wall_ms']:.1f} | {r['kernel_ms']:.1f} | {ratio:.2f} | {r['launches']} "
                     f"| {r['until_last_kernel_ms']:.1f} |")
    for r in rows:
        lines += ["", f"{r['phase']} ({r['wall_ms']:.1f} ms wall, {r['kernel_ms']:.1f} ms kernels)",
                  "  kernels: " + "; ".join(f"{n} {ms:.2f}" for n, ms in r["top_kernels"]),
                  "  host ops: " + "; ".join(f"{n} {ms:.2f}" for n, ms in r["top_host_ops"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="step_<N>.trace.json written by --profile_step")
    p.add_argument("--top", type=int, default=6, help="largest kernels and host ops listed per phase")
    args = p.parse_args(argv)
    print(report(args.trace, args.top), end="")


if __name__ == "__main__":
    main()
