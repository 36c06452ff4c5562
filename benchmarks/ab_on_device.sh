#!/usr/bin/env bash
# On the device: the intranode (and optionally low-latency) benchmark of this checkout and of
# every tree under variants/ (benchmarks/make_variants.sh), each built against the machine's
# jax/NVSHMEM (all builds at once, then the benchmarks one after the other), in one call.
# Logs in $OUT/ab/<name>.
#   bash benchmarks/ab_on_device.sh [gpus] [bench_intranode args, or none] [ll]
# AB_PASSES=p runs the benchmarks of all trees p times over (interleaved: drift shows).
# AB_OVERLAP=1 adds benchmarks/overlap_schedules.py (a jax_ep call beside independent work).
# AB_ENVS="VAR=value ..." adds runs of the checkout under each setting (see below).
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-2}
ARGS=${2:---modes fused --skip-baselines}
LL=${3:-}
OUT=${OUT:-$PWD/out}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 JAX_EP_TIMEOUT_S=${JAX_EP_TIMEOUT_S:-20}
PY=$(command -v python3)
trees=(.)
for tree in variants/*/; do [[ -f $tree/CMakeLists.txt ]] && trees+=("${tree%/}"); done
name_of() { [[ $1 == . ]] && echo checkout || basename "$1"; }
jobs=$(( $(nproc) / ${#trees[@]} )); (( jobs < 2 )) && jobs=2
echo "=== building ${#trees[@]} trees, $jobs jobs each ($(date +%T))"
for tree in "${trees[@]}"; do
  log=$OUT/ab/$(name_of "$tree"); mkdir -p "$log"
  (cd "$tree" &&
    cmake -S . -B build/device -G Ninja -DPython_EXECUTABLE="$PY" -DJAX_EP_NATIVE=ON \
      -DCMAKE_BUILD_TYPE=Release >"$log/build.log" 2>&1 &&
    ninja -j "$jobs" -C build/device >>"$log/build.log" 2>&1 && cp build/device/_C*.so jax_ep/ &&
    touch "$log/built") &
done
wait
# AB_ENVS="VAR=value ...": the checkout runs again under each setting (a runtime switch timed
# against the same build), as run "checkout+VAR=value".
runs=("${trees[@]}")
for setting in ${AB_ENVS:-}; do runs+=(".+$setting"); done
for pass in $(seq "${AB_PASSES:-1}"); do
for run in "${runs[@]}"; do
  tree=${run%%+*}; setting=; [[ $run == *+* ]] && setting=${run#*+}
  name=$(name_of "$tree")${setting:++$setting}; log=$OUT/ab/$name; built=$OUT/ab/$(name_of "$tree")
  mkdir -p "$log"
  echo; echo "=== $name, pass $pass ($(date +%T))"
  [[ -f $built/built ]] || { echo "build failed"; tail -20 "$built/build.log"; continue; }
  if [[ $ARGS != none ]]; then
    (cd "$tree" && export ${setting:-AB_UNSET=} && PYTHONPATH=$PWD timeout 240 $PY -m jax_ep.launch -n "$N" \
      benchmarks/bench_intranode.py --profile $ARGS 2>&1 | tee "$log/bench_intranode_$pass.log" |
      grep -E "^\[rank 0\] (\| jax|[a-z_A-Z0-9].*: cycle|    [a-z].* [0-9.]+,|.*FAILED)" | sed 's/^\[rank 0\] //')
  fi
  if [[ -n ${AB_OVERLAP:-} ]]; then  # AB_OVERLAP=1: the call-and-work arrangements as well
    (cd "$tree" && export ${setting:-AB_UNSET=} && PYTHONPATH=$PWD timeout 240 $PY -m jax_ep.launch -n "$N" \
      benchmarks/overlap_schedules.py --show-schedule 0 2>&1 | tee "$log/overlap_$pass.log" |
      grep -E "^\[rank 0\] .*µs per call|FAILED" | sed 's/^\[rank 0\] //')
  fi
  if [[ -n $LL ]]; then
    (cd "$tree" && export ${setting:-AB_UNSET=} && PYTHONPATH=$PWD timeout 200 $PY -m jax_ep.launch -n "$N" \
      benchmarks/bench_low_latency.py --profile 2>&1 | tee "$log/bench_low_latency_$pass.log" |
      grep -E "^\[rank 0\] (\| jax|[a-z_A-Z0-9].*: cycle|    [a-z].* [0-9.]+,|    ll_.*/|.*FAILED)" | sed 's/^\[rank 0\] //')
  fi
done
done
