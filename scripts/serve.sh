#!/usr/bin/env bash
# Quick start, command 1: set everything up, build the demo model and adapters (cached), and
# serve them on http://127.0.0.1:8000 (`gateway demo`). Extra arguments go to `gateway demo`,
# e.g. `scripts/serve.sh --port 9000`; arguments that name a model go to `gateway serve`:
#   scripts/serve.sh --model /path/to/model --lora mine=/path/to/adapter
# `scripts/serve.sh --vision [ARGS...]` serves the vision demo instead: a tiny Idefics3
# vision-language model with the "meow" adapter, reading local images from its images/ dir.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [[ "${1:-}" != "--vision" ]]; then
    # `gateway serve` when the arguments name what to serve (MODEL first, --model, an upstream
    # or a Vi run: tools/harness.py's MODEL_OPTIONS), else the demo.
    command=demo
    [[ -n "${1:-}" && "${1:-}" != -* ]] && command=serve
    for arg in "$@"; do
        [[ $arg == "--" ]] && break
        case "${arg%%=*}" in
            --model | --pretrained-model-name-or-path | --upstream-url | --run-id) command=serve ;;
        esac
    done
    exec .venv/bin/gateway "$command" "$@"
fi
shift
# The demo's own arguments (built first if needed), NUL-separated: gateway flags, `--`, engine flags.
demo_file="$(mktemp)"
trap 'rm -f "$demo_file"' EXIT
.venv/bin/python -m loragate.demo.build_vision --serve-args >"$demo_file"
demo_flags=() demo_engine=() seen=0
while IFS= read -r -d '' arg; do
    if [[ $seen == 0 && $arg == "--" ]]; then seen=1
    elif [[ $seen == 0 ]]; then demo_flags+=("$arg")
    else demo_engine+=("$arg"); fi
done <"$demo_file"
# The caller's arguments, split the same way, so theirs come after (and win over) the demo's.
user_flags=() user_engine=() seen=0
for arg in "$@"; do
    if [[ $seen == 0 && $arg == "--" ]]; then seen=1
    elif [[ $seen == 0 ]]; then user_flags+=("$arg")
    else user_engine+=("$arg"); fi
done
exec .venv/bin/gateway serve "${demo_flags[@]}" "${user_flags[@]}" -- "${demo_engine[@]}" "${user_engine[@]}"
