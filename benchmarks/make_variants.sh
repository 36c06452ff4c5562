#!/usr/bin/env bash
# Exports branches (or any commits) as source trees under variants/<name>, for
# benchmarks/ab_on_device.sh to build and benchmark side by side in one device call:
#   bash benchmarks/make_variants.sh fused-release-arrivals bulk-push-pipeline
# variants/ is ignored by git: pass it to the device tool as a carried path.
set -euo pipefail
cd "$(dirname "$0")/.."
for ref in "$@"; do
  name=${ref//\//_}
  rm -rf "variants/$name"
  mkdir -p "variants/$name"
  git archive "$ref" | tar -x -C "variants/$name"
  echo "variants/$name <- $(git rev-parse --short "$ref") $(git log -1 --format=%s "$ref" | cut -c1-70)"
done
