#!/usr/bin/env bash
# Everything the GPU machine must confirm for a commit, each step under its own time limit, logs in $1
# (default $OUT or ./gpu-logs). Three device calls of under 10 minutes each (H200; on two GPUs the cuda:1
# tests run too): `SHARDS=8 tools/gpu_checks.sh $OUT pytest`, `tools/gpu_checks.sh $OUT mutants,sanitize`,
# `tools/gpu_checks.sh $OUT fuzz,fuzzop,fuzzw4a16`. Measured 2026-12-01 on one H200: the suite as 4 shards
# 566 s (its largest shard 545 s), as 8 shards 422 s; GPU mutants 100 s with 4 jobs, memcheck + racecheck 170 s and
# synccheck 26 s, the W4A16 fuzz 91 s as six processes.
# STEPS: any of pytest,mutants,sanitize,fuzz,fuzzop,fuzzw4a16 (default all), routercheck (the MoE router kernel), fewctas (the experts' 4-warp rule), repro (session 66's fault:
# tools/repro_fault.sh blocking, each, plain with the DSL's own launch, memcheck-alone; each its own log),
# repromc (memcheck-cached alone), inbounds (that fault's fix: below), experts (its GPU tests and 300-case fuzz, ~5 processes) and
# the measurements bench (bench.py, the leaderboard's shapes), model (bench_model --hf, Llama-3-8B, batch 1),
# model16 / model4 (the same at batch 16 / 4), modelprefill (generate with compile_prefill=True too), prefill (tools/bench_prefill.py: W4A16 from 129 tokens),
# modellm (the same, lm_head in NVFP4 too, beside bf16), moeblock (the MoE block alone: the kernel, the
# fallback, other launch shapes; eager and compiled), tuneexperts (the experts' kernel alone, a launch at a time,
# over builds around its route: tools/tune_experts.py at 1, 4 and 16 tokens), moe (the MoE block and Qwen3-30B-A3B's decode),
# moeprofile (that model's compiled decode step, bf16 and ours: the synced loop, events, host time and
# torch.profiler's top kernels; 32 new tokens, `model.generate` and `nvfp4_gemv.generate(compile=True)`; TOKENS=, GENERATES=), load (from_pretrained of a Llama-3-8B-shaped export
# onto the GPU, then 16 tokens), load70 (the same at Llama-3-70B's shapes, 43 GB: an H200's target; needs
# 43 GB of disk and of CPU memory), each one call under 10 minutes. Prints each step's last lines.
# The pytest step runs the tests marked gpu (the CPU tests run in CI and locally); ALL=1 runs every test.
# SHARDS=N runs the suite as N concurrent pytest processes, one set of files each (logs pytest-shardI.txt;
# at most one shard a test file), then the device-memory test alone. PART=k/m (with SHARDS) runs the k-th of
# m parts of the files: on one H100 (16 cores) the whole suite as 8 shards passes 570 s (2026-12-06), so
# run PART=1/2 and PART=2/2 in two calls (the experts' fuzz left out: the experts step runs it). DEAL=N instead
# deals the GPU tests' ids round-robin over N processes (the big files' tests spread over all of them).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-gpu-logs}}
STEPS=${2:-pytest,mutants,sanitize,fuzz,fuzzop,fuzzw4a16}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
step() {  # name, seconds, command...
    local name=$1 secs=$2
    shift 2
    [[ ",$STEPS," == *",$name,"* ]] || return 0
    local t0=$(date +%s)
    timeout "$secs" "$@" > "$LOG/$name.txt" 2>&1
    local rc=$?
    echo "rc=$rc wall_s=$(( $(date +%s) - t0 ))" >> "$LOG/$name.txt"
    echo "== $name (rc $rc)"
    tail -n 4 "$LOG/$name.txt"
}
# the device machine's git may hold the landed commit, not the tree that runs: the paths differing say so
git log --oneline -1 > "$LOG/commit.txt" 2>/dev/null
echo "paths differing from it (carried folders too): $(git status --short 2>/dev/null | wc -l)" >> "$LOG/commit.txt"
nvidia-smi -L >> "$LOG/commit.txt" 2>/dev/null
python -c "import importlib.metadata as m; print('nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'))" >> "$LOG/commit.txt"
# the test that reads the device's free memory runs alone: other processes' allocations would show there
ALONE=tests/leaderboard/test_contexts.py::test_ten_thousand_calls_grow_nothing
# the experts' 300-case fuzz takes 420 s in one process (H100, 2026-12-06): the sharded suite leaves it to the
# experts step, which runs it as five processes
FUZZ=tests/model/test_experts_kernel.py::test_cuda_kernel_within_its_bound_of_float64
pytest_shards() {  # the suite split by file over $SHARDS processes (default 4; compiles are CPU-bound)
    local -a all files=() shard mark=(-m gpu)
    if [[ -n ${ALL:-} ]]; then all=($(ls -S tests/*/test_*.py)); mark=()
    else all=($(ls -S $(grep -l "mark.gpu" tests/*/test_*.py))); fi  # the CPU tests run in CI and locally
    local part=${PART:-1/1} j
    for ((j = 0; j < ${#all[@]}; j++)); do  # PART=k/m: every m-th file from the k-th (the suite over m calls)
        (( j % ${part#*/} == ${part%/*} - 1 )) && files+=("${all[j]}")
    done
    local n=$SHARDS i=0 rc=0 f pids=()
    ((n > ${#files[@]})) && n=${#files[@]}  # an empty shard would run the whole suite
    for f in "${files[@]}"; do shard[i % n]+=" $f"; i=$((i + 1)); done
    for ((i = 0; i < n; i++)); do
        python -m pytest -q -rs -p no:cacheprovider --durations=5 "${mark[@]}" --deselect "$ALONE" --deselect "$FUZZ" ${shard[i]} \
            > "$LOG/pytest-shard$i.txt" 2>&1 &
        pids+=($!)
    done
    for ((i = 0; i < n; i++)); do
        wait "${pids[i]}" || rc=1
        echo "shard $i:${shard[i]}"
        tail -n 1 "$LOG/pytest-shard$i.txt"
    done
    python -m pytest -q -p no:cacheprovider "$ALONE" > "$LOG/pytest-alone.txt" 2>&1 || rc=1
    echo "alone: $ALONE"
    tail -n 1 "$LOG/pytest-alone.txt"
    return $rc
}
pytest_dealt() {  # the suite's test ids dealt round-robin over $DEAL processes: balanced where files are not
    local n=$DEAL rc=0 i pids=() ids=() total
    if ! python -m pytest --collect-only -q -p no:cacheprovider -m gpu --deselect "$ALONE" --deselect "$FUZZ" tests \
        > "$LOG/collect.txt" 2>&1; then  # a file that fails to import would lose its tests unsaid
        echo "collection failed:"; tail -n 20 "$LOG/collect.txt"; return 1
    fi
    grep -E '^tests/.*::' "$LOG/collect.txt" > "$LOG/ids.txt"
    total=$(wc -l < "$LOG/ids.txt")
    ((total == 0)) && { echo "no GPU tests collected"; return 1; }
    ((n < 1)) && n=1
    ((n > total)) && n=$total  # a process dealt no ids would run the whole tree
    echo "$total tests dealt over $n processes"
    for ((i = 0; i < n; i++)); do
        mapfile -t ids < <(awk -v n="$n" -v i="$i" '(NR - 1) % n == i' "$LOG/ids.txt")
        python -m pytest -q -rs -p no:cacheprovider --durations=3 "${ids[@]}" > "$LOG/pytest-deal$i.txt" 2>&1 &
        pids+=($!)
    done
    for ((i = 0; i < n; i++)); do wait "${pids[i]}" || rc=1; echo "deal $i: $(tail -n 1 "$LOG/pytest-deal$i.txt")"; done
    python -m pytest -q -p no:cacheprovider "$ALONE" > "$LOG/pytest-alone.txt" 2>&1 || rc=1
    echo "alone: $(tail -n 1 "$LOG/pytest-alone.txt")"
    return $rc
}
if [[ -n ${DEAL:-} ]]; then
    step pytest 570 bash -c "$(declare -f pytest_dealt); LOG='$LOG' DEAL=$DEAL ALONE='$ALONE' FUZZ='$FUZZ' pytest_dealt"
elif [[ ${SHARDS:-1} -gt 1 ]]; then
    step pytest 570 bash -c "$(declare -f pytest_shards); LOG='$LOG' SHARDS=$SHARDS PART='${PART:-1/1}' ALL='${ALL:-}' ALONE='$ALONE' FUZZ='$FUZZ' pytest_shards"
elif [[ -n ${ALL:-} ]]; then
    step pytest 570 python -m pytest -q -rs -p no:cacheprovider
else
    step pytest 570 python -m pytest -q -rs -p no:cacheprovider -m gpu
fi
experts_tests() {  # the experts' kernel: its 300-case fuzz as 5 processes beside the act's and the other experts GPU tests
    local f=tests/model/test_experts_kernel.py::test_cuda_kernel_within_its_bound_of_float64 c rc=0 pids=()
    for c in 0 1 2 3 4; do
        python -m pytest -q -p no:cacheprovider -m gpu "$f[$((2 * c))]" "$f[$((2 * c + 1))]" \
            > "$LOG/experts-fuzz$c.txt" 2>&1 &
        pids+=($!)
    done
    # the down launch's act: its fuzz, its values bit for bit, the one-token forward (one process)
    python -m pytest -q -rs -p no:cacheprovider -m gpu tests/model/test_experts_act.py > "$LOG/experts-act.txt" 2>&1 &
    pids+=($!)
    python -m pytest -q -rs -p no:cacheprovider -m gpu tests/model/test_experts_kernel.py tests/model/test_experts.py \
        -k "not within_its_bound" > "$LOG/experts-tests.txt" 2>&1 || rc=1
    for c in 0 1 2 3 4; do wait "${pids[c]}" || rc=1; echo "fuzz $c: $(tail -n 1 "$LOG/experts-fuzz$c.txt")"; done
    wait "${pids[5]}" || rc=1
    echo "act: $(tail -n 1 "$LOG/experts-act.txt")"
    echo "tests: $(tail -n 1 "$LOG/experts-tests.txt")"
    return $rc
}
step repro 560 bash -c "for m in blocking each; do timeout 120 tools/repro_fault.sh \$m > \"$LOG/repro-\$m.txt\" 2>&1; done
    NVFP4_GEMV_LAUNCH=dsl timeout 120 tools/repro_fault.sh plain > '$LOG/repro-plain-dsl.txt' 2>&1
    timeout 190 tools/repro_fault.sh memcheck-alone > '$LOG/repro-memcheck-alone.txt' 2>&1
    tail -n 5 '$LOG'/repro-*.txt"
step repromc 560 tools/repro_fault.sh memcheck-cached
# inbounds: session 66's fault after its fix (W4A16's x load hoisted past its guard): the guard-page test, session
# 66's order (must pass) and memcheck without the caching allocator (0 memory access errors; its two tests fail
# there, since a capture cannot allocate without the caching allocator: session 70); with a tree from before the fix
# in .old (`git archive 1728538~1`), the guard-page test there too, which must fail (~2 min on one H100)
step inbounds 280 bash -c "P='python -m pytest -q -p no:cacheprovider -m gpu'
    if [[ -d .old/tests/op ]]; then cp tests/op/test_reads_in_bounds.py .old/tests/op/
        (cd .old && timeout 240 \$P tests/op/test_reads_in_bounds.py > '$LOG/inbounds-old.txt' 2>&1) & fi
    timeout 240 \$P tests/op/test_reads_in_bounds.py > '$LOG/inbounds-new.txt' 2>&1 &
    timeout 100 tools/repro_fault.sh plain > '$LOG/inbounds-repro.txt' 2>&1
    timeout 150 tools/repro_fault.sh memcheck-alone > '$LOG/inbounds-memcheck.txt' 2>&1
    wait; tail -n 2 '$LOG'/inbounds-*.txt"
step experts 300 bash -c "$(declare -f experts_tests); LOG='$LOG' experts_tests"
step mutants 240 python tools/mutants.py --gpu --jobs 4
step sanitize 420 tools/sanitize.sh
step fuzz 70 python tools/fuzz.py --cases 500 --max-values 3e7
step fuzzop 200 python tools/fuzz_op.py --cases 300 --jobs 6
step fuzzw4a16 200 python tools/fuzz_op.py --cases 300 --w4a16 --jobs 6
# measurements (not in the default STEPS; each names its raw output in $LOG)
step bench 300 python bench.py --peers-only bulk --reps 50 --out "$LOG/bench"
step model 560 python tools/bench_model.py --hf --batches 1 --tokens 64 --hf-fuse --hf-pack \
    --hf-variants bf16,int4,w4a16 --json "$LOG/model-hf-b1.json"
# batches 4 and 16 (session 71's commands: batch 16 with the compiled nvfp4_gemv.generate, ~6 min; batch 4
# model.generate only, ~2.5 min; two calls on one H100)
step model16 560 python tools/bench_model.py --hf --batches 16 --tokens 64 --hf-fuse --hf-pack \
    --hf-variants bf16,int4,w4a16 --hf-generate generate_ms,ours_generate_compiled_ms --json "$LOG/model-hf-b16.json"
step model4 560 python tools/bench_model.py --hf --batches 4 --tokens 64 --hf-fuse --hf-pack --hf-no-step \
    --hf-variants bf16,int4,w4a16 --hf-generate generate_ms --json "$LOG/model-hf-b4.json"
# modelprefill: nvfp4_gemv.generate with the prefill compiled too (compile_prefill=True) beside the compiled step
# alone and model.generate, batch 1, bf16 and ours (whole generations only: no compiled step of the bench's own)
step modelprefill 560 python tools/bench_model.py --hf --batches 1 --tokens 64 --hf-fuse --hf-pack --hf-no-step \
    --hf-variants bf16,w4a16 --hf-generate generate_ms,ours_generate_compiled_ms,ours_generate_all_compiled_ms \
    --json "$LOG/model-hf-b1-prefill.json"
step prefill 300 python tools/bench_prefill.py --reps 10 --out "$LOG/prefill"
step modellm 560 python tools/bench_model.py --hf --batches 1 --tokens 64 --hf-fuse --hf-pack --hf-lm-head \
    --hf-variants bf16,w4a16 --json "$LOG/model-hf-b1-lmhead.json"
step tuneexperts 400 python tools/tune_experts.py --tokens 1,4,16 --out "$LOG/tune-experts"
step moeblock 400 bash -c "python tools/bench_moe.py --tokens 1,4,16,64 --fallback --busy 0.5,1,2 --profile --out '$LOG/moe-block' \
    && python tools/bench_moe.py --tokens 1,4,16,64 --compile --out '$LOG/moe-block-compiled'"
step moe 560 bash -c "python tools/bench_moe.py --tokens 1,4,16,64 --out '$LOG/moe-block' && python tools/bench_model.py \
    --hf --arch qwen3-moe --batches 1 --tokens 32 --hf-fuse --hf-no-step --hf-variants bf16,w4a16 --json '$LOG/moe-hf.json'"
step moeprofile 560 python tools/bench_model.py --hf --arch qwen3-moe --batches 1 --tokens ${TOKENS:-32} --hf-fuse \
    --hf-variants bf16,w4a16 --hf-profile 5 --hf-prefill-profile 2 --hf-generate ${GENERATES:-generate_ms,ours_generate_compiled_ms} --json "$LOG/moe-profile.json"
# routercheck: the routing op's GPU tests, its seven GPU mutants and tools/bench_router.py, then the same with
# --counter (the counter build at E <= 256 too: the cluster build's A/B, a process of its own)
step routercheck 300 bash -c "timeout 150 python -m pytest -q -p no:cacheprovider -m gpu -rs tests/op/test_router_kernel.py \
    > '$LOG/router-tests.txt' 2>&1 & p=\$!; timeout 150 python tools/mutants.py --jobs 4 --only 'router kernel: ties to the higher expert' \
    --only 'router kernel: renormalisation dropped' --only 'router kernel: the first CTA to finish takes the top k' \
    --only 'router kernel: fp16 keys decoded as bf16' --only 'router kernel: -0 keyed below +0' \
    --only 'router kernel cluster: CTA 1 takes the top k from its own shared memory' \
    --only \"router kernel cluster: each key stored in the storing CTA's own shared memory\" > '$LOG/router-mutants.txt' 2>&1; m=\$?; wait \$p; t=\$?
    timeout 70 python tools/bench_router.py --tokens 1,16 --reps 30 --out '$LOG/router-bench' > '$LOG/router-bench.txt' 2>&1
    b=\$?; timeout 70 python tools/bench_router.py --counter --tokens 1,16 --reps 30 --out '$LOG/router-bench-counter' \
    > '$LOG/router-bench-counter.txt' 2>&1; c=\$?; tail -n 2 '$LOG/router-tests.txt'; tail -n 8 '$LOG/router-mutants.txt'
    grep '^{' '$LOG/router-bench.txt' '$LOG/router-bench-counter.txt'
    exit \$((t | m | b | c))"
# prefetchcheck: the experts' gate/up launch prefetching down's bytes and the kernel on int64 ids (session 74): their
# GPU tests beside the experts' and act's (fuzz deselected), the two int64-ids GPU mutants and the router's and experts' sanitizer cases, then bench_moe at one token alone (the
# block with and without the prefetch in one process). With routercheck: `routercheck,prefetchcheck`, one call
step prefetchcheck 290 bash -c "P='python -m pytest -q -p no:cacheprovider -m gpu -rs'
    timeout 180 \$P tests/model/test_experts_prefetch.py tests/model/test_experts_ids64.py tests/model/test_experts.py \
        tests/model/test_experts_act.py tests/model/test_experts_kernel.py -k 'not within_its_bound' \
        > '$LOG/prefetch-tests.txt' 2>&1 & p=\$!
    timeout 180 python tools/mutants.py --jobs 2 --only \"experts ids64: the id's high word not checked\" \
        --only 'experts ids64: ids compared signed' > '$LOG/ids64-mutants.txt' 2>&1 & r=\$!
    (for t in memcheck racecheck synccheck; do PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 55 compute-sanitizer --tool \$t \
        python3 tools/sanitize_cases.py router > '$LOG/san-router-'\$t.txt 2>&1; done) & q=\$!
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 180 compute-sanitizer --tool memcheck python3 tools/sanitize_cases.py experts \
        > '$LOG/san-experts-memcheck.txt' 2>&1; wait \$p; t=\$?; wait \$q; wait \$r; u=\$?
    timeout 90 python tools/bench_moe.py --tokens 1 --reps 30 --out '$LOG/moe-block-prefetch' > '$LOG/moe-prefetch.txt' 2>&1
    tail -n 2 '$LOG/prefetch-tests.txt'; tail -n 4 '$LOG/ids64-mutants.txt'
    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' '$LOG'/san-*.txt; grep '^T=' '$LOG/moe-prefetch.txt'
    exit \$((t | u))"
# fewctas: the experts' 4-warp rule (session 76): its GPU test (the fuzz generator's cases it routes, three
# processes; each must report passed), then the 16-token sweep in rounds (the rule's build beside the plain
# route's threads=256 and the other knobs)
step fewctas 280 bash -c "P=tests/model/test_experts_launch_shape.py::test_cuda_four_warp_launches_within_their_bound_of_float64
    pids=(); for p in 0 1 2; do timeout 110 python -m pytest -q -p no:cacheprovider -m gpu \"\$P[\$p]\" \
        > '$LOG/fewctas-t'\$p.txt 2>&1 & pids+=(\$!); done
    rc=0; for q in \${pids[@]}; do wait \$q || rc=1; done
    for p in 0 1 2; do tail -n 1 '$LOG/fewctas-t'\$p.txt; grep -q ' passed' '$LOG/fewctas-t'\$p.txt || rc=1; done
    timeout 150 python tools/tune_experts.py --tokens 16 --rounds 3 --out '$LOG/tune-fewctas' > '$LOG/tune-fewctas.txt' 2>&1 || rc=1
    grep -v '^{' '$LOG/tune-fewctas.txt' | tail -n 36; exit \$rc"
step load 560 python tools/bench_load.py --device cuda --loader from_pretrained --fuse --pack --layers 32 --hidden 4096 \
    --intermediate 14336 --heads 32 --kv-heads 8 --vocab 128256 --generate 16 --json "$LOG/load-8b.json"
step load70 560 python tools/bench_load.py --device cuda --loader from_pretrained --fuse --pack --layers 80 --hidden 8192 \
    --intermediate 28672 --heads 64 --kv-heads 8 --vocab 128256 --reps 1 --generate 16 --json "$LOG/load-70b.json"
