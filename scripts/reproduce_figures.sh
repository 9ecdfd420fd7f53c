#!/usr/bin/env bash
# Re-measure every figure quoted in the issues' closing notes, one after the other (never two
# benchmarks at once), into RESULTS/. Takes roughly 5 h on a 2-core CPU (the issue-10 SmolLM2
# sections about 3 h of it). Usage:
#   scripts/reproduce_figures.sh [SECTION...]   (sections: overhead smoke sweep compare
#                                   demo_server temp adaptive lookup load spec_batch fused
#                                   decode_profile engine_load prefill_shapes prefill_head prefix stall
#                                   before structured draft draft_server verify_cost
#                                   draft_p_min hybrid hybrid_ab hybrid_load draft_ab
#                                   hybrid_k6 round_replay default_reps draft_3ep_ab
#                                   hybrid_match_ab held_out_ab p_min_ab hybrid_p_min k4_p_min
#                                   held_out_default
#                                   draft_sizes draft_epochs draft_4ep_ab draft_warmup
#                                   draft_4l_ab draft_4l_3ep draft_5l draft_by_confidence
#                                   draft_4l_4ep draft_4l_4ep_ab draft_more_data
#                                   draft_more_data_ab held_out_more_data
#                                   draft_more_data_2 held_out_more_data_2
#                                   draft_more_data_2_ab unseen_agreement
#                                   draft_more_data_3 draft_all_answers pack_answers
#                                   draft_layer_choice replay_all_answers
#                                   draft_all_answers_ab draft_hard_weight
#                                   draft_data_scaling data_scaling_fit answers_batch
#                                   answer_archive_cost
#                                   feature_probe;
#                                   default: all but draft (retrains
#                                   models/smollm2-draft, ~255 min), draft_sizes (trains 2-
#                                   and 4-layer drafts, ~75 min, then benches them and the
#                                   shipped one, ~20 min), draft_epochs (~50 min),
#                                   draft_4ep_ab (~40 min), draft_warmup (~75 min),
#                                   draft_4l_ab (~20 min), draft_4l_3ep (~30 min),
#                                   draft_5l (~110 min), draft_by_confidence (~4 min),
#                                   draft_4l_4ep (~25 min), draft_4l_4ep_ab (~21 min),
#                                   draft_more_data (~95 min), draft_more_data_ab
#                                   (~21 min), held_out_more_data (~16 min),
#                                   draft_more_data_2 (~105 min), held_out_more_data_2
#                                   (~16 min), draft_more_data_2_ab (~21 min),
#                                   unseen_agreement (~15 min), draft_more_data_3
#                                   (~135 min), draft_all_answers (~65 min once the
#                                   answers are in), pack_answers (~1 min),
#                                   answer_archive_cost (~4 min), draft_layer_choice
#                                   (~18 min), replay_all_answers (~10 min),
#                                   draft_all_answers_ab (~21 min), draft_hard_weight
#                                   (~18 min), draft_data_scaling (~60 min),
#                                   data_scaling_fit (seconds), answers_batch (~9 min) and
#                                   feature_probe (~110 min); these need the target's
#                                   answers, which draft
#                                   writes first)
set -euo pipefail
cd "$(dirname "$0")/.."
OPENBLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
[ -f "$OPENBLAS" ] && export LD_PRELOAD=$OPENBLAS
PY=${PY:-.venv/bin/python}
DEMO_T=models/demo/target DEMO_D=models/demo/draft
GEN_T=models/generated/target GEN_D=models/generated/draft
SMOL=models/generated/SmolLM2-135M-Instruct  # the default target (server.model_files.default_model)
OUT=${RESULTS_DIR:-RESULTS}
mkdir -p "$OUT"
# The generated (fp32, ~80M) pair, built once: both servers load it alike (mlx_lm.server would
# run the fp16 demo pair in fp16, which is ~50x slower on a CPU: not a fair comparison).
$PY -c "from server.model_files.synthetic import ensure_pair; ensure_pair('models/generated')"

bench() { $PY -m server.bench --results-dir "$OUT" "$@"; }
wait_up() { for _ in $(seq 600); do curl -sf "$1" >/dev/null && return; sleep 0.5; done; exit 1; }
# A section's RETURN trap (which clears itself first): stop its servers and wait until they are
# gone (a dying server still answers /health: the next section's wait_up would take it for its
# own).
stop() {
  kill "$@" 2>/dev/null || true
  local p
  for p in "$@"; do
    wait "$p" 2>/dev/null || true
    for _ in $(seq 300); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
  done
}

run_overhead() {  # issue 2: HTTP vs direct mlx_lm, k=4, 256 tokens
  $PY -m server.bench.overhead --target-model $GEN_T --draft-model $GEN_D --reps 3 \
    | tee "$OUT/overhead.txt"
}
run_smoke() { bench --smoke --tag smoke; }
run_sweep() { bench --tag sweep; }  # issue 3: the full k sweep on the demo pair
run_compare() {  # issue 3: our server vs mlx_lm.server, same fp32 models, k=4, greedy
  $PY -m server --model $GEN_T --draft-model $GEN_D --port 8100 >"$OUT/ours.log" 2>&1 &
  local ours=$!
  $PY -m mlx_lm server --model $GEN_T --draft-model $GEN_D --port 8101 >"$OUT/mlx.log" 2>&1 &
  local theirs=$!
  trap 'trap - RETURN; stop $ours $theirs' RETURN
  wait_up http://127.0.0.1:8100/health
  wait_up http://127.0.0.1:8101/health
  bench --server http://127.0.0.1:8100 --compare http://127.0.0.1:8101 --draft-tokens 4 \
    --reps 3 --max-tokens 200 --target-model $GEN_T --draft-model $GEN_D --tag vs-mlx-lm
}
run_demo_server() {  # issue 4: the demo pair through our server, k=4 vs no draft
  $PY -m server --port 8100 >"$OUT/demo-server.log" 2>&1 &
  local ours=$!
  trap 'trap - RETURN; stop $ours' RETURN
  wait_up http://127.0.0.1:8100/health
  bench --server http://127.0.0.1:8100 --draft-tokens 4 --reps 3 --target-model $DEMO_T \
    --draft-model $DEMO_D --tag demo-through-server
}
run_temp() {  # issue 5: rejection vs exact at temperature 0.7 and 1.0
  for t in 0.7 1.0; do
    for rule in exact rejection; do
      bench --temp $t --acceptance $rule --draft-tokens 4 --reps 3 --tag "t$t-$rule"
    done
  done
}
run_adaptive() { bench --adaptive --draft-tokens 8 --tag adaptive-k8; }  # vs the sweep's fixed k
run_lookup() {  # issue 5: prompt lookup on "repeat this code with one change"
  bench --draft prompt_lookup --prompt-kinds repeat_edit --draft-tokens 2,4,8 --tag lookup
}

run_load() {  # issue 8: concurrent streams, ours (draft, default policy) vs mlx_lm.server
  # without a draft (it batches) and with one (it does not), and ours without a draft (where
  # speculation stops paying); the servers take turns per level. Each client sends 3 requests
  # one after the other: one burst per level varied by +-15% between runs on this machine.
  $PY -m server --model $GEN_T --draft-model $GEN_D --port 8100 >"$OUT/load-ours.log" 2>&1 &
  local ours=$!
  $PY -m server --model $GEN_T --draft-model none --port 8103 >"$OUT/load-ours-plain.log" 2>&1 &
  local ours_plain=$!
  $PY -m mlx_lm server --model $GEN_T --port 8101 >"$OUT/load-mlx.log" 2>&1 &
  local plain=$!
  $PY -m mlx_lm server --model $GEN_T --draft-model $GEN_D --port 8102 \
    >"$OUT/load-mlx-draft.log" 2>&1 &
  local drafted=$!
  trap 'trap - RETURN; stop $ours $ours_plain $plain $drafted' RETURN
  wait_up http://127.0.0.1:8100/health
  wait_up http://127.0.0.1:8101/health
  wait_up http://127.0.0.1:8102/health
  wait_up http://127.0.0.1:8103/health
  $PY -m server.bench.load --server ours=http://127.0.0.1:8100 \
    --compare mlx_lm=http://127.0.0.1:8101 --compare mlx_lm+draft=http://127.0.0.1:8102 \
    --compare ours-no-draft=http://127.0.0.1:8103 \
    --concurrency 1,2,4,8,16 --requests-per-client 3 --max-tokens 96 --results-dir "$OUT" \
    --tag load-vs-mlx-lm
}

run_prefill_shapes() {  # issue 8: N prefills one at a time vs one batched forward
  $PY -m server.bench.prefill_shapes | tee "$OUT/prefill-shapes.txt"
}

run_prefill_head() {  # issues 8, 10: the output head on the last positions only
  $PY -m server.bench.prefill_head | tee "$OUT/prefill-head.txt"
  $PY -m server.bench.prefill_head --model "$GEN_T" --lengths 128 --rows 1,8 \
    | tee -a "$OUT/prefill-head.txt"
}

run_spec_batch() {  # issue 8: where batched speculation stops paying (the policy's defaults)
  $PY -m server.bench.spec_batch | tee "$OUT/spec-batch.txt"
}
run_fused() {  # issues 8 and 10: one forward with fused projections vs unfused
  $PY -m server.bench.fused | tee "$OUT/fused.txt"
  $PY -c "from server.model_files.default_model import target_folder; print(target_folder())" \
    | xargs -I{} $PY -m server.bench.fused --model {} | tee "$OUT/fused-smollm2.txt"
}
run_decode_profile() {  # issue 10 item 4: where a decode step goes; fusion; mx.compile
  local target
  target=$($PY -c "from server.model_files.default_model import target_folder; print(target_folder())")
  $PY -m server.bench.decode_profile --model "$target" --reps 5 | tee "$OUT/decode-profile.txt"
  $PY -m server.bench.fused --model "$target" --reps 8 | tee -a "$OUT/decode-profile.txt"
  $PY -m server.bench.fused --reps 8 | tee -a "$OUT/decode-profile.txt"
}
run_engine_load() {  # issue 8: the same load in process, our scheduler vs mlx_lm's BatchGenerator
  $PY -m server.bench.engine_load | tee "$OUT/engine-load.txt"
}
run_prefix() {  # issue 9: a 3-turn chat with a long system prompt, ours vs mlx_lm.server
  # (both with the draft), then 8 clients sharing the system prompt with and without the cache.
  $PY -m server --model $GEN_T --draft-model $GEN_D --port 8100 >"$OUT/prefix-ours.log" 2>&1 &
  local ours=$!
  $PY -m mlx_lm server --model $GEN_T --draft-model $GEN_D --port 8101 \
    >"$OUT/prefix-mlx.log" 2>&1 &
  local theirs=$!
  trap 'trap - RETURN; stop $ours $theirs' RETURN
  wait_up http://127.0.0.1:8100/health
  wait_up http://127.0.0.1:8101/health
  $PY -m server.bench.chat_turns --server ours=http://127.0.0.1:8100 \
    --compare mlx_lm=http://127.0.0.1:8101 --system-chars 4500 --clients 8 \
    --output "$OUT/prefix-cache.json" | tee "$OUT/prefix-cache.txt"
}
run_stall() {  # issue 8: the longest gap a 2048-token prompt causes in a running stream
  $PY -m server.bench.stall --prompt-tokens 2048 --chunks 64,128,256,1024,0 \
    | tee "$OUT/stall.txt"
}

run_before() {  # issue 8: one stream, this engine vs the one before the scheduler (fe2139d)
  local old=${OLD_TREE:-/tmp/mlx-spec-before} root=$PWD out
  out=$(cd "$OUT" && pwd)
  [ -d "$old" ] || git worktree add -f "$old" fe2139d >/dev/null
  $PY -m server --model $GEN_T --draft-model $GEN_D --port 8100 >"$OUT/before-new.log" 2>&1 &
  local new=$!
  (cd "$old" && "$root/$PY" -m server --model "$root/$GEN_T" --draft-model "$root/$GEN_D" \
    --port 8104 >"$out/before-old.log" 2>&1) &
  local before=$!
  trap 'trap - RETURN; pkill -f "port 8104" || true; stop $new $before' RETURN
  wait_up http://127.0.0.1:8100/health
  wait_up http://127.0.0.1:8104/health
  $PY -m server.bench.load --server new=http://127.0.0.1:8100 \
    --compare before=http://127.0.0.1:8104 --concurrency 1,1 --requests-per-client 3 \
    --results-dir "$OUT" --tag single-stream-vs-before
}
run_structured() {  # issue 11: grammar cost and speculation under a JSON schema
  $PY scripts/bench_structured.py --reps 2 | tee "$OUT/structured.txt"
}
one_more_epoch() {  # $1: a draft distill saved, $2: where it goes trained one epoch more (a
  # warm start, a new cosine from lr 3e-4), $3: the seed that shuffles that epoch
  $PY -m server.model_files.training.distill --init-from "$1" --out "$2" --epochs 1 --lr 3e-4 \
    --seed "$3"
}
ANSWERS=models/generated/target-answers.jsonl  # target_answers' own file (its DEFAULT_OUT)
EXTRA=models/generated/target-answers-extra.jsonl  # target_answers --start 3990: the requests
# after the 3,990 of target_answers' own file, none of which those used (all code)
ARCHIVE=data/target-answers  # answer_archive's packed copies of $ANSWERS and $EXTRA (in git)
restore_answers() {  # $1: an answers file, $2: its archive, $3: lines at most (default all);
  # the archived lines the file lacks, their teacher distributions rebuilt by the target
  # (answer_archive restore; resumes)
  [ -f "$2" ] || return 0
  $PY -m server.model_files.default_model >/dev/null
  $PY -m server.model_files.training.answer_archive restore "$2" "$1" ${3:+--limit "$3"}
}
run_pack_answers() {  # issue 10: the answers files packed into $ARCHIVE (commit them, and the
  # next clone restores them instead of decoding them again)
  [ -s $ANSWERS ] && $PY -m server.model_files.training.answer_archive pack $ANSWERS \
    $ARCHIVE/answers.jsonl.gz
  [ -s $EXTRA ] && $PY -m server.model_files.training.answer_archive pack $EXTRA \
    $ARCHIVE/extra.jsonl.gz
  return 0
}
run_answer_archive_cost() {  # issue 10: restoring the target's answers against decoding them:
  # the first 256 of $ANSWERS packed, restored (timed) and compared with the decoded ones
  have_answers || return 0
  local tmp n=256
  tmp=$(mktemp -d)
  head -$n $ANSWERS >"$tmp/decoded.jsonl"
  {
    $PY -m server.model_files.training.answer_archive pack "$tmp/decoded.jsonl" "$tmp/a.jsonl.gz"
    echo "decoded: $(wc -c <"$tmp/decoded.jsonl") bytes, packed: $(wc -c <"$tmp/a.jsonl.gz") bytes"
    local start=$SECONDS
    $PY -m server.model_files.training.answer_archive restore "$tmp/a.jsonl.gz" \
      "$tmp/restored.jsonl" 2>/dev/null
    local took=$((SECONDS - start))
    $PY -c "import sys; from pathlib import Path; from server.model_files.training.target_answers import read
n = sum(len(a) for _, a in read(Path(sys.argv[1])))
print(f'restored {n} answer tokens in {sys.argv[2]} s: {n / int(sys.argv[2]):.1f} tok/s')" \
      "$tmp/decoded.jsonl" "$took"
    $PY -m server.model_files.training.answer_archive compare "$tmp/decoded.jsonl" \
      "$tmp/restored.jsonl"
  } | tee "$OUT/answer-archive.txt"
  rm -rf "$tmp"
}
run_draft() {  # issue 10: rebuild the SmolLM2 draft (target's answers -> training) and measure it
  restore_answers $ANSWERS $ARCHIVE/answers.jsonl.gz
  $PY -m server.model_files.training.target_answers --limit ${DRAFT_ANSWERS:-3990} --minutes 120 \
    | tee "$OUT/draft-data.txt"
  $PY -m server.model_files.training.distill | tee "$OUT/draft-training.txt"
  one_more_epoch models/smollm2-draft models/smollm2-draft 2 | tee -a "$OUT/draft-training.txt"
  one_more_epoch models/smollm2-draft models/smollm2-draft 3 | tee -a "$OUT/draft-training.txt"
  $PY -m server.model_files.training.distill_eval | tee "$OUT/draft-eval.txt"
  run_draft_server
}
run_verify_cost() {  # issue 10: a speculative round's parts on SmolLM2, and the acceptance 1.4x needs
  $PY -m server.model_files.default_model >/dev/null
  $PY -m server.bench.verify_cost | tee "$OUT/verify-cost.txt"
}
on_smol_server() {  # $1: draft folder, $2: log name; runs the rest with our server on 8100 serving
  # SmolLM2 with that draft
  local draft=$1 log=$2
  shift 2
  $PY -m server.model_files.default_model >/dev/null
  $PY -m server --model $SMOL --draft-model "$draft" --port 8100 >"$OUT/$log-server.log" 2>&1 &
  local ours=$!
  trap 'trap - RETURN; stop $ours' RETURN
  wait_up http://127.0.0.1:8100/health
  "$@"
}
bench_draft() {  # $1: draft folder, $2: tag; our server with it, k = $3 (default 1,2,4,6) and
  # adaptive, $4 reps (default 1)
  on_smol_server "$1" "$2" draft_benches "$@"
}
draft_benches() {  # $1-$4 as bench_draft's, $5: drafter (default model)
  bench --server http://127.0.0.1:8100 --target-model $SMOL --draft-model "$1" \
    --draft "${5:-model}" --draft-tokens "${3:-1,2,4,6}" --reps "${4:-1}" --max-tokens 128 \
    --tag "$2"
  bench --server http://127.0.0.1:8100 --target-model $SMOL --draft-model "$1" \
    --draft "${5:-model}" --draft-tokens 4 --adaptive --reps "${4:-1}" --max-tokens 128 \
    --tag "$2-adaptive"
}
run_draft_server() {  # issue 10: the SmolLM2 draft through our server, k = 1, 2, 4, 6 and adaptive
  bench_draft models/smollm2-draft smollm2-draft
}
run_draft_p_min() {  # issue 10: the shipped draft, adaptive k with a confidence cut-off; lookup
  on_smol_server models/smollm2-draft draft-p-min p_min_benches
}
smol_adaptive() {  # $1: drafter, $2: reps, $3: tag, then more bench arguments: the SmolLM2
  # server on port $SMOL_PORT (default 8100, on_smol_server's) serving draft $SMOL_DRAFT (default
  # the shipped one), drafting with $1, adaptive k up to 4, 128 tokens
  local d=$1 reps=$2 tag=$3
  shift 3
  bench --server "http://127.0.0.1:${SMOL_PORT:-8100}" --target-model $SMOL --draft "$d" \
    $([ "$d" = prompt_lookup ] || echo --draft-model "${SMOL_DRAFT:-models/smollm2-draft}") \
    --draft-tokens 4 --adaptive --reps "$reps" --max-tokens 128 --tag "$tag" "$@"
}
p_min_benches() {
  local p
  for p in ${P_MINS:-0 0.2 0.4 0.6}; do
    smol_adaptive model 2 "smollm2-draft-p-min-$p" --draft-p-min "$p"
  done
  smol_adaptive prompt_lookup 2 smollm2-lookup-adaptive
}
run_hybrid() {  # issue 10: lookup when it matches, the shipped draft when not (k = 1, 2, 4, 6,
  # adaptive); beside lookup alone and the draft alone (adaptive), same server and run
  on_smol_server models/smollm2-draft hybrid hybrid_benches
}
hybrid_benches() {
  local d
  bench --server http://127.0.0.1:8100 --target-model $SMOL --draft-model models/smollm2-draft \
    --draft hybrid --draft-tokens 1,2,4,6 --reps 2 --max-tokens 128 --tag smollm2-hybrid
  for d in hybrid prompt_lookup model; do
    smol_adaptive $d 2 "smollm2-$d-adaptive"
  done
}
run_hybrid_p_min() {  # issue 10: hybrid at a fixed k = 1, 2, 4, 6 without and with draft_p_min
  # 0.4 (the draft model's round cut at its first token under it), one server, one after the other
  on_smol_server models/smollm2-draft hybrid-p-min hybrid_p_min_benches
}
hybrid_p_min_benches() {
  local p
  for p in 0 0.4; do smol_p_min hybrid 1,2,4,6 $p "smollm2-hybrid-p-min-$p"; done
}
smol_p_min() {  # $1: drafter, $2: fixed draft lengths, $3: draft_p_min, $4: tag; the SmolLM2
  # server on_smol_server started, the shipped draft, 128 tokens, 2 reps
  bench --server http://127.0.0.1:8100 --target-model $SMOL --draft-model models/smollm2-draft \
    --draft "$1" --draft-tokens "$2" --draft-p-min "$3" --reps 2 --max-tokens 128 --tag "$4"
}
run_k4_p_min() {  # issue 10: acceptance and speedup at k = 4 as the draft model's confidence
  # cut-off rises (0 = none, the default; llama.cpp's server defaults to 0.75), the draft alone and
  # hybrid, one server; the table goes to $OUT/k4-p-min.txt
  on_smol_server models/smollm2-draft k4-p-min k4_p_min_benches
  ab_table 10 k4-p-min.txt "$OUT"/bench-*-k4-p-min-*.json
}
k4_p_min_benches() {
  local d p
  for d in model hybrid; do
    for p in 0 0.4 0.6 0.75 0.9; do smol_p_min $d 4 $p "k4-p-min-$d-$p"; done
  done
}
ab_table() {  # $1: N, $2: a file name, then result files: the N newest of them taken in turn
  # (server.bench.ab) into $OUT/$2
  local n=$1 table=$2
  shift 2
  $PY -m server.bench.ab $(ls -t "$@" | head -"$n") | tee "$OUT/$table"
}
run_hybrid_ab() {  # issue 10: hybrid against lookup alone, adaptive k, alternated 3 times (one
  # run's cells move by about 0.1x on this shared CPU); the table goes to $OUT/hybrid-ab.txt
  on_smol_server models/smollm2-draft hybrid-ab hybrid_ab_benches
  ab_table 6 hybrid-ab.txt "$OUT"/bench-*-ab[123]-{hybrid,prompt_lookup}.json
}
hybrid_ab_benches() {
  local i d
  for i in 1 2 3; do
    for d in hybrid prompt_lookup; do
      smol_adaptive $d 3 "ab$i-$d"
    done
  done
}
run_hybrid_match_ab() {  # issue 10: hybrid drafting by lookup from a 1-token match (before)
  # against from a 2-token match (the default), adaptive k, alternated 3 times on one server
  on_smol_server models/smollm2-draft hybrid-match-ab hybrid_match_ab_benches
  ab_table 6 hybrid-match-ab.txt "$OUT"/bench-*-match-ab[123]-m[12].json
}
hybrid_match_ab_benches() {
  local i m
  for i in 1 2 3; do
    for m in 1 2; do
      smol_adaptive hybrid 2 "match-ab$i-m$m" --hybrid-min-match $m
    done
  done
}
run_held_out_ab() {  # issue 10: plain decoding, hybrid from a 1-token lookup match (before) and
  # from a 2-token one (the default), through our server on 16 held-out code requests and 16
  # prose requests on unseen topics, each request under the three in turn
  have_answers || return 0
  on_smol_server models/smollm2-draft held-out-ab held_out_benches
}
held_out_benches() {
  held_out_against_plain held-out-ab.txt match1='{"draft": "hybrid", "hybrid_min_match": 1}' \
    match2='{"draft": "hybrid", "hybrid_min_match": 2}'
}
held_out_against_plain() {  # $1: a file name in $OUT, then NAME=JSON settings: plain decoding and
  # each setting on the 16 + 16 held-out requests, each request under all in turn
  local out=$1 setting args=()
  shift
  for setting in "$@"; do args+=(--setting "$setting"); done
  $PY -m server.bench.held_out --server http://127.0.0.1:8100 \
    --setting plain='{"num_draft_tokens": 0}' "${args[@]}" --count 16 | tee "$OUT/$out"
}
run_p_min_ab() {  # draft_p_min with a fixed k against the default (adaptive k), through our
  # server on the same held-out requests, each request under every setting in turn
  have_answers || return 0
  on_smol_server models/smollm2-draft held-out-p-min held_out_p_min_benches
}
held_out_p_min_benches() {
  $PY -m server.bench.held_out --server http://127.0.0.1:8100 \
    --setting plain='{"num_draft_tokens": 0}' \
    --setting adaptive='{"draft": "hybrid"}' \
    --setting k4-p0.3='{"draft": "hybrid", "adaptive": false, "num_draft_tokens": 4, "draft_p_min": 0.3}' \
    --setting k4-p0.4='{"draft": "hybrid", "adaptive": false, "num_draft_tokens": 4, "draft_p_min": 0.4}' \
    --count 16 | tee "$OUT/held-out-p-min-ab.txt"
  $PY -m server.bench.held_out --server http://127.0.0.1:8100 \
    --setting plain='{"num_draft_tokens": 0}' \
    --setting adaptive='{"draft": "hybrid"}' \
    --setting k6-p0.4='{"draft": "hybrid", "adaptive": false, "num_draft_tokens": 6, "draft_p_min": 0.4}' \
    --count 16 | tee "$OUT/held-out-p-min-k6.txt"
}
have_answers() {  # the target's answers (restored from $ARCHIVE, or section draft writes
  # them) and the prose kept for measuring (written here if missing, ~2 min)
  restore_answers $ANSWERS $ARCHIVE/answers.jsonl.gz
  [ -s $ANSWERS ] || {
    echo "no target answers: run section draft first"; return 1; }
  [ -s models/generated/target-answers-eval-prose.jsonl ] ||
    $PY -m server.model_files.training.target_answers --eval-prose
}
run_hybrid_load() {  # issue 10: config.yaml's server (draft: hybrid) against the same with
  # draft: prompt_lookup, 1-8 concurrent streams, taking turns per level
  local lookup_config
  lookup_config=$(mktemp --suffix .yaml)
  sed 's/^  draft: hybrid .*/  draft: prompt_lookup/' config.yaml >"$lookup_config"
  $PY -m server.model_files.default_model >/dev/null
  $PY -m server --config config.yaml --port 8100 >"$OUT/load-hybrid-server.log" 2>&1 &
  local hybrid=$!
  $PY -m server --config "$lookup_config" --port 8101 >"$OUT/load-lookup-server.log" 2>&1 &
  local lookup=$!
  trap 'trap - RETURN; rm -f "$lookup_config"; stop $hybrid $lookup' RETURN
  wait_up http://127.0.0.1:8100/health
  wait_up http://127.0.0.1:8101/health
  $PY -m server.bench.load --server hybrid=http://127.0.0.1:8100 \
    --compare lookup=http://127.0.0.1:8101 --concurrency 1,2,4,8 --requests-per-client 2 \
    --results-dir "$OUT" --tag hybrid-vs-lookup
}
run_draft_ab() {  # issue 10: the draft shipped at commit 989a207 (3,990 answers, 2 epochs)
  # against the one before it (commit $OLD_DRAFT_REV, 2,108 answers)
  draft_at 989a207 models/generated/draft-2ep
  draft_at "${OLD_DRAFT_REV:-2b4c874}" models/generated/draft-old
  draft_ab models/generated/draft-2ep models/generated/draft-old draft-ab
}
draft_at() {  # $1: a commit, $2: a folder: models/smollm2-draft as it was at that commit
  rm -rf "$2" && mkdir -p "$2"
  git archive "$1" models/smollm2-draft | tar -x -C "$2" --strip-components 2
}
draft_ab() {  # $1: a draft ("new", port 8100), $2: another ("old", port 8101), $3: tag; both
  # through our server, hybrid and the draft alone, adaptive k, taking turns 3 times; the table
  # (server.bench.ab) goes to $OUT/$3.txt
  $PY -m server.model_files.default_model >/dev/null
  $PY -m server --model $SMOL --draft-model "$2" --port 8101 >"$OUT/$3-old-server.log" 2>&1 &
  local previous=$!
  trap 'trap - RETURN; stop $previous' RETURN
  wait_up http://127.0.0.1:8101/health
  on_smol_server "$1" "$3" draft_ab_benches "$1" "$2" "$3"
  ab_table 12 "$3.txt" "$OUT"/bench-*-"$3"[123]-{new,old}-{hybrid,model}.json
}
draft_ab_benches() {  # $1-$3 as draft_ab's
  local i d
  for i in 1 2 3; do
    for d in hybrid model; do
      SMOL_DRAFT=$1 smol_adaptive $d 2 "$3$i-new-$d"
      SMOL_PORT=8101 SMOL_DRAFT=$2 smol_adaptive $d 2 "$3$i-old-$d"
    done
  done
}
run_held_out_default() {  # issue 10: the default (hybrid from a 2-token match, adaptive k, the
  # shipped draft) against plain decoding on held_out_ab's 32 requests, each under both in turn
  have_answers || return 0
  on_smol_server models/smollm2-draft held-out-default held_out_default_benches
}
held_out_default_benches() {
  held_out_against_plain held-out-default.txt default='{"draft": "hybrid", "hybrid_min_match": 2}'
}
run_default_reps() {  # issue 10: the default (hybrid, adaptive k up to 4, the shipped draft) three
  # times on one server; their median and counts (server.bench.ab) go to $OUT/default-reps.txt
  on_smol_server models/smollm2-draft default-reps default_reps_benches
  ab_table 3 default-reps.txt "$OUT"/bench-*-default-rep[123].json
}
default_reps_benches() {
  local i
  for i in 1 2 3; do smol_adaptive hybrid 2 "default-rep$i"; done
}
run_hybrid_k6() {  # issue 10: hybrid with adaptive k up to 4 (the default) and up to 6, taking
  # turns twice on one server (round_replay models a longer lookup draft as faster)
  on_smol_server models/smollm2-draft hybrid-k6 hybrid_k6_benches
}
hybrid_k6_benches() {
  local i
  for i in 1 2; do
    smol_adaptive hybrid 2 "k6ab$i-k4"
    smol_adaptive hybrid 2 "k6ab$i-k6" --draft-tokens 6
  done
}
run_round_replay() {  # issue 10: drafting policies priced from replayed greedy rounds: on
  # the bench prompts' answers, then on 200 held-out code answers and 100 prose answers on
  # topics no training request used (written first if missing: ~2 min)
  $PY -m server.bench.round_replay | tee "$OUT/round-replay.txt"
  have_answers || return 0
  $PY -m server.bench.round_replay --held-out 200 | tee "$OUT/round-replay-held-out.txt"
}
run_feature_probe() {  # issue 10: what a draft reading the target's features would agree: an
  # EAGLE-style head trained on the first 2,000 answers (the target's features first, ~35 min,
  # kept for the next run), shaped as EAGLE's and started as a 1-layer token draft (~27 min
  # each); then a 1-layer token draft trained on the same first answers (distill on the first
  # 2,108 lines: 2,002 training answers, ~19 min, if missing), measured on the same 200
  # held-out answers
  local f=models/generated/target-features-2000.npz d=models/generated/draft-1l init
  local first=models/generated/target-answers-2108.jsonl
  for init in "last --token-weight 0.1" "first --token-weight 1"; do
    $PY -m server.model_files.training.feature_probe --train 2000 --features $f --init $init \
      ${PROBE_ARGS:-} | tee "$OUT/feature-probe-2000-${init%% *}.txt"
  done
  if [ ! -f $d/training.json ]; then
    head -n 2108 models/generated/target-answers.jsonl > $first
    $PY -m server.model_files.training.distill --answers $first --layers 0 --out $d
  fi
  $PY -m server.model_files.training.distill_eval --draft $d --no-card --k 1 \
    | tee "$OUT/draft-1l-held-out-agreement.txt"
}
run_draft_sizes() {  # issue 10: drafts of 2 and 4 layers ($DRAFT_SIZES) trained like the shipped
  # 3-layer one, on the same answers, then each through our server by speedup: the draft alone
  # and hybrid, k = 1, 2, 4 and adaptive
  local n d results=()
  for n in ${DRAFT_SIZES:-2 4}; do
    d=models/generated/draft-${n}l
    trained_on_current_answers "$d" || $PY -m server.model_files.training.distill \
      --layers "$(seq -s, 0 $((n - 1)))" --out "$d" | tee "$OUT/draft-${n}l-training.txt"
  done
  for n in ${DRAFT_SIZES:-2 4} 3; do
    d=models/generated/draft-${n}l
    [ "$n" = 3 ] && d=models/smollm2-draft
    on_smol_server "$d" "size-${n}l" size_benches "$d" "size-${n}l"
    results+=($(ls -t "$OUT"/bench-*-size-${n}l-{model,hybrid}{,-adaptive}.json | head -4))
  done
  $PY -m server.bench.draft_sizes "${results[@]}" | tee "$OUT/draft-sizes.txt"
}
run_draft_epochs() {  # issue 10: the 2-layer draft (tied with the shipped 3-layer one) trained
  # 3 epochs instead of 2: held-out agreement, then hybrid and the draft alone, adaptive k
  local d=models/generated/draft-2l-3ep
  trained_on_current_answers "$d" || $PY -m server.model_files.training.distill --layers 0,1 \
    --epochs 3 --out "$d" | tee "$OUT/draft-2l-3ep-training.txt"
  SMOL_DRAFT=$d on_smol_server "$d" draft-2l-3ep epochs_benches
}
epochs_benches() {
  local d
  for d in hybrid model; do smol_adaptive $d 2 "draft-2l-3ep-$d-adaptive"; done
}
run_draft_3ep_ab() {  # issue 10: the shipped draft (3 epochs) against the same recipe trained 2
  # epochs (the draft shipped at commit 989a207), taking turns (draft_ab)
  draft_at 989a207 models/generated/draft-2ep
  draft_ab models/smollm2-draft models/generated/draft-2ep draft-3ep-ab
}
run_draft_4ep_ab() {  # issue 10: the draft shipped until commit 8db9f29 (3 epochs) trained one
  # epoch more (a warm start, a new cosine from lr 3e-4, 474 steps, ~19 min: the draft shipped
  # since) against it: agreement (distill_eval), then taking turns through the server (draft_ab)
  local d=models/generated/draft-3l-4ep
  draft_at 8db9f29 models/generated/draft-3ep
  [ -f "$d/training.json" ] || one_more_epoch models/generated/draft-3ep "$d" 3 \
    | tee "$OUT/draft-3l-4ep-training.txt"
  $PY -m server.model_files.training.distill_eval --draft "$d" --no-card \
    | tee "$OUT/draft-3l-4ep-eval.txt"
  draft_ab "$d" models/generated/draft-3ep draft-4ep-ab
}
run_draft_warmup() {  # issue 10: distill's first 40 updates without and with warmup and
  # clipping (first_steps; layers 0-2 and 0-3, the 2-epoch schedule of draft_sizes), then the
  # 4-layer draft of draft_sizes trained again with 50 warmup steps and clipping at norm 1
  # (~60 min): held-out agreement and mlx_lm's acceptance (distill_eval)
  local n w d=models/generated/draft-4l-warm
  for n in 3 4; do
    for w in "--warmup 0 --clip-norm 0" "--warmup 50 --clip-norm 1"; do
      # shellcheck disable=SC2086  # $w: two options
      $PY -m server.model_files.training.first_steps --layers "$(seq -s, 0 $((n - 1)))" \
        --epochs 2 $w
    done
  done | tee "$OUT/draft-warmup.txt"
  trained_on_current_answers "$d" || $PY -m server.model_files.training.distill \
    --layers 0,1,2,3 --epochs 2 --warmup 50 --clip-norm 1 --out "$d" \
    | tee "$OUT/draft-4l-warm-training.txt"
  $PY -m server.model_files.training.distill_eval --draft "$d" --no-card \
    | tee "$OUT/draft-4l-warm-eval.txt"
}
run_draft_4l_ab() {  # issue 10: draft_warmup's 4-layer draft (2 epochs with warmup and
  # clipping) against the 3-layer draft shipped until then (4 epochs, commit 0828b96), taking
  # turns through the server (draft_ab)
  draft_at 0828b96 models/generated/draft-3l-shipped
  draft_ab models/generated/draft-4l-warm models/generated/draft-3l-shipped draft-4l-ab
  # the 3-layer draft's agreement on held-out, unseen-prose and training answers (k = 1 only)
  $PY -m server.model_files.training.distill_eval --draft models/generated/draft-3l-shipped \
    --no-card --k 1 --max-tokens 16 | tee "$OUT/draft-3l-4ep-agreement.txt"
}
run_draft_4l_3ep() {  # issue 10: the 4-layer draft shipped until commit 7147159 (2 epochs)
  # trained a 3rd epoch (one_more_epoch, 474 steps, ~25 min; shipped since): held-out agreement
  # and mlx_lm's acceptance (distill_eval)
  local d=models/generated/draft-4l-3ep
  draft_at 6bf843b models/generated/draft-4l-2ep
  trained_on_current_answers "$d" || one_more_epoch models/generated/draft-4l-2ep "$d" 2 \
    | tee "$OUT/draft-4l-3ep-training.txt"
  $PY -m server.model_files.training.distill_eval --draft "$d" --no-card \
    | tee "$OUT/draft-4l-3ep-eval.txt"
}
run_draft_5l() {  # issue 10: a 5-layer draft (the target's layers 0-4) trained like the shipped
  # 4-layer one (2 epochs, 948 steps, warmup 50, clip 1, ~50 min; then one_more_epoch, ~25 min):
  # held-out agreement and mlx_lm's acceptance (distill_eval), then against the shipped 4-layer
  # draft through the server (draft_ab)
  local d=models/generated/draft-5l
  trained_on_current_answers "$d" || $PY -m server.model_files.training.distill \
    --layers 0,1,2,3,4 --out "$d" | tee "$OUT/draft-5l-training.txt"
  trained_on_current_answers "$d-3ep" || one_more_epoch "$d" "$d-3ep" 2 \
    | tee "$OUT/draft-5l-3ep-training.txt"
  $PY -m server.model_files.training.distill_eval --draft "$d-3ep" --no-card \
    | tee "$OUT/draft-5l-3ep-eval.txt"
  draft_ab "$d-3ep" models/smollm2-draft draft-5l-ab
}
run_draft_by_confidence() {  # issue 10: where the shipped draft (and draft_5l's, when there)
  # misses: its held-out agreement grouped by the target's top-1 probability
  have_answers || return 0
  $PY -m server.model_files.training.distill_eval --by-confidence \
    | tee "$OUT/draft-by-confidence.txt"
  [ -d models/generated/draft-5l-3ep ] || return 0
  $PY -m server.model_files.training.distill_eval --by-confidence \
    --draft models/generated/draft-5l-3ep | tee "$OUT/draft-5l-3ep-by-confidence.txt"
}
run_draft_4l_4ep() {  # issue 10: the 4-layer draft shipped until commit d9da3be (3 epochs,
  # as at 7147159) trained a 4th (one_more_epoch, seed 3; shipped since): held-out agreement
  # (distill's), then by the target's confidence
  local d=models/generated/draft-4l-4ep
  draft_at 7147159 models/generated/draft-4l-3ep-shipped
  trained_on_current_answers "$d" || one_more_epoch models/generated/draft-4l-3ep-shipped "$d" 3 \
    | tee "$OUT/draft-4l-4ep-training.txt"
  $PY -m server.model_files.training.distill_eval --by-confidence --draft "$d" \
    | tee "$OUT/draft-4l-4ep-by-confidence.txt"
}
run_draft_4l_4ep_ab() {  # issue 10: draft_4l_4ep's draft against the one shipped before it (3
  # epochs), taking turns through the server (draft_ab)
  draft_at 7147159 models/generated/draft-4l-3ep-shipped
  draft_ab models/generated/draft-4l-4ep models/generated/draft-4l-3ep-shipped draft-4l-4ep-ab
}
run_draft_more_data() {  # issue 10: more data at the same compute: the 4-layer, 3-epoch draft
  # (7147159) trained 474 steps (the 4th epoch's) over the training answers and up to
  # $EXTRA_ANSWERS new ones (target_answers --start 3990: requests none of the 3,990 used;
  # ~60 min), against draft_4l_4ep (the same steps over the training answers alone)
  local d=models/generated/draft-4l-more-data
  have_answers || return 0
  extra_answers_to 2500 60 draft-more-data-answers.txt
  [ "$(answers_in $EXTRA)" = 2500 ] || {
    echo "$EXTRA holds more than 2,500 answers (draft_more_data_2 added to it): skipped"
    return 0; }
  draft_at 7147159 models/generated/draft-4l-3ep-shipped
  $PY -m server.model_files.training.distill --init-from models/generated/draft-4l-3ep-shipped \
    --out "$d" --steps 474 --lr 3e-4 --seed 3 --extra-answers "$EXTRA" \
    | tee "$OUT/draft-more-data-training.txt"
  measure_trained "$d" draft-more-data
}
measure_trained() {  # $1: a draft distill saved, $2: name; its held-out agreement by the
  # target's confidence and distill_eval at k = 4 (card left alone) into $OUT/$2-*.txt
  $PY -m server.model_files.training.distill_eval --by-confidence --draft "$1" \
    | tee "$OUT/$2-by-confidence.txt"
  $PY -m server.model_files.training.distill_eval --no-card --k 4 --draft "$1" \
    | tee "$OUT/$2-eval.txt"
}
answers_in() {  # $1: an answers file; its lines (0 when there is none)
  if [ -f "$1" ]; then wc -l <"$1" | tr -d ' '; else echo 0; fi
}
extra_answers_to() {  # $1: answers $EXTRA is to hold, $2: minutes at most, $3: log in $OUT;
  # appends the missing ones
  restore_answers $EXTRA $ARCHIVE/extra.jsonl.gz "$1"
  local missing=$(($1 - $(answers_in $EXTRA)))
  [ "$missing" -gt 0 ] || return 0
  $PY -m server.model_files.training.target_answers --start 3990 --limit "$missing" \
    --minutes "$2" --out "$EXTRA" | tee "$OUT/$3"
}
run_draft_more_data_2() {  # issue 10: more data again: draft_more_data's draft trained one more
  # epoch (1,084 steps, ~46 min) over the training answers and 4,876 new ones: every request
  # the pool has after the 3,990 (the 2,376 beyond draft_more_data's take ~55 min)
  local d=models/generated/draft-4l-more-data-2
  have_answers || return 0
  [ -d models/generated/draft-4l-more-data ] || run_draft_more_data
  extra_answers_to 4876 70 draft-more-data-2-answers.txt
  [ "$(answers_in $EXTRA)" = 4876 ] || {
    echo "$EXTRA holds more than 4,876 answers (draft_more_data_3 added to it): skipped"
    return 0; }
  $PY -m server.model_files.training.distill --init-from models/generated/draft-4l-more-data \
    --out "$d" --epochs 1 --lr 3e-4 --seed 4 --extra-answers "$EXTRA" \
    | tee "$OUT/draft-more-data-2-training.txt"
  measure_trained "$d" draft-more-data-2
}
run_draft_more_data_3() {  # issue 10: more data a third time: the second request pool
  # (chat_requests: utility modules shaped as the bench's structured prompt, "implement"
  # requests) answered for 80 minutes into $EXTRA after the first pool's 4,876, then
  # draft_more_data_2's draft trained 1,200 steps (~45 min) over the training answers and all of
  # $EXTRA
  local d=models/generated/draft-4l-more-data-3
  have_answers || return 0
  [ -d models/generated/draft-4l-more-data-2 ] || run_draft_more_data_2
  extra_answers_to 8130 80 draft-more-data-3-answers.txt
  $PY -m server.model_files.training.distill --init-from models/generated/draft-4l-more-data-2 \
    --out "$d" --steps 1200 --lr 3e-4 --seed 5 --extra-answers "$EXTRA" \
    | tee "$OUT/draft-more-data-3-training.txt"
  measure_trained "$d" draft-more-data-3
}
ALL_ANSWERS_DRAFT=models/generated/draft-all-answers  # draft_all_answers' draft
run_draft_all_answers() {  # issue 10: the shipped draft trained one epoch more (1,156 steps,
  # ~56 min) over the training answers and $EXTRA's first 5,458: the first pool's 4,876 and the
  # second pool's first 582, which hold all 291 utility modules (the bench's structured
  # prompt's shape); one run from the shipped draft instead of draft_more_data_3's chain of three
  local n=5458 d=$ALL_ANSWERS_DRAFT
  have_answers || return 0
  extra_answers_to $n 90 draft-all-answers-answers.txt
  one_epoch_more $n "$d" | tee "$OUT/draft-all-answers-training.txt"
  measure_trained "$d" draft-all-answers
}
one_epoch_more() {  # $1: N, $2: out folder; the shipped draft trained one epoch more (lr 3e-4,
  # seed 6) over the training answers plus $EXTRA's first N (0: none)
  local extra=()
  if [ "$1" -gt 0 ]; then
    head -n "$1" "$EXTRA" >"models/generated/target-answers-extra-$1.jsonl"
    extra=(--extra-answers "models/generated/target-answers-extra-$1.jsonl")
  fi
  $PY -m server.model_files.training.distill --init-from models/smollm2-draft \
    --out "$2" --epochs 1 --lr 3e-4 --seed 6 "${extra[@]}"
}
need_all_answers_draft() { [ -d "$ALL_ANSWERS_DRAFT" ] || run_draft_all_answers; }
short_distills() {  # $1: results file, $2: a distill flag, $3...: its values; per value a
  # draft trained 120 steps from the defaults (the target's layers 0-3, the training answers,
  # same seed, ~6 min), its held-out agreement before and after into $OUT/$1
  local file=$1 flag=$2 label=${2#--} value
  shift 2
  label=${label//-/ }
  have_answers || return 0
  : >"$OUT/$file"
  for value in "$@"; do
    echo "== $label $value" | tee -a "$OUT/$file"
    $PY -m server.model_files.training.distill "$flag" "$value" --steps 120 --bits 0 \
      --out "models/generated/draft${flag#-}-$value" 2>&1 | tr '\r' '\n' \
      | grep -v 's/step' | tee -a "$OUT/$file"
  done
}
run_draft_layer_choice() {  # issue 10: which of the target's layers a 4-layer draft starts
  # from: its first four (the shipped draft's), or its first ones and its last one or two (what
  # the output head reads)
  short_distills draft-layer-choice.txt --layers 0,1,2,3 0,1,2,29 0,1,28,29
}
run_draft_hard_weight() {  # issue 10: distill's mix of the target's written token and its
  # distribution (--hard-weight 0: its distribution alone; 1: the token alone; 0.5 the default)
  short_distills draft-hard-weight.txt --hard-weight 0 0.5 1
}
run_draft_data_scaling() {  # issue 10: how held-out agreement grows with the data: the shipped
  # draft trained one epoch more, as draft_all_answers' was (lr 3e-4, seed 6), over the training
  # answers plus the first N of $EXTRA (one_epoch_more), N = $SCALING_EXTRA (0: the same
  # answers one epoch more; ~23 and ~35 min); draft_all_answers is the same recipe with N = 5,458
  local n
  have_answers || return 0
  extra_answers_to 5458 90 draft-all-answers-answers.txt
  : >"$OUT/draft-data-scaling.txt"
  for n in $SCALING_EXTRA; do
    echo "== extra answers $n" | tee -a "$OUT/draft-data-scaling.txt"
    one_epoch_more "$n" "models/generated/draft-scaling-$n" 2>&1 | tr '\r' '\n' \
      | grep -v 's/step' | tee -a "$OUT/draft-data-scaling.txt"
  done
}
SCALING_EXTRA=${SCALING_EXTRA:-0 2000}
ANSWERS_PER_HOUR=2597  # the target's decoding rate: 1,000 answers in 23:06
# (RESULTS/target-answers-extra-decoded-3.txt)
run_data_scaling_fit() {  # issue 10: draft_data_scaling's drafts and draft_all_answers' (the same
  # recipe, 0 / 2,000 / 5,458 extra answers) fitted with a power law, and what acceptance 0.6
  # at k = 4 (agreement ~0.81) and the replay's 0.83 would take; seconds
  have_answers || return 0
  need_all_answers_draft
  [ -d models/generated/draft-scaling-0 ] || run_draft_data_scaling
  $PY -m server.model_files.training.data_scaling models/generated/draft-scaling-* \
    "$ALL_ANSWERS_DRAFT" --agreement 0.81 0.83 --answers-per-hour $ANSWERS_PER_HOUR \
    | tee "$OUT/draft-data-scaling-fit.txt"
}
run_answers_batch() {  # issue 10: the target's decoding rate for training data at batch 32 (the
  # default) and 96: three batches' worth of answers each, after the archived ones, into /tmp
  local b
  : >"$OUT/target-answers-batch.txt"
  for b in 32 96; do
    rm -f "/tmp/answers-batch-$b.jsonl"
    $PY -m server.model_files.training.target_answers --start 10448 --limit $((3 * b)) \
      --batch $b --minutes 30 --out "/tmp/answers-batch-$b.jsonl" 2>&1 | tr '\r' '\n' \
      | grep -v '^$' | tail -n 2 | tee -a "$OUT/target-answers-batch.txt"
  done
}
run_replay_all_answers() {  # issue 10: round_replay --held-out 200 with the shipped draft,
  # then with draft_all_answers' draft: their rounds (at a fixed k, the draft model alone too)
  # on 200 held-out code answers and 100 prose ones, one run
  have_answers || return 0
  need_all_answers_draft
  $PY -m server.bench.round_replay --held-out 200 | tee "$OUT/round-replay-held-out-shipped.txt"
  $PY -m server.bench.round_replay --held-out 200 --draft-model "$ALL_ANSWERS_DRAFT" \
    | tee "$OUT/round-replay-held-out-all-answers.txt"
}
run_held_out_more_data_2() {  # issue 10: held_out_default with draft_more_data_2's draft
  have_answers || return 0
  on_smol_server models/generated/draft-4l-more-data-2 held-out-more-data-2 \
    held_out_against_plain held-out-more-data-2.txt \
    default='{"draft": "hybrid", "hybrid_min_match": 2}'
}
run_unseen_agreement() {  # issue 10: the shipped draft, draft_more_data's and draft_more_data_2's
  # agreement (distill_eval, k = 4 only) with the held-out code answers whose requests name no
  # function or class that a training request or any of $EXTRA's names: one subset for all three
  local d
  have_answers || return 0
  : >"$OUT/unseen-agreement.txt"
  for d in models/smollm2-draft models/generated/draft-4l-more-data \
    models/generated/draft-4l-more-data-2; do
    echo "== $d" | tee -a "$OUT/unseen-agreement.txt"
    $PY -m server.model_files.training.distill_eval --no-card --k 4 --draft "$d" \
      --seen-answers "$EXTRA" | tee -a "$OUT/unseen-agreement.txt"
  done
}
run_draft_all_answers_ab() {  # issue 10: draft_all_answers' draft against the shipped one,
  # taking turns through the server (draft_ab)
  need_all_answers_draft
  draft_ab "$ALL_ANSWERS_DRAFT" models/smollm2-draft draft-all-answers-ab
}
run_draft_more_data_2_ab() {  # issue 10: draft_more_data_2's draft against the shipped one,
  # taking turns through the server (draft_ab)
  draft_ab models/generated/draft-4l-more-data-2 models/smollm2-draft draft-more-data-2-ab
}
run_draft_more_data_ab() {  # issue 10: draft_more_data's draft against the shipped one (4
  # epochs over the training answers alone), taking turns through the server (draft_ab)
  draft_ab models/generated/draft-4l-more-data models/smollm2-draft draft-more-data-ab
}
run_held_out_more_data() {  # issue 10: held_out_default with draft_more_data's draft
  have_answers || return 0
  on_smol_server models/generated/draft-4l-more-data held-out-more-data \
    held_out_against_plain held-out-more-data.txt \
    default='{"draft": "hybrid", "hybrid_min_match": 2}'
}
trained_on_current_answers() {  # $1: a draft folder distill wrote from as many answers as there
  # are now in target_answers' file
  [ -f "$1/training.json" ] && $PY -c "import json, sys
from server.model_files.training.target_answers import DEFAULT_OUT
lines = sum(1 for _ in DEFAULT_OUT.open())
sys.exit(json.load(open(sys.argv[1]))['answers'] != lines)" "$1/training.json"
}
size_benches() {  # $1: draft folder, $2: tag
  local d
  for d in model hybrid; do draft_benches "$1" "$2-$d" 1,2,4 2 $d; done
}

sections=${*:-overhead smoke sweep compare demo_server temp adaptive lookup load spec_batch fused decode_profile engine_load prefill_shapes prefill_head prefix stall before structured draft_server verify_cost draft_p_min hybrid hybrid_ab hybrid_load draft_ab hybrid_k6 round_replay default_reps draft_3ep_ab hybrid_match_ab held_out_ab p_min_ab hybrid_p_min k4_p_min held_out_default}
for s in $sections; do echo "=== $s"; "run_$s"; done
