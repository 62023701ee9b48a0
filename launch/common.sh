# Shared by the launch/*.sh wrappers (sourced, not run): argument parsing, the environment file
# rendered into .deepspeed_env, and running (or with --dry-run, printing) the deepspeed command.
# shellcheck shell=bash

LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)  # -P: the real repo, also via a symlink
REPO_DIR=$(dirname "$LAUNCH_DIR")
# The deepspeed launcher runs its own interpreter's path on every node, so prefer the repo's venv.
if [[ -x $REPO_DIR/.venv/bin/deepspeed ]]; then
    DEEPSPEED=${DEEPSPEED:-$REPO_DIR/.venv/bin/deepspeed}
    PYTHON=${PYTHON:-$REPO_DIR/.venv/bin/python}
else
    DEEPSPEED=${DEEPSPEED:-deepspeed}
    PYTHON=${PYTHON:-python3}
fi

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

usage() {
    cat >&2 <<EOF
usage: $(basename "$0") --hostfile F --config RECIPE.yaml [--deepspeed_config DS.json] [options] [-- SCRIPT ARGS]
  -H, --hostfile F          DeepSpeed hostfile ('HOST slots=N' lines; see hostfiles/)
  -c, --config R            run recipe, passed to the script as --config R
  -d, --deepspeed_config J  DeepSpeed JSON, passed to the script as --deepspeed_config J
  -i, --include S / -e, --exclude S
                            use only / all but these hosts and slots ('node-0@node-1:0,2'; pdsh, no_ssh)
  --master_addr A           address of the first host (default: DeepSpeed asks it: 'hostname -I')
  --master_port P           rendezvous port on the first host (default 29500)
  --node_rank N             this node's index in the hostfile (no_ssh.sh; default \$SLURM_NODEID)
  --env FILE                KEY=VALUE file exported on every node (repeatable; default launch/nccl.env);
                            rendered into ./.deepspeed_env, mode 0600 (it may hold secrets), which is
                            removed when the launcher exits (pdsh.sh, openmpi.sh)
  --script PATH             what to launch (default: train.py of this repo)
  --dry-run                 print the .deepspeed_env and the command instead of running them
Anything after -- goes to the script, e.g. -- --set train.steps=100
EOF
    exit 2
}

# shellcheck disable=SC2034  # the variables set here are read by the wrapper that sourced this file
parse_args() {
    HOSTFILE="" CONFIG="" DS_CONFIG="" INCLUDE="" EXCLUDE="" MASTER_ADDR="" MASTER_PORT=29500
    NODE_RANK=${SLURM_NODEID:-} SCRIPT="$REPO_DIR/train.py" DRY_RUN=0
    ENV_FILES=() SCRIPT_ARGS=()
    while (($#)); do
        case $1 in
            -H | --hostfile) HOSTFILE=${2:?$1 needs a value}; shift 2 ;;
            -c | --config) CONFIG=${2:?$1 needs a value}; shift 2 ;;
            -d | --deepspeed_config) DS_CONFIG=${2:?$1 needs a value}; shift 2 ;;
            -i | --include) INCLUDE=${2:?$1 needs a value}; shift 2 ;;
            -e | --exclude) EXCLUDE=${2:?$1 needs a value}; shift 2 ;;
            --master_addr) MASTER_ADDR=${2:?$1 needs a value}; shift 2 ;;
            --master_port) MASTER_PORT=${2:?$1 needs a value}; shift 2 ;;
            --node_rank) NODE_RANK=${2:?$1 needs a value}; shift 2 ;;
            --env) ENV_FILES+=("${2:?$1 needs a value}"); shift 2 ;;
            --script) SCRIPT=${2:?$1 needs a value}; shift 2 ;;
            --dry-run) DRY_RUN=1; shift ;;
            -h | --help) usage ;;
            --) shift; SCRIPT_ARGS=("$@"); break ;;
            *) die "unknown option '$1' (script arguments go after --; see --help)" ;;
        esac
    done
    ((${#ENV_FILES[@]})) || ENV_FILES=("$LAUNCH_DIR/nccl.env")
    [[ -n $HOSTFILE ]] || die "--hostfile is required (examples in $REPO_DIR/hostfiles/)"
    [[ -f $HOSTFILE ]] || die "hostfile $HOSTFILE does not exist"
    [[ -n $INCLUDE && -n $EXCLUDE ]] && die "--include and --exclude are mutually exclusive"
    [[ $SCRIPT != "$REPO_DIR/train.py" || -n $CONFIG ]] || die "--config RECIPE.yaml is required for train.py"
    # The script's own arguments: the recipe and DeepSpeed JSON first, then whatever came after --.
    local forwarded=()
    [[ -n $CONFIG ]] && forwarded+=(--config "$CONFIG")
    [[ -n $DS_CONFIG ]] && forwarded+=(--deepspeed_config "$DS_CONFIG")
    SCRIPT_ARGS=("${forwarded[@]}" "${SCRIPT_ARGS[@]}")
}

# KEY=VALUE lines of the --env files (comments and blank lines dropped; later files win), plus PATH
# with this interpreter's bin first so every node finds the same deepspeed/ninja. Values may not
# contain spaces or '#': DeepSpeed pastes them into a shell command line unescaped.
env_lines() {
    local file line key
    declare -A seen=()
    local order=()
    for file in "${ENV_FILES[@]}"; do
        [[ -f $file ]] || die "env file $file does not exist"
        while IFS= read -r line || [[ -n $line ]]; do
            line=${line#"${line%%[![:space:]]*}"}  # trim leading whitespace
            line=${line%"${line##*[![:space:]]}"}  # and trailing
            [[ -z $line || $line == \#* ]] && continue
            [[ $line =~ ^[A-Za-z_][A-Za-z0-9_]*=[^[:space:]\#]*$ ]] ||
                die "$file: '$line' is not KEY=VALUE (no spaces, no inline comments: put comments on their own line)"
            key=${line%%=*}
            [[ -n ${seen[$key]+x} ]] || order+=("$key")
            seen[$key]=$line
        done <"$file"
    done
    for key in "${order[@]}"; do echo "${seen[$key]}"; done
    [[ -n ${seen[PATH]+x} ]] || echo "PATH=$(dirname "$PYTHON"):$PATH"
}

# DeepSpeed's pdsh/MPI launchers export ./.deepspeed_env on every node (the working directory must be
# the same shared path everywhere, as DeepSpeed also `cd`s there on each node).
write_deepspeed_env() {
    local rendered
    rendered=$(env_lines) || exit 2
    if ((DRY_RUN)); then
        echo "# ./.deepspeed_env would be:"
        echo "$rendered"
        return
    fi
    # Owner-only (values may be secrets passed with --env): an old file keeps its mode, so replace it, and
    # create the new one under umask 077. run() removes it when the launcher exits.
    rm -f .deepspeed_env
    (umask 077 && echo "$rendered" >.deepspeed_env)
    ENV_WRITTEN=$(pwd)/.deepspeed_env
    echo "$(basename "$0"): wrote $ENV_WRITTEN from ${ENV_FILES[*]} (mode 0600, removed at exit)" >&2
}

# With --no_ssh DeepSpeed launches locally and ignores .deepspeed_env: export the same lines here.
export_env() {
    local line rendered
    rendered=$(env_lines) || exit 2
    while IFS= read -r line; do
        if ((DRY_RUN)); then echo "export $line"; else export "${line?}"; fi
    done <<<"$rendered"
}

filter_args() {  # --include/--exclude as deepspeed arguments
    FILTER_ARGS=()
    [[ -n $INCLUDE ]] && FILTER_ARGS+=(--include "$INCLUDE")
    [[ -n $EXCLUDE ]] && FILTER_ARGS+=(--exclude "$EXCLUDE")
    return 0
}

run() {
    if ((DRY_RUN)); then
        printf '%q ' "$@"
        echo
        return
    fi
    echo "$(basename "$0"): $*" >&2
    [[ -n ${ENV_WRITTEN:-} ]] || exec "$@"
    # DeepSpeed's runner reads .deepspeed_env when it starts; keep it until the launcher ends, then remove it
    # (it may hold secrets). Not exec'd so this shell outlives it: a TERM/INT/HUP is passed on as TERM (a
    # background child of a non-interactive shell ignores INT), and the launcher's exit status is ours.
    trap 'rm -f "$ENV_WRITTEN"' EXIT
    local pid="" rc=0
    trap '[[ -z $pid ]] || kill -TERM "$pid" 2>/dev/null' TERM INT HUP  # set before the launcher can start
    "$@" &
    pid=$!
    while :; do
        wait "$pid" && rc=0 || rc=$?
        kill -0 "$pid" 2>/dev/null && continue  # a trapped signal ended wait early: the launcher still runs
        wait "$pid" && rc=0 || rc=$?  # it ended meanwhile: bash kept its exit status
        break
    done
    exit "$rc"
}
