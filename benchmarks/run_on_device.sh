#!/usr/bin/env bash
# One device call: build the extension against the machine's own jax/NVSHMEM, run the GPU
# suite through the launcher on all GPUs, then the benchmarks. Logs go to $OUT (or ./out).
#   [GPUS=g] [PART=i/k] bash benchmarks/run_on_device.sh [ranks] [what: prebuilt,build,test,copytest,slotstest,slotsweep,lltest,bench,sweep,variants,ll,graphs,storeprobe,copyprobe,layoutprobe,overlap,trace,gemm,moelayer,decodelayer,example]
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-$(nvidia-smi -L | grep -c '^GPU ')}
WHAT=${2:-build,test,bench,ll,example}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
# ranks sharing a GPU take turns on it: their waits for each other last longer
export JAX_EP_TIMEOUT_S=${JAX_EP_TIMEOUT_S:-${GPUS:+60}} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_EP_TIMEOUT_S=${JAX_EP_TIMEOUT_S:-20}
PY=$(command -v python3)
# GPUS=G below N: the N ranks share G GPUs (correctness only, see jax_ep/launch.py)
SHARE=${GPUS:+--gpus $GPUS}
# and their tests take about twice as long (the launcher now really stops them at a timeout)
SLOW=${GPUS:+2}; SLOW=${SLOW:-1}
status=0
# The GPU suites run with --capture=sys: pytest's default captures file descriptor 2 per test,
# and a rank that aborts (an XLA check, NVSHMEM) takes its message with it
step() { echo; echo "=== $* ($(date +%T))"; }
if [[ ,$WHAT, == *,prebuilt,* ]]; then  # an extension built elsewhere for this Python, carried
  step "prebuilt extension"
  nvidia-smi -L
  ls -l jax_ep/_C*.so && $PY -c "from jax_ep import _native; m, why = _native.load(); print(m or why)"
  $PY -m pytest -q tests/test_native_build.py 2>&1 | tail -2
fi
if [[ ,$WHAT, == *,build,* ]]; then
  step build
  nvidia-smi -L
  $PY -c "import jax, nvidia.nvshmem as m; print('jax', jax.__version__, 'nvshmem', list(m.__path__))"
  cmake -S . -B build/device -G Ninja -DPython_EXECUTABLE="$PY" -DJAX_EP_NATIVE=ON \
      -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    ninja -C build/device >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  cp build/device/_C*.so jax_ep/
  grep -E "jax_ep:" "$OUT/build.log"
  JAX_EP_FAILURE_LOG=$OUT/failure_probe.log $PY -m pytest -q tests/test_native_build.py \
    tests/test_gpu_failures.py 2>&1 | tail -3
  grep -E "jax_ep|initialised|compiled|failed|launch" $OUT/failure_probe.log 2>/dev/null | head -20
fi
if [[ ,$WHAT, == *,test,* ]]; then
  # PART=i/k: the i-th of k consecutive slices of the suite's tests (ranks sharing one GPU
  # take longer than one device call for the whole suite)
  TESTS=(tests/test_gpu.py)
  if [[ -n ${PART:-} ]]; then
    mapfile -t TESTS < <($PY -m pytest --collect-only -q -p no:cacheprovider tests/test_gpu.py 2>/dev/null |
      grep "::" | awk -v part="$PART" 'BEGIN { split(part, p, "/") } { id[NR] = $0 }
        END { per = int((NR + p[2] - 1) / p[2]); for (j = (p[1] - 1) * per + 1; j <= p[1] * per && j <= NR; ++j) print id[j] }')
  fi
  step "GPU suite on $N GPUs${PART:+, part $PART: ${#TESTS[@]} tests}"
  timeout $((420 * SLOW)) $PY -m jax_ep.launch -n "$N" $SHARE -- -m pytest -q -p no:cacheprovider --capture=sys "${TESTS[@]}" \
    2>&1 | tee "$OUT/gpu_suite_$N${PART:+_${PART/\//of}}.log" | grep -E "passed|failed|error|Error|FAILED|timed out|\[rank 0\] [^ ]*$" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $WHAT == *copytest* ]]; then  # the copy-engine paths' part of the suite only
  step "copy-engine GPU tests on $N ranks"
  timeout $((200 * SLOW)) $PY -m jax_ep.launch -n "$N" $SHARE -- -m pytest -q -p no:cacheprovider --capture=sys \
    tests/test_gpu.py -k "copy" 2>&1 | tee "$OUT/gpu_suite_copy_$N.log" |
    grep -E "passed|failed|FAILED|Error|timed out" | tail -20
  status=${PIPESTATUS[0]}
fi
if [[ $WHAT == *slotstest* ]]; then  # the source_slots layout and the copy-engine paths
  step "source_slots and copy-engine GPU tests on $N ranks"
  timeout $((300 * SLOW)) $PY -m jax_ep.launch -n "$N" $SHARE -- -m pytest -q -p no:cacheprovider --capture=sys \
    tests/test_gpu.py -k "source_slots or copy" 2>&1 | tee "$OUT/gpu_suite_slots_$N.log" |
    grep -E "passed|failed|FAILED|Error|timed out" | tail -20
  status=${PIPESTATUS[0]}
fi
if [[ $WHAT == *lltest* ]]; then  # the low-latency part of the suite only
  step "low-latency GPU tests on $N GPUs"
  timeout 200 $PY -m jax_ep.launch -n "$N" $SHARE -- -m pytest -q -p no:cacheprovider --capture=sys tests/test_gpu.py \
    -k "low_latency or runs_once" 2>&1 | tee "$OUT/gpu_suite_ll_$N.log" |
    grep -E "passed|failed|FAILED|Error|timed out" | tail -12
  status=${PIPESTATUS[0]}
fi
if [[ $WHAT == *bench* ]]; then
  step "intranode benchmark on $N GPUs"
  timeout 300 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/bench_intranode.py --profile ${BENCH_ARGS:-} 2>&1 |
    tee "$OUT/bench_intranode_$N.log" | grep -E "^\[rank 0\] (\||[0-9]|.*FAILED|Kernel|jax_ep|    )" |
    sed 's/^\[rank 0\] //'
  # ragged_all_to_all runs only within one process: the same routing, one process, all GPUs
  timeout 200 $PY benchmarks/bench_intranode.py --baselines-only 2>&1 |
    tee "$OUT/bench_baselines_$N.log" | grep -E "^(\||[0-9]|.*FAILED)"
fi
if [[ ,$WHAT, == *,sweep,* ]]; then
  for blocks in ${SWEEP_BLOCKS:-24 32 128}; do
    step "intranode benchmark on $N GPUs, JAX_EP_NUM_BLOCKS=$blocks"
    JAX_EP_NUM_BLOCKS=$blocks timeout 200 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/bench_intranode.py \
      --skip-baselines ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/bench_blocks_${blocks}_$N.log" |
      grep -E "^\[rank 0\] \| jax_ep (dispatch BF16 \[|dispatch FP8|combine)|FAILED" | sed 's/^\[rank 0\] //'
  done
fi
if [[ $WHAT == *slotsweep* ]]; then  # copy-engine paths by chunk size
  for mb in ${SWEEP_CHUNK_MB:-8 16}; do
    step "copy-engine paths on $N GPUs, JAX_EP_COPY_CHUNK_MB=$mb"
    JAX_EP_COPY_CHUNK_MB=$mb timeout 150 $PY -m jax_ep.launch -n "$N" \
      $SHARE benchmarks/bench_intranode.py --skip-baselines --rounds 2 --repeats 3 --profile \
      --modes ${SWEEP_MODES:-slots,copy} --combine-modes copy 2>&1 |
      tee "$OUT/bench_chunks_mb_${mb}_$N.log" |
      grep -E "^\[rank 0\] (\| jax_ep (dispatch|combine)|.*FAILED|jax_ep .*cycle)" | sed 's/^\[rank 0\] //'
  done
fi
if [[ $WHAT == *variants* ]]; then
  for variant in "--routing zipf" "--routing hot" "--hidden 4096" "--hidden 2048"; do
    step "intranode benchmark on $N GPUs, $variant"
    timeout 200 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/bench_intranode.py $variant ${VARIANT_ARGS:-} 2>&1 |
      tee -a "$OUT/bench_variants_$N.log" |
      grep -E "^\[rank 0\] (\| jax|\| jax.lax|[0-9]×|.*FAILED)" | grep -v "expert_major\|pull" |
      sed 's/^\[rank 0\] //'
  done
fi
if [[ ,$WHAT, == *,ll,* ]]; then
  step "low-latency benchmark on $N GPUs"
  timeout 200 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/bench_low_latency.py --profile 2>&1 |
    tee "$OUT/bench_low_latency_$N.log" | grep -E "^\[rank [0-9]+\] (\||[0-9]|.*FAILED|Kernel|jax_ep|    )" |
    grep -v "^\[rank [1-9][0-9]*\] |"
  # ragged_all_to_all runs only within one process: the same routing, one process, all GPUs
  timeout 200 $PY benchmarks/bench_low_latency.py --baselines-only 2>&1 |
    tee "$OUT/bench_low_latency_baselines_$N.log" | grep -E "^(\||[0-9]|.*FAILED)"
fi
if [[ $WHAT == *graphs* ]]; then
  step "low-latency GPU tests with JAX_EP_COMMAND_BUFFERS=1 on $N GPUs"
  JAX_EP_COMMAND_BUFFERS=1 timeout 200 $PY -m jax_ep.launch -n "$N" $SHARE -- -m pytest -q -p no:cacheprovider --capture=sys \
    tests/test_gpu.py -k "low_latency or runs_once" 2>&1 | tee "$OUT/gpu_suite_graphs_$N.log" |
    grep -E "passed|failed|FAILED|timed out" | tail -8
  step "low-latency benchmark on $N GPUs, JAX_EP_COMMAND_BUFFERS=1 (calls recorded into CUDA graphs)"
  JAX_EP_COMMAND_BUFFERS=1 timeout 200 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/bench_low_latency.py \
    2>&1 | tee "$OUT/bench_low_latency_graphs_$N.log" | grep -E "^\[rank 0\] (\||.*FAILED)" |
    sed 's/^\[rank 0\] //'
fi
if [[ $WHAT == *storeprobe* ]]; then  # NVLink write throughput by instruction kind and CTAs
  step "NVLink store probe on $N GPUs"
  NV=$($PY -c "import nvidia.nvshmem as m; print(m.__path__[0])")
  nvcc -O3 -rdc=true -arch=sm_90 -I"$NV/include" benchmarks/nvlink_store_probe.cu \
    -o build/nvlink_store_probe -L"$NV/lib" -l:libnvshmem_host.so.3 -lnvshmem_device \
    -Xlinker -rpath="$NV/lib" && {
    rm -f /tmp/jax_ep_probe_uid
    (for ((r = 0; r < N; r++)); do
       NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_REMOTE_TRANSPORT=none timeout 120 \
         build/nvlink_store_probe "$r" "$N" /tmp/jax_ep_probe_uid &
     done
     wait) 2>&1 | tee "$OUT/store_probe_$N.log"
  }
fi
if [[ $WHAT == *copyprobe* ]]; then  # local row copies by instruction kind and CTAs (one GPU)
  step "local copy probe"
  nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/local_copy_probe.cu -o build/local_copy_probe &&
    timeout 120 build/local_copy_probe 2>&1 | tee "$OUT/local_copy_probe.log"
fi
if [[ $WHAT == *layoutprobe* ]]; then  # the layout kernel alone, graphs of launches (one GPU)
  step "layout probe"
  nvcc -O3 -arch=sm_90a -std=c++17 -Iffi benchmarks/layout_probe.cu -o build/layout_probe &&
    timeout 60 build/layout_probe 2>&1 | tee "$OUT/layout_probe.log"
fi
if [[ ,$WHAT, == *,overlap,* ]]; then  # which arrangement of call and work overlaps
  step "jax_ep calls beside an independent matmul, by stream arrangement, on $N GPUs"
  timeout 240 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/overlap_schedules.py 2>&1 |
    tee "$OUT/overlap_$N.log" | grep -E "^\[rank 0\] (.*µs per call|    %)" | sed 's/^\[rank 0\] //'
fi
if [[ ,$WHAT, == *,trace,* ]]; then  # the GPU timeline of chained calls (CUPTI, rank 0)
  step "GPU timeline of chained calls on $N GPUs"
  timeout 240 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/trace_calls.py ${TRACE_ARGS:-} 2>&1 |
    tee "$OUT/trace_$N.log" | grep -E "^\[rank 0\] ( |=|[a-z_0-9]+: )" | sed 's/^\[rank 0\] //' | cut -c1-160
  step "GPU timeline, low-latency rows with JAX_EP_COMMAND_BUFFERS=1"
  JAX_EP_COMMAND_BUFFERS=1 timeout 120 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/trace_calls.py \
    --rows ll_fp8,ll_split 2>&1 | tee "$OUT/trace_graphs_$N.log" |
    grep -E "^\[rank 0\] ( |=|[a-z_0-9]+: )" | sed 's/^\[rank 0\] //' | cut -c1-160
fi
if [[ ,$WHAT, == *,gemm,* ]]; then  # expert GEMMs on one GPU: tests, then the table
  step "expert GEMM tests and benchmark on one GPU"
  CUDA_VISIBLE_DEVICES=0 JAX_PLATFORMS=cuda timeout 200 $PY -m pytest -q -p no:cacheprovider \
    tests/test_experts.py 2>&1 | tee "$OUT/gemm_tests.log" | tail -4
  CUDA_VISIBLE_DEVICES=0 timeout 280 $PY benchmarks/bench_expert_gemm.py ${GEMM_ARGS:-} 2>&1 |
    tee "$OUT/bench_expert_gemm.log" | grep -vE "^(WARNING|I0000|W0000)"
fi
if [[ ,$WHAT, == *,moelayer,* ]]; then  # one MoE layer's training step, four ways of EP
  step "MoE layer step on $N GPUs"
  timeout 300 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/bench_moe_layer.py ${LAYER_ARGS:-} \
    2>&1 | tee "$OUT/bench_moe_layer_$N.log" | grep -E "^\[rank 0\]" | sed 's/^\[rank 0\] //'
fi
if [[ ,$WHAT, == *,decodelayer,* ]]; then  # one MoE decode layer, five ways of EP
  step "MoE decode layer on $N GPUs"
  timeout 300 $PY -m jax_ep.launch -n "$N" $SHARE benchmarks/bench_decode_layer.py \
    ${DECODE_ARGS:-} 2>&1 | tee "$OUT/bench_decode_layer_$N.log" | grep -E "^\[rank 0\]" |
    sed 's/^\[rank 0\] //'
  # ragged_all_to_all runs only within one process: the same layer, one process, all GPUs
  timeout 200 $PY benchmarks/bench_decode_layer.py --ways c,d ${DECODE_ARGS:-} 2>&1 |
    tee "$OUT/bench_decode_layer_c_$N.log" | grep -E "^(\||\(|[0-9])"
fi
if [[ $WHAT == *example* && -n ${GPUS:-} ]]; then
  step "training example skipped: its XLA collectives (NCCL) need one GPU per rank"
elif [[ $WHAT == *example* ]]; then
  step "training example on $N GPUs"
  timeout 200 $PY -m jax_ep.launch -n "$N" $SHARE examples/moe_layer.py --backend cuda --steps 5 \
    --experts 16 2>&1 | tee "$OUT/example_$N.log" | grep "\[rank 0\]" | tail -8
fi
if [[ $WHAT == *example* ]]; then  # no collective of XLA's: it runs on shared GPUs too
  step "decode example on $N ranks"
  timeout 240 $PY -m jax_ep.launch -n "$N" $SHARE examples/decode_overlap.py --backend cuda \
    --tokens 128 --hidden 7168 --ffn 2048 --experts 16 --top-k 8 2>&1 |
    tee "$OUT/decode_example_$N.log" | grep "\[rank 0\] [a-z0-9]" | tail -6
fi
exit $status
