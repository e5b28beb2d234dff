#!/usr/bin/env bash
# Run ON the lent GPU machine (after the stash calls), through scripts/gpu_device_run.sh:
#
#   BEFORE_TREE=DIR ORDER=before,after BG_WAIT_S=570 \
#       bash scripts/gpu_device_run.sh bg ab bash scripts/gpu_ab_swap_cost.sh BEFORE AFTER
#
# An A/B of the rank-64 swap cost on one machine: the tree in BEFORE_TREE (made
# here with `git archive BEFORE server skyrl_lora client benchmarks scripts
# examples pyproject.toml README.md | tar -x -C DIR`, carried with the call) at
# commit BEFORE, and this tree at commit AFTER, one server each, the same built
# model, in ORDER. py-spy (PYSPY_WHEEL, carried) samples each engine twice: all
# threads with --idle, and only the GIL's holder with --gil. GPU_TEST: a
# gpu_tests file to run first. Each side leaves its JSON and a summary
# (staging phases, the syncs' timelines, the py-spy trees) in $OUT.
set -u
before="$1"; after="$2"
export PYTHONUNBUFFERED=1
keep="$HOME/keep"; mkdir -p "$keep"
work="$HOME/scale-work"
root="$(pwd)"
one() {  # NAME DIR COMMIT
  local name="$1" dir="$2" commit="$3"
  echo "== $name ($commit) $(date +%T)"
  mkdir -p "$keep/$name"
  bash "$root/scripts/gpu_spy_engine.sh" "$keep/$name.txt" "$keep/$name" &
  (cd "$dir" && SKYRL_COMMIT="$commit" OUT="$keep/$name" timeout 900 bash "$SITE_RUN" run \
      python3 -m benchmarks.scale --parts swap_cost --ranks 64 --work "$work" --commit "$commit" \
      --json "$keep/$name/scale.json") > "$keep/$name.txt" 2>&1
  echo "$name rc $?"; sleep 3
  cp "$keep/$name/scale.json" "$OUT/scale_$name.json"
  {
    echo "== staging events"; python3 "$root/scripts/probes/staging_events.py" "$keep/$name/scale_server.log"
    echo; python3 "$root/scripts/probes/sync_timeline.py" "$keep/$name/scale_server.log"
    for kind in idle gil; do
      [[ -f "$keep/$name.$kind.raw" ]] || continue
      echo; echo "== py-spy engine ($kind) under _timed_load"
      python3 "$root/scripts/probes/pyspy_stacks.py" "$keep/$name.$kind.raw" _timed_load --depth 6
    done
  } > "$OUT/summary_$name.txt" 2>&1
  grep -E "^\| (idle|under_load)" "$keep/$name.txt" | tail -n 10
}
if [[ -n "${GPU_TEST:-}" ]]; then
  (bash "$SITE_RUN" test "$GPU_TEST") > "$OUT/gpu_test.txt" 2>&1; echo "gpu test rc $?"; tail -n 3 "$OUT/gpu_test.txt"
fi
for side in $(echo "${ORDER:-before,after}" | tr , ' '); do
  if [[ "$side" == before ]]; then one before "${BEFORE_TREE:?}" "$before"; else one after "$root" "$after"; fi
done
tar czf "$OUT/raw.tgz" -C "$keep" before/scale_server.log after/scale_server.log before.txt after.txt 2>/dev/null
echo "== done $(date +%T)"
