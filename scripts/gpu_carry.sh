#!/usr/bin/env bash
# Getting MLX's CUDA backend, mlxlis's dependencies, the tiny checkpoints and catalog GGUFs onto a
# lent GPU machine that can fetch nothing, in calls of at most 64 MiB each, then the one run of
# scripts/gpu_check.py (issue 60).
#
#   here:        scripts/gpu_carry.sh prepare [CATALOG_NAME...]   (default: smollm2-135m)
#                  downloads mlx==0.32.4 (cp312) and mlx-cuda-13==0.32.4 (90 MB: split into 46 MB
#                  parts), the cp312 wheels of mlxlis's runtime dependencies and mlx-lm (the
#                  versions of this venv), builds the tiny checkpoints (scripts/fingerprint.py's),
#                  splits the GGUFs, and packs it all into gpu-carry/call1 .. callN (each under
#                  CALL_MB, default 52; ignored by git); prints the N device calls to make.
#   on the GPU:  scripts/gpu_carry.sh receive K   (call K < N, carry gpu-carry/callK: copies it to
#                  /tmp/carry; make call K+1 while the machine is still warm)
#                scripts/gpu_carry.sh finish N [gpu_check.py args]   (the last call, carry
#                  gpu-carry/callN: receives it, joins the parts, installs the wheels with
#                  pip install --no-index --no-deps --target /tmp/site, and runs the check,
#                  writing to $OUT)
#   here:        scripts/gpu_carry.sh dry-run   (the same install-less path on this CPU: the
#                  check with --dry-run, from what prepare built)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CARRY=$ROOT/gpu-carry
CALL_MB=${CALL_MB:-52}  # + the working tree (about 6 MB) stays under a call's 64 MiB
DEST=${DEST:-/tmp/carry}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
MLX_VERSION=0.32.4
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64
  manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
# mlxlis's runtime dependencies that a Python with torch and transformers may lack (mlx-lm for
# the comparison); numpy, torch and transformers' own are left to the machine
DEPS=(gguf sentencepiece llguidance fastapi starlette pydantic pydantic-core annotated-types
  typing-inspection uvicorn h11 click anyio prometheus-client protobuf pillow rich
  markdown-it-py mdurl pygments textual mlx-lm httpx2 huggingface-hub jinja2 markupsafe tqdm
  pyyaml safetensors typing-extensions)

prepare() {
  local venv_py=$ROOT/.venv/bin/python stage=$CARRY/stage
  rm -rf "$CARRY"/call* "$stage"
  mkdir -p "$stage/wheels" "$CARRY/download"
  local plat=() p
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  local pins
  pins=$("$venv_py" - "${DEPS[@]}" <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
EOF
)
  # shellcheck disable=SC2086
  "$venv_py" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 "${plat[@]}" \
    -d "$CARRY/download" "mlx==$MLX_VERSION" "mlx-cuda-13==$MLX_VERSION" $pins
  cp "$CARRY"/download/*.whl "$stage/wheels/"
  # the tiny checkpoints of every family, built here with transformers (the machine's may differ)
  MLXLIS_FINGERPRINT_MODELS=$CARRY/tiny "$venv_py" - <<'EOF'
import sys
sys.path.insert(0, "scripts")
import fingerprint as f
for name, (spec, build) in f.tiny_specs().items():
    f.tiny_folder(name, spec, build)
EOF
  tar -C "$CARRY" -cf "$stage/tiny.tar" tiny
  local names=("$@")
  [ ${#names[@]} -gt 0 ] || names=(smollm2-135m)
  mkdir -p "$stage/models"
  for n in "${names[@]}"; do
    local path
    path=$("$venv_py" -c "from mlxlis.loading import catalog; print(catalog.model_path('$n'))")
    [ -f "$path" ] || { echo "gpu_carry: $n is not pulled (mlxlis pull $n)" >&2; exit 2; }
    cp "$path" "$stage/models/"
  done
  # one stream of parts, CALL_MB each, over every file; a call carries one part
  (cd "$stage" && find . -type f | sort > manifest && tar -cf - -T manifest manifest) |
    split -b "${CALL_MB}M" -d -a 3 - "$stage/part."
  local k=0 part
  for part in "$stage"/part.*; do
    k=$((k + 1))
    mkdir -p "$CARRY/call$k"
    mv "$part" "$CARRY/call$k/"
  done
  sha256sum "$CARRY"/call*/part.* | sed "s#$CARRY/call[0-9]*/##" > "$CARRY/call$k/SHA256SUMS"
  rm -rf "$stage"
  echo "gpu_carry: $k calls, each run with carry [\"gpu-carry/callK\"], kept warm between them:"
  for ((i = 1; i < k; i++)); do echo "  call $i: bash scripts/gpu_carry.sh receive $i"; done
  echo "  call $k: bash scripts/gpu_carry.sh finish $k   (timeout_s: the check's --budget-s + 120)"
}

receive() {
  mkdir -p "$DEST"
  cp "$CARRY/call$1"/* "$DEST/"
  ls -l "$DEST"
}

finish() {
  local n=$1
  shift
  receive "$n"
  (cd "$DEST" && sha256sum -c --quiet SHA256SUMS) || {
    echo "gpu_carry: a part is missing or damaged (was every call made while warm?)" >&2
    exit 3
  }
  "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__)" || true
  local unpack=$DEST/unpacked
  mkdir -p "$unpack"
  cat "$DEST"/part.* | tar -C "$unpack" -xf -
  # what this Python lacks, or has older than what mlxlis is tested with (mlx: always ours)
  local wanted
  wanted=$("$PY" - "$unpack"/wheels/*.whl <<'EOF'
import re, sys
from importlib.metadata import PackageNotFoundError, version
def key(v): return tuple(int(x) for x in re.findall(r"\d+", v)[:3])
for whl in sys.argv[1:]:
    name, ver = whl.rsplit("/", 1)[1].split("-")[:2]
    try:
        have = version(name.replace("_", "-"))
    except PackageNotFoundError:
        have = None
    if name.startswith("mlx") or have is None or key(have) < key(ver):
        print(whl)
EOF
)
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" $wanted
  # libmlx.so finds the CUDA libraries by RPATH $ORIGIN/../../nvidia/*/lib: beside it in
  # $SITE, the machine's own nvidia-* packages (torch's) are linked in
  "$PY" - "$SITE" <<'EOF'
import sys
from pathlib import Path
site = Path(sys.argv[1]) / "nvidia"
site.mkdir(exist_ok=True)
try:
    import nvidia
    roots = [Path(p) for p in nvidia.__path__ if Path(p).resolve() != site.resolve()]
except ImportError:
    roots = []
for root in roots:
    for child in root.iterdir():
        if not (site / child.name).exists():
            (site / child.name).symlink_to(child)
print("nvidia libraries from", [str(r) for r in roots] or "nowhere (nvidia-* not installed)")
EOF
  mkdir -p "$DEST/models"
  tar -C "$DEST" -xf "$unpack/tiny.tar"
  cp "$unpack"/models/* "$DEST/models/" 2>/dev/null || true
  rm -f "$DEST"/part.*
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  export MLXLIS_MODELS=$DEST/models MLXLIS_BUILD_KERNELS=0 MLXLIS_DEVICE=gpu
  local models
  models=$(ls -1Sr "$DEST"/models/*.gguf 2>/dev/null | paste -sd, -)  # the smallest first
  "$PY" -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"
  "$PY" scripts/gpu_check.py --device gpu --tiny "$DEST/tiny" --models "$models" \
    --out "${OUT:-$ROOT/bench-results/gpu}" "$@"
}

dry_run() {
  MLXLIS_BUILD_KERNELS=0 "$ROOT/.venv/bin/python" scripts/gpu_check.py --dry-run \
    --tiny "$CARRY/tiny" --out "${OUT:-$ROOT/bench-results/gpu-dry}" "$@"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  receive) receive "$2" ;;
  finish) shift; finish "$@" ;;
  dry-run) shift; dry_run "$@" ;;
  *) sed -n '2,21p' "$0"; exit 2 ;;
esac
