#!/usr/bin/env bash
# On the device: the intranode (and optionally low-latency) benchmark of this checkout and of
# every tree under variants/ (benchmarks/make_variants.sh), each built against the machine's
# jax/NVSHMEM, one after the other in one call. Logs in $OUT/ab/<name>.
#   bash benchmarks/ab_on_device.sh [gpus] [bench_intranode args] [ll]
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-2}
ARGS=${2:---modes push,fused --skip-baselines}
LL=${3:-}
OUT=${OUT:-$PWD/out}
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 JAX_EP_TIMEOUT_S=${JAX_EP_TIMEOUT_S:-20}
PY=$(command -v python3)
for tree in . variants/*/; do
  [[ -f $tree/CMakeLists.txt ]] || continue
  name=$(basename "$(cd "$tree" && pwd)")
  [[ $tree == . ]] && name=checkout
  log=$OUT/ab/$name
  mkdir -p "$log"
  echo; echo "=== $name ($(date +%T))"
  (cd "$tree" &&
    cmake -S . -B build/device -G Ninja -DPython_EXECUTABLE="$PY" -DJAX_EP_NATIVE=ON \
      -DCMAKE_BUILD_TYPE=Release >"$log/build.log" 2>&1 &&
    ninja -C build/device >>"$log/build.log" 2>&1 && cp build/device/_C*.so jax_ep/) ||
    { echo "build failed"; tail -20 "$log/build.log"; continue; }
  (cd "$tree" && PYTHONPATH=$PWD timeout 240 $PY -m jax_ep.launch -n "$N" \
    benchmarks/bench_intranode.py --profile $ARGS 2>&1 | tee "$log/bench_intranode.log" |
    grep -E "^\[rank 0\] (\| jax|Timeline|.*FAILED)" | sed 's/^\[rank 0\] //')
  if [[ -n $LL ]]; then
    (cd "$tree" && PYTHONPATH=$PWD timeout 200 $PY -m jax_ep.launch -n "$N" \
      benchmarks/bench_low_latency.py --profile 2>&1 | tee "$log/bench_low_latency.log" |
      grep -E "^\[rank 0\] (\| jax|Timeline|.*FAILED)" | sed 's/^\[rank 0\] //')
  fi
done
