#!/usr/bin/env bash
# Multi-node launch with OpenMPI's mpirun (deepspeed --launcher openmpi): one MPI rank per slot.
# Needs OpenMPI (ompi_info) on the launching machine and mpi4py on every host: DeepSpeed finds
# rank, world size and master address through MPI. DeepSpeed's OpenMPI runner does not support
# --include/--exclude: write a hostfile with only the hosts you want.
#   launch/openmpi.sh --hostfile hostfiles/4node --config recipes/deepseek-v2-lite.yaml [--deepspeed_config J]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
[[ -z $INCLUDE && -z $EXCLUDE ]] || die "--include/--exclude are not supported with OpenMPI; edit the hostfile instead"
write_deepspeed_env
# DeepSpeed pins OpenMPI's TCP traffic to eth0 unless told otherwise: follow NCCL_SOCKET_IFNAME when
# it names a single interface.
iface=$(env_lines | sed -n 's/^NCCL_SOCKET_IFNAME=\([A-Za-z0-9_.-]*\)$/\1/p')
launcher_args=${MPI_ARGS:-}
[[ -n $iface ]] && launcher_args+=" --mca btl_tcp_if_include $iface --mca oob_tcp_if_include $iface"
cmd=("$DEEPSPEED" --launcher openmpi --hostfile "$HOSTFILE" --master_port "$MASTER_PORT")
[[ -n $MASTER_ADDR ]] && cmd+=(--master_addr "$MASTER_ADDR")
[[ -n $launcher_args ]] && cmd+=(--launcher_args "$launcher_args")
run "${cmd[@]}" "$SCRIPT" "${SCRIPT_ARGS[@]}"
