# Sourced by scripts/setup_vllm.sh and scripts/setup_openclaw.sh. A built environment (vLLM's
# virtual environment, OpenClaw's Node) is kept once per user and per content, in
# $CLAWGYM_HOME/envs/NAME-KEY (KEY: a hash of everything that decides what is built), and a
# clone's .venv-vllm or .openclaw-node is a link to it. A second clone of the same commit,
# CI's clean clone among them, links to what the first built instead of building it again
# (about two minutes of the test command's set-up here); a commit that changes the recipe or
# the plugin gets a new KEY, so it never reuses a stale build. Nothing in them refers to a
# clone: vLLM's plugin is installed from a copy, OpenClaw's wrapper names the shared path.

# shared_env NAME WANT LINK: prints the directory to build in. LINK that is a directory of its
# own (a clone set up before the environments were shared) stays where it is; otherwise LINK
# is made a link to the shared directory for WANT.
shared_env() {
    local name=$1 want=$2 link=$3
    if [ -e "$link" ] && [ ! -L "$link" ]; then
        printf '%s\n' "$link"
        return
    fi
    local envs="${CLAWGYM_HOME:-$HOME/.cache/clawgym}/envs"
    local dir
    dir="$envs/$name-$(printf '%s' "$want" | sha256sum | cut -c1-16)"
    mkdir -p "$envs" && ln -sfn "$dir" "$link" && printf '%s\n' "$dir"
}

# lock_env DIR: holds a lock on DIR until this script exits, so that two set-ups at once
# (two clones) build a shared environment once, one after the other.
lock_env() {
    exec 9>"$1.lock"
    flock 9
}
