#!/usr/bin/env bash
# The GPU check (issue 20, item 5): what a machine with one NVIDIA GPU runs, from a fresh
# clone, in under 10 minutes:
#
#   1. set-up: `make setup` with the CUDA kernels required (ANCHORCACHE_BUILD_CUDA=1),
#      the extension compiled with every core;
#   2. the CUDA tests: the extension's operators on a CUDA cache (pinned host slabs), the
#      CUDA sources linked; a CUDA parameter that is skipped fails the check;
#   3. anchors on vs off on SGLang on the GPU: the tiny Qwen3 and SmolLM2 (the default
#      model), each at --page-size 1 and 16 (SGLang's default attention backend, or
#      GPU_CHECK_ATTENTION, e.g. flashinfer), a proxy with --anchors and one with
#      --no-anchors in front of one worker, every request from an empty device tree
#      (/flush_cache first, so a turn >= 2 on the anchors side is a restore from the host
#      tier): the replies must be equal token for token;
#   4. bench/sglang_replay.py on the GPU (tiny Qwen3; page size 1, then 16);
#   5. the copy benchmark (bench/ext_snapshot_cuda.py: snapshot D2H / restore H2D);
#   6. the stall benchmark (bench/sglang_stall.py, SmolLM2, 6,000-token anchors): streams'
#      inter-token latency with anchor copies under way, anchors on vs off;
#   7. a hybrid model on the GPU: bench/sglang_replay.py --model qwen3_5 (the tiny Gated
#      DeltaNet Qwen3.5 with SGLang's own GPU kernels, `no_buffer`): prefilled tokens vs the
#      ideal, outputs anchors on vs off, the cost of anchors at 4 at once; its anchors'
#      states captured by a second pass of each GDN layer's kernels (`/anchor/stats`
#      `captures`: all taken and written, or the step fails); then bench/
#      hybrid_concurrency.py at 8 conversations (captures vs prefill cuts vs SGLang
#      directly, both pool sizes, cold host tier);
#   8. a sliding-window model with attention sinks on the GPU: bench/sglang_replay.py
#      --model granite_swa (the tiny Granite SWA on SGLang's sliding-window pool, anchors
#      keeping the sliding layers' last window, and SGLang's own GPU attention with sinks):
#      prefilled tokens vs the ideal, outputs anchors on vs off;
#   9. the proxy alone on the machine's many cores: bench/proxy_cpu.py --processes 1,2
#      (requests/s against the instant worker; the load generator and the worker in
#      processes of their own), then its CPU per turn at 1k, 5k and 100k tokens, and
#      against a bare aiohttp relay of the same token stream (bench/relay_floor.py).
#
# JSON lands in $GPU_CHECK_OUT (default bench/results/gpu_check/): summary.json (each
# step: status, seconds, the command), equality.json, and the benchmarks' own files
# (sglang_replay_gpu_tiny_qwen3[_page16].json, ext_snapshot_cuda.json,
# sglang_stall_gpu_smollm2.json, sglang_replay_gpu_tiny_qwen3_5.json,
# hybrid_concurrency_gpu_tiny_qwen3_5.json, sglang_replay_gpu_granite_swa.json,
# proxy_processes_gpu_box.json, proxy_cpu_gpu_box.json, relay_floor_gpu_box.json in
# bench/results/).
#
#   bash bench/gpu_check.sh            # on the GPU machine, from the repository root
#   bash bench/gpu_check.sh --dry-run  # anywhere (DRY_RUN=1 too): every step's command in a
#                                      # cheap form (make -n, pytest --collect-only, the
#                                      # equality driver's plan, --help), nothing served
#   bash bench/gpu_check.sh --offline  # a GPU machine that reaches no package registry
#                                      # (GPU_CHECK_OFFLINE=1 too): set-up builds the
#                                      # extension in place against that machine's own torch
#                                      # (pip -e, no dependencies fetched) and the CUDA tests
#                                      # run without the suite's conftest (no ledger library
#                                      # needed); a step that needs SGLang where it cannot be
#                                      # imported is recorded as skipped, with the reason
#
# Knobs: MAX_JOBS (compile jobs, default nproc), GPU_CHECK_ATTENTION (SGLang's
# --attention-backend; default: SGLang's own choice), GPU_CHECK_CONVERSATIONS (default 3),
# GPU_CHECK_TURNS (default 3), PYTHON (to create the venv, default python3).
set -euo pipefail

DRY_RUN=${DRY_RUN:-0}
OFFLINE=${GPU_CHECK_OFFLINE:-0}
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --offline) OFFLINE=1 ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_check: unknown argument $arg" >&2; exit 2 ;;
    esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
OUT=${GPU_CHECK_OUT:-bench/results/gpu_check}
mkdir -p "$OUT"
PY=.venv/bin/python
NOCONFTEST=""
if [[ $OFFLINE == 1 ]]; then
    PY=${PYTHON:-python3}
    NOCONFTEST=--noconftest
fi
JOBS=${MAX_JOBS:-$(nproc)}
CONVS=${GPU_CHECK_CONVERSATIONS:-3}
TURNS=${GPU_CHECK_TURNS:-3}
ATTN=${GPU_CHECK_ATTENTION:-}
STEPS_JSON="$OUT/steps.jsonl"
: > "$STEPS_JSON"
FAILED=0
T0=$(date +%s)

log() { printf '[gpu_check %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

# step NAME CHEAP_COMMAND FULL_COMMAND: the full command, or in a dry run the cheap one.
# A failed step is recorded and the check goes on (a later step may still tell something);
# the exit status says whether any failed.
step() {
    local name=$1 cheap=$2 full=$3 cmd status start secs
    cmd=$full
    [[ $DRY_RUN == 1 ]] && cmd=$cheap
    log "$name: $cmd"
    start=$(date +%s)
    if bash -c "set -euo pipefail; $cmd"; then status=ok; else status=failed; FAILED=1; fi
    secs=$(( $(date +%s) - start ))
    log "$name: $status (${secs}s)"
    NAME=$name STATUS=$status SECS=$secs CMD=$full DRY=$DRY_RUN python3 -c '
import json, os
print(json.dumps({"step": os.environ["NAME"], "status": os.environ["STATUS"],
                  "seconds": int(os.environ["SECS"]), "command": os.environ["CMD"],
                  "dry_run": os.environ["DRY"] == "1"}))' >> "$STEPS_JSON"
}

# skip_without_sglang NAME: true (and the step recorded as skipped) where SGLang cannot be
# imported by $PY; the offline set-up installs no SGLang, the full one does
skip_without_sglang() {
    [[ $DRY_RUN == 1 ]] && return 1
    "$PY" -c "import sglang" 2>/dev/null && return 1
    log "$1: skipped (SGLang cannot be imported by $PY)"
    NAME=$1 python3 -c '
import json, os
print(json.dumps({"step": os.environ["NAME"], "status": "skipped", "seconds": 0,
                  "reason": "SGLang cannot be imported here (offline set-up)"}))' >> "$STEPS_JSON"
}

# ---- 0. the machine -----------------------------------------------------------------------
step preflight \
    "command -v nvidia-smi >/dev/null && nvidia-smi -L || echo 'no nvidia-smi here (dry run)'; nproc; python3 --version" \
    "nvidia-smi -L && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv && nproc && python3 --version"

# ---- 1. set-up ------------------------------------------------------------------------------
# the venv, torch + transformers (SGLang's pins), SGLang, the dev tools, the extension with
# its CUDA kernels (an error if they cannot be built), the default model (SmolLM2)
# (setup.py finds the toolkit through CUDA_HOME; the newest /usr/local/cuda* unless set)
if [[ -z ${CUDA_HOME:-} ]] && ! command -v nvcc >/dev/null; then
    CUDA_HOME=$(ls -d /usr/local/cuda* 2>/dev/null | sort -V | tail -1 || true)
    [[ -n $CUDA_HOME ]] && export CUDA_HOME
fi
SETUP_ARGS="PYTHON=${PYTHON:-python3} ANCHORCACHE_BUILD_CUDA=1 MAX_JOBS=$JOBS"
if [[ $OFFLINE == 1 ]]; then
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
    step setup "$PY -c 'import torch; print(torch.__version__)'" \
        "ANCHORCACHE_BUILD_EXT=1 ANCHORCACHE_BUILD_CUDA=1 MAX_JOBS=$JOBS $PY -m pip install -q --no-deps --no-build-isolation -e . && $PY -c 'import torch; from anchorcache.ext import _C; print(\"extension:\", _C.__file__)'"
else
    step setup "make -n setup $SETUP_ARGS >/dev/null && echo 'make setup: plan ok; CUDA_HOME=${CUDA_HOME:-none}'" \
        "make setup $SETUP_ARGS"
fi

# ---- 2. CUDA tests ------------------------------------------------------------------------
CUDA_TESTS="tests/ext/test_ops_build.py tests/ext/test_ops_kv.py tests/ext/test_ops_state.py tests/ext/test_ops_opcheck.py tests/ext/sglang/test_subpass.py"
step cuda_tests \
    "$PY -m pytest -q -p no:cacheprovider $NOCONFTEST --collect-only $CUDA_TESTS | tail -1" \
    "$PY -c 'import torch; assert torch.cuda.is_available(), \"no CUDA device\"' && ANCHORCACHE_BUILD_CUDA=1 $PY -m pytest -q -p no:cacheprovider $NOCONFTEST -rs $CUDA_TESTS 2>&1 | tee $OUT/cuda_tests.log && ! grep -qi 'needs a CUDA device' $OUT/cuda_tests.log"

# ---- 3. anchors on vs off, page size 1 and 16 ------------------------------------------------
EQ_DRIVER="$OUT/equality_driver.py"
cat > "$EQ_DRIVER" <<'PYEOF'
"""Anchors on vs off on SGLang (written by bench/gpu_check.sh; see its header)."""
import json
import os
import sys
import time
from contextlib import ExitStack

REPO = os.getcwd()
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

dry = os.environ.get("DRY_RUN") == "1"
out_path = sys.argv[1]
convs_n, turns = int(os.environ.get("CONVS", "3")), int(os.environ.get("TURNS", "3"))
attn = os.environ.get("ATTN") or ""

from anchorcache.ext.embedded.model_store import prepare_default_model  # noqa: E402
from anchorcache.ext.embedded.tiny_models import build_tiny_model, tiny_model_dir  # noqa: E402
from anchorcache.testing.data import conversations, turn_requests  # noqa: E402

models = {"tiny_qwen3": str(build_tiny_model("qwen3", tiny_model_dir("qwen3"), seed=0)),
          "smollm2": str(prepare_default_model())}
convs = [c for c in conversations("base") if len(turn_requests(c, turns)) == turns][:convs_n]
results = []
for name, model in models.items():
    for page in (1, 16):
        extra = ["--page-size", str(page), "--max-total-tokens", "32768"]
        if attn:
            extra += ["--attention-backend", attn]
        case = {"model": name, "page_size": page, "attention_backend": attn or "default",
                "sglang_args": extra, "turns": []}
        results.append(case)
        if dry:
            print(f"would serve {name} ({model}) with SGLang {' '.join(extra)}: "
                  f"{len(convs)} conversations x {turns} turns, anchors on vs off")
            continue
        import httpx
        import openai

        from replay_bench import spawn

        t = time.monotonic()
        with ExitStack() as stack:
            state = stack.enter_context(__import__("tempfile").TemporaryDirectory())
            worker = stack.enter_context(spawn("worker", "--backend", "sglang", "--model", model,
                                               tail=("--", *extra)))
            on = stack.enter_context(spawn("proxy", "--worker", worker, "--anchors",
                                           "--state-dir", state + "/on"))
            off = stack.enter_context(spawn("proxy", "--worker", worker, "--no-anchors",
                                            "--state-dir", state + "/off"))
            case["ready_s"] = round(time.monotonic() - t, 1)
            for conv in convs:
                tools = conv["tools"][:2]
                for turn, messages in enumerate(turn_requests(conv, turns), 1):
                    replies = []
                    for url in (off, on):
                        httpx.post(worker + "/flush_cache", timeout=60).raise_for_status()
                        client = openai.OpenAI(base_url=url + "/v1", api_key="", max_retries=0,
                                               timeout=600)
                        replies.append(client.chat.completions.create(
                            model="default", messages=messages, tools=tools, temperature=0,
                            max_tokens=24))
                    cold, warm = replies
                    details = warm.usage.prompt_tokens_details
                    case["turns"].append({
                        "conversation": conv["id"], "turn": turn,
                        "prompt_tokens": warm.usage.prompt_tokens,
                        "cached_tokens_on": details.cached_tokens if details else None,
                        "equal": warm.choices[0].message == cold.choices[0].message
                        and warm.usage.completion_tokens == cold.usage.completion_tokens})
            case["anchor_stats"] = httpx.get(worker + "/anchor/stats", timeout=60).json()
        case["equal"] = all(t["equal"] for t in case["turns"])
        case["restored_turns"] = sum(1 for t in case["turns"]
                                     if t["turn"] >= 2 and (t["cached_tokens_on"] or 0) > 0)
        case["seconds"] = round(time.monotonic() - t, 1)
        print(json.dumps({k: v for k, v in case.items() if k != "turns"}), flush=True)
with open(out_path, "w") as f:
    json.dump({"dry_run": dry, "cases": results}, f, indent=1)
bad = [c for c in results if not dry and not (c["equal"] and c["restored_turns"] > 0)]
if bad:
    sys.exit(f"anchors on != off, or nothing restored: {[(c['model'], c['page_size']) for c in bad]}")
PYEOF
EQ="CONVS=$CONVS TURNS=$TURNS ATTN=$ATTN"
skip_without_sglang equality || step equality "$EQ DRY_RUN=1 $PY $EQ_DRIVER $OUT/equality.json" \
    "$EQ DRY_RUN=0 $PY $EQ_DRIVER $OUT/equality.json"

# ---- 4. the SGLang replay benchmark on the GPU -------------------------------------------------
# page 1 with the overhead check (N conversations at once), page 16 without it
skip_without_sglang sglang_replay || step sglang_replay "$PY bench/sglang_replay.py --help | grep -q -- --page-size && echo 'sglang_replay: arguments ok'" \
    "$PY bench/sglang_replay.py --conversations 6 --turns 5 --concurrent 8 --rounds 2 --name sglang_replay_gpu_tiny_qwen3 && $PY bench/sglang_replay.py --conversations 6 --turns 5 --concurrent 0 --page-size 16 --name sglang_replay_gpu_tiny_qwen3_page16"

# ---- 5. the copy benchmark (exits 0 with a note where there is no CUDA device) -------------
step copy_bench "$PY bench/ext_snapshot_cuda.py" "$PY bench/ext_snapshot_cuda.py"

# ---- 6. do anchor copies stall other users? ---------------------------------------------------
# SmolLM2 (23 KB of KV per token), 6,000-token anchors restored and written while 4 streams
# decode: inter-token latency p99 on/off, and the scheduler's time per kind (the snapshot
# copies run on the copy thread's stream; `copy_wait` is what the loop still waits for)
SMOL='$('"$PY"' -c "from anchorcache.ext.embedded.model_store import default_model_dir; print(default_model_dir())")'
skip_without_sglang stall || step stall "$PY bench/sglang_stall.py --help | grep -q -- --anchor-tokens && echo 'sglang_stall: arguments ok'" \
    "$PY bench/sglang_stall.py --model $SMOL --anchor-tokens 6000 --restorers 4 --streams 4 --rounds 2 --name sglang_stall_gpu_smollm2"

# ---- 7. a hybrid model (Gated DeltaNet + attention) on SGLang's GPU kernels ------------------
# (its anchors' states captured by a second pass of each GDN layer's kernels: the captures
# must all have been taken and written, ext/sglang/subpass.py)
CAPTURED="import json; c = json.load(open('bench/results/sglang_replay_gpu_tiny_qwen3_5.json'))['anchor_stats_end']['captures']; print('captures:', c); assert c['mode'] == 'in_forward' and c['by'] == 'subpass' and c['taken'] > 0 and c['unwritten'] == 0, c"
skip_without_sglang hybrid_replay || step hybrid_replay "$PY bench/sglang_replay.py --help | grep -q -- qwen3_5 && echo 'hybrid replay: arguments ok'" \
    "$PY bench/sglang_replay.py --model qwen3_5 --conversations 6 --turns 5 --concurrent 4 --rounds 2 --name sglang_replay_gpu_tiny_qwen3_5 && $PY -c \"$CAPTURED\""

# ---- 7b. the same hybrid under concurrency: captures vs prefill cuts vs SGLang directly ----
# (issue 38's targets on a GPU: 8 conversations at once, the pool at 1.2x the longest request
# and one that holds everything, from a cold host tier)
skip_without_sglang hybrid_concurrency || step hybrid_concurrency "$PY bench/hybrid_concurrency.py --help | grep -q -- --pools && echo 'hybrid concurrency: arguments ok'" \
    "$PY bench/hybrid_concurrency.py --concurrent 8 --pools 1.2x,all --tiers cold --turns 3 --name hybrid_concurrency_gpu_tiny_qwen3_5"

# ---- 8. a sliding-window model with attention sinks on SGLang's GPU attention --------------
skip_without_sglang swa_replay || step swa_replay "$PY bench/sglang_replay.py --help | grep -q -- granite_swa && echo 'sliding-window replay: arguments ok'" \
    "$PY bench/sglang_replay.py --model granite_swa --conversations 6 --turns 5 --concurrent 0 --name sglang_replay_gpu_granite_swa"

# ---- 9. the proxy alone on a box of many cores: requests/s of 1 and 2 proxy processes -----
# (issue 40: two processes >= 1.8x one; the instant worker and the load generator in
# processes of their own, so that on this box they, unlike on a 2-core one, are not the
# ceiling; no GPU is used: it is the machine's cores that this step is here for); then the
# proxy's CPU per turn by conversation length there (5k against 100k; the 2-core VMs the
# suite runs on pay ~100 us of CPU for each wake-up of a process, a floor under every figure)
step proxy_processes "$PY bench/proxy_cpu.py --help | grep -q -- --client-processes && $PY bench/relay_floor.py --help > /dev/null && echo 'proxy processes: arguments ok'" \
    "$PY bench/proxy_cpu.py --processes 1,2 --concurrent 32 --seconds 8 --name proxy_processes_gpu_box && $PY bench/proxy_cpu.py --sizes 1000,5000,100000 --turns 10 --no-throughput --name proxy_cpu_gpu_box && $PY bench/relay_floor.py --pairs 1 --turns 5 --name relay_floor_gpu_box"

python3 - "$STEPS_JSON" "$OUT/summary.json" "$DRY_RUN" "$(( $(date +%s) - T0 ))" <<'PYEOF'
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
summary = {"dry_run": sys.argv[3] == "1", "seconds": int(sys.argv[4]), "steps": steps,
           "ok": all(s["status"] != "failed" for s in steps),
           "skipped": [s["step"] for s in steps if s["status"] == "skipped"]}
json.dump(summary, open(sys.argv[2], "w"), indent=1)
print(json.dumps({s["step"]: s["status"] for s in steps}))
PYEOF
log "done: $( [[ $FAILED == 0 ]] && echo all steps ok || echo some step failed ) ($OUT/summary.json)"
exit $FAILED
