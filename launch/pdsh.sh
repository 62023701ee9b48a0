#!/usr/bin/env bash
# Multi-node launch over pdsh + ssh (DeepSpeed's default): run on one machine that can ssh to every
# host without a password, from a directory that exists at the same path on every host.
#   launch/pdsh.sh --hostfile hostfiles/4node --config recipes/deepseek-v2-lite.yaml [-- --set train.steps=1000]
# (the recipe names its DeepSpeed JSON, ds_configs/zero1_pp_bf16.json, and its 4 pipeline stages; --deepspeed_config
# J overrides the JSON)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
filter_args
write_deepspeed_env
# pdsh waits for every ssh; with no keepalive a host that vanishes (power, kernel panic, network)
# keeps its ssh, and so the whole job, hanging for hours. This bounds it to ~30 s.
export PDSH_SSH_ARGS_APPEND=${PDSH_SSH_ARGS_APPEND:--o ServerAliveInterval=10 -o ServerAliveCountMax=3}
cmd=("$DEEPSPEED" --hostfile "$HOSTFILE" "${FILTER_ARGS[@]}" --master_port "$MASTER_PORT")
[[ -n $MASTER_ADDR ]] && cmd+=(--master_addr "$MASTER_ADDR")
run "${cmd[@]}" "$SCRIPT" "${SCRIPT_ARGS[@]}"
