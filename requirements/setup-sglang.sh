#!/usr/bin/env bash
# Build (or update) the SGLang engine venv: VENV_DIR chains MAIN_VENV_DIR, so torch,
# triton, lmcache (editable) and everything else come from the main venv, while the pins of
# requirements/sglang.txt, installed into VENV_DIR itself, shadow the main venv's versions.
# Idempotent: re-running it only installs what changed.
#
#   requirements/setup-sglang.sh .venv-sglang .venv
#   LMCACHE_ENGINE_TESTS=1 .venv-sglang/bin/python -m pytest tests/engines/test_sglang.py -q
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 VENV_DIR MAIN_VENV_DIR" >&2
    exit 2
fi
VENV_DIR=$1
MAIN_VENV_DIR=$2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MAIN_PY=$MAIN_VENV_DIR/bin/python

if [ ! -x "$MAIN_PY" ]; then
    echo "$0: $MAIN_PY not found; build the main venv first (make install)" >&2
    exit 1
fi
# the same base interpreter as the main venv, so its compiled packages load here too
BASE_PY=$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')
if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$BASE_PY" -m venv "$VENV_DIR"
fi
MAIN_SITE=$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
MAIN_SITE=$(cd "$MAIN_SITE" && pwd)  # absolute, so the venv works from any directory
VENV_SITE=$("$VENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# a .pth's directories come after the venv's own site-packages: the pins below win
echo "import site; site.addsitedir('$MAIN_SITE')" > "$VENV_SITE/_lmcache_main.pth"

# PyPI's torchvision wheels are CUDA builds: against the main venv's CPU torch their C++ ops
# do not load, and their Python layer then fails registering fake kernels for two of those
# ops. sglang imports torchvision (through transformers) at `import sglang`. On a CPU-only
# torch, this hook defines those two op schemas just before torchvision is first imported, so
# it imports (without its C++ ops, which nothing on the KV-cache path uses). It does nothing
# when torch has CUDA or ROCm.
cat > "$VENV_SITE/_lmcache_torchvision_cpu.py" <<'PY'
"""Let a CUDA build of torchvision import on a CPU-only torch (see setup-sglang.sh)."""
import sys

_libs = []


class _Hook:
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            lib = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                if not torch._C._dispatch_has_kernel(f"torchvision::{op}"):
                    lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _libs.append(lib)
        return None  # the ordinary finders import torchvision itself


sys.meta_path.insert(0, _Hook())
PY
echo "import _lmcache_torchvision_cpu" > "$VENV_SITE/_lmcache_torchvision_cpu.pth"

"$VENV_DIR/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    -r "$HERE/sglang.txt"
"$VENV_DIR/bin/python" -c 'import sglang.srt.mem_cache.hicache_storage, lmcache, torch' \
    || { echo "$0: the sglang venv does not import; see above" >&2; exit 1; }
