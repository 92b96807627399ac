#!/usr/bin/env bash
# Run several benchmarks/device_run.sh modes one after another in the background, detached from
# the calling shell (a remote call that must return before the runs end), and look in on them.
#   bash benchmarks/device_queue.sh start MODE [MODE ...]   # copies this checkout to /tmp/dq/tree first
#   bash benchmarks/device_queue.sh watch SECONDS [DEST]    # wait (ends early when the queue is done),
#                                                           # print progress, copy the results to DEST
# Each mode writes /tmp/dq/out/MODE.log and its tables (*.md) into /tmp/dq/out; a mode's failure
# is logged and the next one runs; benchmarks/step3.py's random models are removed after each.
# `watch` also keeps the last lines of each preset's step logs (/tmp/dq/out/preset_logs) and
# copies the tables, the progress and one archive of every log.
set -uo pipefail
Q=/tmp/dq
cmd=${1:-}; shift || true
if [ "$cmd" = start ]; then
  rm -rf $Q; mkdir -p $Q/tree $Q/out
  tar --exclude=./.git -cf - . | (cd $Q/tree && tar xf -)
  (cd $Q/tree && setsid nohup bash benchmarks/device_queue.sh run "$@" > $Q/out/queue.log 2>&1 < /dev/null &)
  echo "queued: $*"
elif [ "$cmd" = run ]; then
  log() { echo "[$(date +%T)] $*" >> $Q/out/progress.log; }
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $Q/out/progress.log 2>&1
  for mode in "$@"; do
    log "$mode start"
    DEVICE_RUN_TEE=0 ${DEVICE_RUN:-bash benchmarks/device_run.sh} "$mode" $Q/out > $Q/out/$mode.log 2>&1
    log "$mode done (rc $?)"
    # step3.py keeps its random models for reuse (40 GB after `largest`): a full disk failed the
    # next mode's build of DeepSpeed's CPU Adam, so each mode starts with them gone
    rm -rf "${STEP3_WORKDIR:-/tmp/dschat_step3_bench}"
    log "disk free: $(df -h /tmp | awk 'NR == 2 {print $4}')"
  done
  log "queue done"
elif [ "$cmd" = watch ]; then
  end=$(( $(date +%s) + ${1:-540} ))
  while [ "$(date +%s)" -lt $end ] && ! grep -q "queue done" $Q/out/progress.log 2>/dev/null; do sleep 10; done
  cat $Q/out/progress.log 2>/dev/null
  for f in $Q/out/*.log; do
    case $f in */progress.log|*/queue.log) continue;; esac
    echo "== $(basename $f)"; grep -v '^\s*$' "$f" | cut -c1-600 | tail -n ${WATCH_LINES:-25}
  done
  mkdir -p $Q/out/preset_logs
  for d in /tmp/dschat_presets/*/logs; do
    [ -d "$d" ] || continue
    for s in "$d"/step*.log; do tail -n 60 "$s" > "$Q/out/preset_logs/$(basename $(dirname $d))_$(basename $s)"; done
  done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null; df -h /tmp | tail -1
  dest=${2:-${OUT:-}}
  if [ -n "$dest" ]; then
    # the tables and the progress as files, every log in one archive (few files come back from a remote call)
    mkdir -p "$dest"; cp $Q/out/*.md $Q/out/progress.log "$dest"/ 2>/dev/null
    (cd $Q/out && tar czf "$dest/logs.tgz" --exclude='*.md' . 2>/dev/null)
  fi
else
  echo "usage: device_queue.sh start MODE... | watch SECONDS [DEST]" >&2; exit 2
fi
