#!/bin/bash
# Fill a folder (default .whl-trl/ in the current repo root) with the Python 3.12 x86-64 wheels
# the GPU machine lacks to import TRL's GRPOTrainer for benchmarks/grpo_vs_trl.py: trl itself,
# datasets and the datasets dependencies the GPU image does not have (pyarrow, pandas, dill,
# multiprocess, xxhash, fsspec, python-dateutil, six). DeepSpeed comes from
# benchmarks/GPU_SETUP.md (.whl/). The GPU image already has torch, transformers,
# accelerate, safetensors, tokenizers, numpy, ninja, psutil, py-cpuinfo, msgpack, einops, tqdm,
# peft, and transformers' own dependencies (huggingface_hub, httpx, pyyaml, requests,
# packaging, filelock, regex), and jinja2 (torch's).
#
#   bash benchmarks/trl_wheels.sh [DIR]          # once, in the project root
#   ARROW_IN_IMAGE=1 bash benchmarks/trl_wheels.sh   # leave out pyarrow/pandas/python-dateutil/six
#                                                # (~52 MiB) for an image that has them
#   then on the device: carry [".whl", ".whl-trl"] and start the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && \
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/trl/site-packages .whl-trl/*.whl && \
#   export PYTHONPATH=$PWD:/tmp/site:/tmp/trl/site-packages TORCH_CUDA_ARCH_LIST=9.0 || exit 1
# The TRL wheels' folder must be named site-packages: datasets fingerprints an in-memory
# Dataset with dill, which pickles the functions of modules outside sys.prefix and outside any
# "site-packages" path by value, and fails on pyarrow's ("Can't pickle <class 'MonthDayNano'>");
# benchmarks/trl_grpo_runner.py stops with that advice when pyarrow lies elsewhere.
#
# The pins are the versions benchmarks/grpo_vs_trl.py was tested with (CPU, Python 3.11 wheels
# of the same versions). datasets 5.0.1 rather than 5.1+: those need pyarrow >= 24, whose wheel
# alone is 47+ MiB; pyarrow 21.0.0 is the oldest TRL 1.16 accepts (41 MiB). datasets declares
# fsspec[http] (aiohttp) but imports aiohttp lazily and runs without it, so aiohttp is left out.
# The folder must stay under ~55 MiB: one device call carries 64 MiB in all.
#
# Afterwards the script checks the folder is complete: every requirement reachable from trl
# (markers for Python 3.12 on Linux x86-64, extras followed) is a wheel in the folder of an
# accepted version, or a package of the GPU image; and, when a python3.12 is found (PY312=...),
# installs the wheels into a throwaway venv and runs `pip check` there, with the same allowance.
set -euo pipefail
DIR=${1:-.whl-trl}
TRL_VERSION=${TRL_VERSION:-1.16.0}
LIMIT_MIB=${LIMIT_MIB:-55}
mkdir -p "$DIR"
if [ -d .git ]; then
  grep -qx "/${DIR#./}/" .git/info/exclude 2>/dev/null || echo "/${DIR#./}/" >> .git/info/exclude
fi
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
PINS="trl==${TRL_VERSION} datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.4.0"
ARROW="pyarrow==21.0.0 pandas==3.1.1 python-dateutil==2.9.0.post0 six==1.17.0"
IMAGE="torch transformers accelerate safetensors tokenizers numpy ninja psutil py-cpuinfo msgpack einops tqdm peft \
  huggingface-hub httpx pyyaml requests packaging filelock regex jinja2 typing-extensions"
if [ "${ARROW_IN_IMAGE:-0}" = 1 ]; then
  IMAGE="$IMAGE pyarrow pandas python-dateutil six"
  rm -f "$DIR"/pyarrow-*.whl "$DIR"/pandas-*.whl "$DIR"/python_dateutil-*.whl "$DIR"/six-*.whl
else
  PINS="$PINS $ARROW"
fi
# shellcheck disable=SC2086
python3 -m pip download -q $P -d "$DIR" $PINS
ls -la "$DIR"
python3 - "$DIR" "$LIMIT_MIB" "$IMAGE" <<'EOF'
"""Size and completeness of the wheel folder."""
import glob, os, re, sys, zipfile
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

folder, limit, image = sys.argv[1], float(sys.argv[2]), {canonicalize_name(n) for n in sys.argv[3].split()}
LAZY = {"aiohttp": "fsspec[http] / datasets: imported lazily, datasets runs without it"}
wheels = {}
for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
    name, version, _, _ = parse_wheel_filename(os.path.basename(path))
    with zipfile.ZipFile(path) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    wheels[canonicalize_name(name)] = (version, reqs, os.path.getsize(path))
total = sum(w[2] for w in wheels.values()) / 2 ** 20
print(f"{len(wheels)} wheels, {total:.2f} MiB in {folder} (limit {limit:g} MiB)")
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython"}
problems, from_image, seen = [], set(), set()
todo = [("trl", frozenset(), "root")]
while todo:
    name, extras, why = todo.pop()
    name = canonicalize_name(name)
    if (name, extras) in seen:
        continue
    seen.add((name, extras))
    if name in image:
        from_image.add(name)
        continue
    if name not in wheels:
        if name in LAZY:
            print(f"left out: {name} ({LAZY[name]}; wanted by {why})")
        else:
            problems.append(f"missing: {name} (wanted by {why})")
        continue
    version, reqs, _ = wheels[name]
    for req in reqs:
        if req.marker is not None and not any(req.marker.evaluate(dict(env, extra=e)) for e in ("", *extras)):
            continue
        dep = canonicalize_name(req.name)
        if dep in wheels and req.specifier and not req.specifier.contains(wheels[dep][0], prereleases=True):
            problems.append(f"version: {name} needs {req}, the folder has {dep} {wheels[dep][0]}")
        todo.append((dep, frozenset(req.extras), f"{name} {version}"))
unused = sorted(set(wheels) - {n for n, _ in seen})
print("from the GPU image:", " ".join(sorted(from_image)))
if unused:
    problems.append(f"not reachable from trl: {' '.join(unused)}")
if total > limit:
    problems.append(f"{total:.2f} MiB is over the {limit:g} MiB limit")
for p in problems:
    print(p)
sys.exit(1 if problems else 0)
EOF
# pip's own view, when a Python 3.12 is at hand
PY312=${PY312:-python3.12}
if "$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  VENV=$(mktemp -d)
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile "$DIR"/*.whl
  # pip check names each missing requirement as "X requires Y, which is not installed."
  MISSING=$("$VENV/bin/python" -m pip check 2>&1 | sed -n 's/.* requires \([A-Za-z0-9_.-]*\).*not installed.*/\1/p' \
    | tr 'A-Z_.' 'a-z--' | sort -u || true)
  rm -rf "$VENV"
  BAD=""
  for m in $MISSING; do
    case " $(echo "$IMAGE" | tr 'A-Z_.' 'a-z--') aiohttp " in *" $m "*) ;; *) BAD="$BAD $m" ;; esac
  done
  echo "pip check in a Python 3.12 venv: not installed there:" $MISSING
  [ -z "$BAD" ] || { echo "missing and not in the GPU image:$BAD"; exit 1; }
  echo "pip check: nothing missing beyond the GPU image's packages (and aiohttp, imported lazily)"
else
  echo "no python3.12 here (set PY312=/path/to/python3.12): skipped the venv pip check"
fi
