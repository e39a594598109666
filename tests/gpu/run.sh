#!/usr/bin/env bash
# The GPU machine's one script: checks and times flare's CUDA path with a library built elsewhere (it builds
# nothing) and writes everything under $OUT (default: a new temp dir):
#   gpu-tests-<date>.json   summary: each stage's status, counts, seconds; device, commit, date, command
#   junit.xml               the pytest suite's results (tests stage)
#   run.log                 every stage's output, in order
#   gpu-fwd-bwd[-quick]-<date>.json and .png   (bench stage)     train-<date>.json   (train stage)
# At most 8 files, flat: what the GPU machine's tool hands back.
#
# Usage: tests/gpu/run.sh [STAGE ...]      stages, run in the order given (default: all, in this order):
#   tests     pytest tests/gpu                         TESTS_ARGS: more pytest arguments ("-k varlen", "-x")
#   sanitize  compute-sanitizer on tests/gpu/sanitize.py, one run per tool in SANITIZE_TOOLS (default
#             "memcheck racecheck"); SANITIZE_ARGS: more sanitizer arguments (e.g. "--kernel-name kns=flare")
#   bench     bench/gpu/bench_gpu.py --out $OUT, then its plot    BENCH_ARGS (e.g. "--quick")
#   decode    bench/gpu/bench_decode.py --out $OUT (gpu-decode-<date>-<sha>.json; not in the default list)
#             DECODE_ARGS (e.g. "--groups dense")
#   train     bench/gpu/train_llama.py --out $OUT                 TRAIN_ARGS (e.g. "--steps 10")
#   demo      the GPU demo, when it was built                     DEMO_ARGS (e.g. "--quick")
#   profile   Nsight Compute on flare's kernel and torch's FA2 kernel for one shape (bench/gpu/profile_target.py),
#             reports in run.log   PROFILE_ARGS (default "--pass bwd --headdim 128 --seqlen 8192"),
#             NCU_ARGS (default: launch stats, occupancy, speed of light, warp states, scheduler, instruction
#             and memory tables, source counters)
# Environment: FLARE_LIBRARY (default: build/cuda/src/libflare.so, else a libflare.so.* file there, else
#   python/flare/libflare.so); FLARE_DEMO (default build/cuda/tools/flare_demo: it finds libflare.so.0
#   through a link to FLARE_LIBRARY, so carrying the real files, not the build tree's symlinks, is enough);
#   FLARE_COMMIT (the commit to record where the tree has no .git); PYTHON (default python3);
#   RUN_BUDGET_S (default 570): every stage is cut to what is left of it, so that the run ends, summary
#   written, inside the GPU machine's 10-minute call; a stage with no time left is recorded as skipped.
# A stage that fails or times out is reported and the next one still runs; exit status 1 if any failed.
#
# On the GPU machine, one call each (the full suite alone takes a few minutes):
#   FLARE_COMMIT=<sha> tests/gpu/run.sh tests sanitize
#   FLARE_COMMIT=<sha> tests/gpu/run.sh bench
#   FLARE_COMMIT=<sha> tests/gpu/run.sh decode
#   FLARE_COMMIT=<sha> tests/gpu/run.sh train demo
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
REPO=$PWD

STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(tests sanitize bench train demo)
for s in "${STAGES[@]}"; do
  case $s in
    tests|sanitize|bench|decode|train|demo|profile) ;;
    *) echo "run.sh: unknown stage '$s' (tests sanitize bench decode train demo profile)" >&2; exit 2 ;;
  esac
done

OUT=${OUT:-$(mktemp -d /tmp/flare-gpu-run.XXXXXX)}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/flare-gpu-work.XXXXXX)  # per-stage logs for the summary; not handed back
LOG=$OUT/run.log
PY=${PYTHON:-python3}
START=$(date +%s)
DEADLINE=$(( START + ${RUN_BUDGET_S:-570} ))
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [[ -z ${FLARE_LIBRARY:-} ]]; then
  for candidate in build/cuda/src/libflare.so build/cuda/src/libflare.so.* python/flare/libflare.so; do
    if [[ -f $candidate ]]; then export FLARE_LIBRARY=$REPO/$candidate; break; fi
  done
fi
FLARE_DEMO=${FLARE_DEMO:-build/cuda/tools/flare_demo}

log() { echo "$*" | tee -a "$LOG"; }

# words VAR: the words of the environment variable VAR as the array WORDS, shell quoting respected
# (TESTS_ARGS="-k 'varlen and bf16'" is two words).
words() { eval "WORDS=(${!1:-})"; }

# stage NAME LIMIT_S COMMAND...: runs COMMAND with at most LIMIT_S seconds (less if the budget is short),
# its output into run.log and $WORK/NAME.log, and records NAME's status for the summary.
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$(( DEADLINE - $(date +%s) - 25 ))  # keep time for the summary
  if (( left < 30 )); then
    log "==== $name: skipped, no time left in RUN_BUDGET_S"
    printf '%s\tskipped\t\t0\t%s\n' "$name" "no time left in RUN_BUDGET_S" >>"$WORK/stages.tsv"
    return
  fi
  (( limit > left )) && limit=$left
  log ""
  log "==== $name ($(date +%T), limit ${limit} s): $*"
  local t0
  t0=$(date +%s)
  timeout -k 20 "$limit" "$@" 2>&1 | tee -a "$LOG" "$WORK/$name.log"
  local rc=${PIPESTATUS[0]}
  local status=passed
  if (( rc == 124 || rc == 137 )); then status=timeout; elif (( rc != 0 )); then status=failed; fi
  log "==== $name: $status (exit $rc, $(( $(date +%s) - t0 )) s)"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(( $(date +%s) - t0 ))" "$*" >>"$WORK/stages.tsv"
}

skip() {  # skip NAME WHY
  log "==== $1: skipped ($2)"
  printf '%s\tskipped\t\t0\t%s\n' "$1" "$2" >>"$WORK/stages.tsv"
}

log "flare GPU run: stages ${STAGES[*]}; OUT=$OUT; FLARE_LIBRARY=${FLARE_LIBRARY:-(not found)}; $(date -Is)"
stage preflight 120 "$PY" - <<'PY'
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
          f"{torch.cuda.device_count()} device(s), cuDNN {torch.backends.cudnn.version()}")
sys.path.insert(0, "python")
import flare
lib = flare.library()
print(f"libflare {lib.path}: version {lib.version()}, CUDA backend {lib.has_cuda()}")
sys.exit(0 if torch.cuda.is_available() and lib.has_cuda() else 1)
PY
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 | tee -a "$LOG"

for s in "${STAGES[@]}"; do
  case $s in
    tests)
      words TESTS_ARGS
      stage tests 480 "$PY" -m pytest tests/gpu -p no:cacheprovider -v -rfEs --durations=15 \
        --junitxml="$OUT/junit.xml" -o junit_family=xunit2 "${WORDS[@]}"
      ;;
    sanitize)
      sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
      for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
        [[ -z $sanitizer && -x $candidate ]] && sanitizer=$candidate
      done
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
        if [[ -z $sanitizer ]]; then
          stage "sanitize-$tool" 10 sh -c 'echo "compute-sanitizer not found (set COMPUTE_SANITIZER)"; exit 1'
          continue
        fi
        words SANITIZE_ARGS
        stage "sanitize-$tool" 300 "$sanitizer" --tool "$tool" --error-exitcode 97 --print-limit 30 \
          "${WORDS[@]}" "$PY" tests/gpu/sanitize.py
      done
      ;;
    bench)
      words BENCH_ARGS
      stage bench 540 "$PY" bench/gpu/bench_gpu.py --out "$OUT" "${WORDS[@]}"
      # shellcheck disable=SC2012  # our own file names
      result=$(ls -t "$OUT"/gpu-fwd-bwd*.json 2>/dev/null | head -1)
      if [[ -n $result ]]; then
        stage bench-plot 60 "$PY" bench/gpu/plot.py "$result"
      fi
      ;;
    decode)
      words DECODE_ARGS
      stage decode 400 "$PY" bench/gpu/bench_decode.py --out "$OUT" "${WORDS[@]}"
      ;;
    train)
      words TRAIN_ARGS
      stage train 480 "$PY" bench/gpu/train_llama.py --out "$OUT" "${WORDS[@]}"
      ;;
    profile)
      ncu=${NCU:-$(command -v ncu || true)}
      [[ -z $ncu && -x /usr/local/cuda/bin/ncu ]] && ncu=/usr/local/cuda/bin/ncu
      if [[ -z $ncu ]]; then
        skip profile "ncu not found (set NCU)"
        continue
      fi
      words PROFILE_ARGS
      (( ${#WORDS[@]} == 0 )) && WORDS=(--pass bwd --headdim 128 --seqlen 8192)
      profile_args=("${WORDS[@]}")
      kernels='backward_kernel|flash_bwd_dq_dk_dv'  # the main kernel of each pass, not its helpers
      [[ " ${profile_args[*]} " == *" --pass fwd "* ]] && kernels='forward_kernel|flash_fwd_kernel'
      words NCU_ARGS
      (( ${#WORDS[@]} == 0 )) && WORDS=(--section LaunchStats --section Occupancy --section SpeedOfLight
        --section WarpStateStats --section SchedulerStats --section InstructionStats
        --section MemoryWorkloadAnalysis_Tables --section SourceCounters)
      for impl in flare torch-flash; do
        stage "profile-$impl" 240 "$ncu" --launch-skip 1 --launch-count 1 \
          --kernel-name regex:"$kernels" "${WORDS[@]}" \
          "$PY" bench/gpu/profile_target.py --impl "$impl" "${profile_args[@]}"
      done
      ;;
    demo)
      if [[ -x $FLARE_DEMO && -n ${FLARE_LIBRARY:-} ]]; then
        # the demo links libflare.so.0 (its SONAME): point one at FLARE_LIBRARY, wherever that was carried
        mkdir -p "$WORK/lib" && ln -sf "$(realpath "$FLARE_LIBRARY")" "$WORK/lib/libflare.so.0"
        words DEMO_ARGS
        stage demo 240 env LD_LIBRARY_PATH="$WORK/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$FLARE_DEMO" \
          "${WORDS[@]}"
      else
        skip demo "$FLARE_DEMO or the library not found (cmake --preset cuda -DFLARE_BUILD_TOOLS=ON builds it)"
      fi
      ;;
  esac
done

"$PY" tests/gpu/summarize.py --out "$OUT" --work "$WORK" --command "tests/gpu/run.sh ${STAGES[*]}" \
  --started "$START" 2>&1 | tee -a "$LOG"
summary_rc=${PIPESTATUS[0]}

# The tool hands back files up to 16 MiB: keep the head and the tail of a longer log.
if [[ $(stat -c %s "$LOG") -gt 15000000 ]]; then
  { head -c 2000000 "$LOG"; printf '\n\n[... run.log cut to its head and tail ...]\n\n'; tail -c 12000000 "$LOG"; } \
    >"$WORK/run.log.cut" && mv "$WORK/run.log.cut" "$LOG"
fi
rm -rf "$WORK"
exit "$summary_rc"
