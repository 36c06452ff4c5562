#!/usr/bin/env bash
# On the device: extensions built elsewhere (benchmarks/make_variants.sh --build, carried as
# variants/<name>.so) timed side by side in one call, each swapped into this checkout's
# jax_ep/ in turn. Each argument is a run, name[:VAR=value[,VAR=value]]; runs alternate in
# the order given (list a build twice to see the drift). Logs in $OUT/ab/<i>_<name>.log.
#   AB_BENCH="benchmarks/bench_low_latency.py --rows 'independent matmul alone' --repeats 2" \
#     AB_TESTS="-k low_latency" AB_TEST_BUILD=my-branch bash benchmarks/ab_prebuilt.sh main my-branch main my-branch
# AB_TESTS runs tests/test_gpu.py with those pytest arguments on AB_TEST_BUILD first; N=ranks.
set -uo pipefail
cd "$(dirname "$0")/.."
N=${N:-2}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/ab"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export JAX_EP_TIMEOUT_S=${JAX_EP_TIMEOUT_S:-20}
PY=$(command -v python3)
SO=$($PY -c "import sysconfig; print('jax_ep/_C' + sysconfig.get_config_var('EXT_SUFFIX'))")
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c
use() { [[ -f variants/$1.so ]] || { echo "no variants/$1.so"; return 1; }; cp "variants/$1.so" "$SO"; }
if [[ -n ${AB_TESTS:-} ]]; then
  echo "=== tests on ${AB_TEST_BUILD:?AB_TEST_BUILD names the build} ($(date +%T))"
  if use "$AB_TEST_BUILD"; then
    eval "timeout ${AB_TEST_TIMEOUT:-300} $PY -m jax_ep.launch -n $N -- -m pytest -q \
      -p no:cacheprovider --capture=sys tests/test_gpu.py $AB_TESTS" >"$OUT/ab/tests.log" 2>&1
    echo "rc=$?"; grep -E "^\[rank 0\].*(passed|failed|skipped)|FAILED" "$OUT/ab/tests.log" | tail -8
  fi
fi
i=0
for run in "$@"; do
  i=$((i + 1)); name=${run%%:*}; settings=; [[ $run == *:* ]] && settings=${run#*:}
  echo; echo "=== $i $run ($(date +%T))"
  use "$name" || continue
  log=$OUT/ab/${i}_$name.log
  (export ${settings//,/ } AB_UNSET=; eval "timeout ${AB_TIMEOUT:-240} $PY -m jax_ep.launch -n $N \
    ${AB_BENCH:?AB_BENCH names the benchmark and its arguments}") >"$log" 2>&1
  grep -E "^\[rank 0\] (\| [a-zA-Z]|.*FAILED|jax_ep._C)" "$log" | grep -v "| operation" | sed 's/^\[rank 0\] //' |
    cut -c1-140
done
