#!/usr/bin/env bash
# Exports branches (or any commits) as source trees under variants/<name>, for
# benchmarks/ab_on_device.sh to build and benchmark side by side in one device call:
#   bash benchmarks/make_variants.sh fused-release-arrivals bulk-push-pipeline
# With --build each tree is built here instead, against this machine's Python (PYTHON=...; its
# jaxlib and nvidia-nvshmem must be the device's versions, or the extension will not load
# there), and only its extension is kept, as variants/<name>.so, for benchmarks/ab_prebuilt.sh:
# no device time goes to building.
#   PYTHON=/path/to/venv/bin/python bash benchmarks/make_variants.sh --build main my-branch
# variants/ is ignored by git: pass it to the device tool as a carried path.
set -euo pipefail
cd "$(dirname "$0")/.."
build=
if [[ ${1:-} == --build ]]; then build=1; shift; fi
PY=${PYTHON:-$(command -v python3)}
for ref in "$@"; do
  name=${ref//\//_}
  rm -rf "variants/$name"
  mkdir -p "variants/$name"
  git archive "$ref" | tar -x -C "variants/$name"
  echo "variants/$name <- $(git rev-parse --short "$ref") $(git log -1 --format=%s "$ref" | cut -c1-70)"
  if [[ -n $build ]]; then
    cmake -S "variants/$name" -B "variants/$name/build" -G Ninja -DPython_EXECUTABLE="$PY" \
      -DJAX_EP_NATIVE=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
    ninja -C "variants/$name/build" >/dev/null
    cp "variants/$name"/build/_C*.so "variants/$name.so"
    rm -rf "variants/$name"
    echo "  built: variants/$name.so ($(du -m "variants/$name.so" | cut -f1) MB)"
  fi
done
