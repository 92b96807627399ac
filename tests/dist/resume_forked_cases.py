"""Run many single-process entry-point invocations quickly: import once, fork per case.

    python tests/dist/resume_forked_cases.py --cases cases.json --out results.json

cases.json: [{"step": 1, "argv": [...]}, ...]. Each case runs in a forked child exactly as
`python main.py argv` would (its own process, `main_guard`, its own stdout/stderr files
and exit code, a fresh MASTER_PORT), after the parent imported torch, transformers,
DeepSpeed and the three entry points once. An exception escaping `main_guard` prints its
traceback to the child's stderr and exits 1, as the interpreter would.
"""
import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from resume_driver import load_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(main, argv: list[str], log_dir: Path, timeout: float) -> dict:
    from dschat.utils.run import main_guard

    out, err = log_dir / "stdout", log_dir / "stderr"
    port = _free_port()
    pid = os.fork()
    if pid == 0:  # child: behave like `python main.py argv`
        code = 1
        try:
            with open(out, "w") as o, open(err, "w") as e:
                os.dup2(o.fileno(), 1)
                os.dup2(e.fileno(), 2)
                os.environ.update(MASTER_PORT=str(port))
                os.environ.pop("RANK", None)
                sys.argv = ["main.py", *argv]
                try:
                    main_guard(lambda: main(argv))
                    code = 0
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                except BaseException:  # noqa: BLE001 - what the interpreter would print
                    traceback.print_exc()
                    code = 1
                sys.stdout.flush()
                sys.stderr.flush()
        finally:
            os._exit(code)
    deadline = time.time() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.time() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return {"rc": None, "stdout": out.read_text(), "stderr": err.read_text() + "\n[timed out]"}
        time.sleep(0.05)
    return {"rc": os.waitstatus_to_exitcode(status), "stdout": out.read_text(), "stderr": err.read_text()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    cases = json.loads(Path(args.cases).read_text())
    mains = {step: load_main(step) for step in sorted({c["step"] for c in cases})}
    import deepspeed  # noqa: F401 - imported once here, not in every child
    results = []
    for i, case in enumerate(cases):
        log_dir = Path(args.out).parent / f"case_{i:02d}"
        log_dir.mkdir(parents=True, exist_ok=True)
        start = time.time()
        results.append({**run_case(mains[case["step"]], case["argv"], log_dir, args.timeout),
                        "seconds": time.time() - start})
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
