#!/usr/bin/env bash
# One node of a multi-node job, without ssh (deepspeed --no_ssh): run this on EVERY host of the
# hostfile, each with its own --node_rank (0 = the first host, which also hosts the rendezvous).
# For schedulers and containers where hosts cannot ssh to each other; launch/slurm.sbatch uses it.
#   node-0$ launch/no_ssh.sh --hostfile hostfiles/2node --node_rank 0 --config recipes/tiny-v3.yaml
#   node-1$ launch/no_ssh.sh --hostfile hostfiles/2node --node_rank 1 --config recipes/tiny-v3.yaml
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
filter_args
[[ $NODE_RANK =~ ^[0-9]+$ ]] || die "--node_rank N is required (or \$SLURM_NODEID): this host's index in the hostfile"
if [[ -z $MASTER_ADDR ]]; then
    # No ssh to ask the first host for its address: use its name, as every host resolves it.
    MASTER_ADDR=$("$PYTHON" - "$HOSTFILE" "$INCLUDE" "$EXCLUDE" <<'PY'
import sys
from deepseek_ds.launcher.hostfile import HostfileError, read_hostfile, select_slots
try:
    print(next(iter(select_slots(read_hostfile(sys.argv[1]), sys.argv[2], sys.argv[3]))))
except HostfileError as err:
    sys.exit(f"no_ssh.sh: {err}")
PY
) || exit 2
fi
# DeepSpeed reads .deepspeed_env only when it launches over ssh: export the same variables here.
export_env
cmd=("$DEEPSPEED" --hostfile "$HOSTFILE" "${FILTER_ARGS[@]}" --no_ssh --node_rank "$NODE_RANK"
     --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
run "${cmd[@]}" "$SCRIPT" "${SCRIPT_ARGS[@]}"
