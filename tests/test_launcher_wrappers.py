"""launch/*.sh and launch/slurm.sbatch without a cluster: the .deepspeed_env they write and the
deepspeed commands they build (--dry-run, or DEEPSPEED=echo to run everything but the launch)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
HOSTS = REPO / "hostfiles" / "4node"
SCRIPTS = ["common.sh", "pdsh.sh", "openmpi.sh", "no_ssh.sh", "slurm.sbatch", "testcluster.sh", "install_test_deps.sh"]


def wrapper(name, *args, cwd, env=None):
    return subprocess.run(["bash", str(LAUNCH / name), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def last_command(stdout: str) -> list[str]:
    return shlex.split(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_valid_bash(script):
    proc = subprocess.run(["bash", "-n", str(LAUNCH / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_pdsh_builds_the_deepspeed_command(tmp_path):
    out = wrapper("pdsh.sh", "--hostfile", str(HOSTS), "--config", "recipes/tiny-v3.yaml",
                  "--deepspeed_config", "ds_configs/zero1_pp.json", "--exclude", "node-3", "--master_port", "29610",
                  "--dry-run", "--", "--set", "train.steps=3", "--set", "train.note=two words", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert last_command(out.stdout) == [
        str(REPO / ".venv" / "bin" / "deepspeed"), "--hostfile", str(HOSTS), "--exclude", "node-3",
        "--master_port", "29610", str(REPO / "train.py"), "--config", "recipes/tiny-v3.yaml",
        "--deepspeed_config", "ds_configs/zero1_pp.json", "--set", "train.steps=3", "--set", "train.note=two words"]
    rendered = out.stdout.split("# ./.deepspeed_env would be:\n")[1].splitlines()[:-1]
    assert "NCCL_SOCKET_IFNAME=eth0" in rendered and "NCCL_IB_HCA=mlx5" in rendered
    assert not any(line.startswith("#") or not line.strip() for line in rendered)
    assert rendered[-1].startswith(f"PATH={REPO / '.venv' / 'bin'}:")
    assert not (tmp_path / ".deepspeed_env").exists()  # a dry run writes nothing


def test_pdsh_writes_deepspeed_env_and_bounds_ssh(tmp_path):
    extra = tmp_path / "cluster.env"
    extra.write_text("# test cluster\nNCCL_SOCKET_IFNAME=veth\n\nNCCL_DEBUG=INFO\n")
    fake_deepspeed = tmp_path / "deepspeed"  # prints the environment the launcher would get
    fake_deepspeed.write_text("#!/bin/bash\nenv\ncp .deepspeed_env seen.env\n")  # the wrapper removes it at exit
    fake_deepspeed.chmod(0o755)
    out = wrapper("pdsh.sh", "-H", str(HOSTS), "-c", "r.yaml", "--env", str(LAUNCH / "nccl.env"), "--env", str(extra),
                  cwd=tmp_path, env={"DEEPSPEED": str(fake_deepspeed)})
    assert out.returncode == 0, out.stderr
    lines = (tmp_path / "seen.env").read_text().splitlines()
    assert lines[0] == "NCCL_SOCKET_IFNAME=veth"  # the later file wins, in the first file's order
    assert "NCCL_DEBUG=INFO" in lines and "GLOO_SOCKET_IFNAME=eth0" in lines
    assert "PDSH_SSH_ARGS_APPEND=-o ServerAliveInterval=10 -o ServerAliveCountMax=3" in out.stdout.splitlines()
    assert f"wrote {tmp_path}/.deepspeed_env" in out.stderr


@pytest.mark.parametrize("env_text, message", [
    ("NCCL_DEBUG=INFO # chatty\n", "no inline comments"),
    ("NCCL DEBUG=INFO\n", "is not KEY=VALUE"),
])
def test_bad_env_file_lines_stop_the_launch(tmp_path, env_text, message):
    (tmp_path / "bad.env").write_text(env_text)
    out = wrapper("pdsh.sh", "-H", str(HOSTS), "-c", "r.yaml", "--env", str(tmp_path / "bad.env"), cwd=tmp_path,
                  env={"DEEPSPEED": "true"})
    assert out.returncode == 2 and message in out.stderr and "bad.env" in out.stderr
    assert not (tmp_path / ".deepspeed_env").exists()


@pytest.mark.parametrize("args, message", [
    (["-c", "r.yaml"], "--hostfile is required"),
    (["-H", "/nonexistent", "-c", "r.yaml"], "hostfile /nonexistent does not exist"),
    (["-H", str(HOSTS)], "--config RECIPE.yaml is required for train.py"),
    (["-H", str(HOSTS), "-c", "r", "-i", "node-0", "-e", "node-1"], "mutually exclusive"),
    (["-H", str(HOSTS), "-c", "r", "--steps", "3"], "unknown option '--steps'"),
])
def test_usage_errors(tmp_path, args, message):
    out = wrapper("pdsh.sh", *args, "--dry-run", cwd=tmp_path)
    assert out.returncode == 2 and message in out.stderr


def test_openmpi_follows_nccl_interface_and_refuses_filters(tmp_path):
    out = wrapper("openmpi.sh", "-H", str(HOSTS), "-c", "r.yaml", "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    command = last_command(out.stdout)
    assert command[1:5] == ["--launcher", "openmpi", "--hostfile", str(HOSTS)]
    assert command[command.index("--launcher_args") + 1].split() == \
        ["--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]
    out = wrapper("openmpi.sh", "-H", str(HOSTS), "-c", "r.yaml", "--include", "node-0", "--dry-run", cwd=tmp_path)
    assert out.returncode == 2 and "not supported with OpenMPI" in out.stderr


def test_no_ssh_exports_env_and_defaults_master_to_first_selected_host(tmp_path):
    out = wrapper("no_ssh.sh", "-H", str(HOSTS), "-c", "r.yaml", "--exclude", "node-0", "--node_rank", "2",
                  "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "export GLOO_SOCKET_IFNAME=eth0" in out.stdout.splitlines()
    command = last_command(out.stdout)
    assert command[command.index("--node_rank") + 1] == "2" and "--no_ssh" in command
    assert command[command.index("--master_addr") + 1] == "node-1"
    out = wrapper("no_ssh.sh", "-H", str(HOSTS), "-c", "r.yaml", "--dry-run", cwd=tmp_path)
    assert out.returncode == 2 and "--node_rank N is required" in out.stderr
    out = wrapper("no_ssh.sh", "-H", str(HOSTS), "-c", "r.yaml", "--node_rank", "0", "--include", "node-9",
                  "--dry-run", cwd=tmp_path)
    assert out.returncode == 2 and "host 'node-9' is not in" in out.stderr


def test_slurm_writes_hostfile_from_allocation_and_runs_one_launcher_per_node(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/bash\n"
                                   "[[ $* == 'show hostnames gpu[01-02]' ]] && printf 'gpu01\\ngpu02\\n'\n")
    # srun: drop its options, run the task once per node the way Slurm would (SLURM_NODEID set).
    (fake / "srun").write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n'
                               'for i in 0 1; do SLURM_NODEID=$i "$@" || exit; done\n')
    for tool in fake.iterdir():
        tool.chmod(0o755)
    submit = tmp_path / "repo"
    submit.mkdir()
    (submit / "launch").symlink_to(LAUNCH)
    out = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--config", "recipes/tiny-v3.yaml", "--dry-run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(submit),
                              "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_GPUS_ON_NODE": "4"})
    assert out.returncode == 0, out.stderr
    assert (submit / "runs" / "hostfile-42").read_text() == "gpu01 slots=4\ngpu02 slots=4\n"
    commands = [shlex.split(line) for line in out.stdout.splitlines() if "--no_ssh" in line]
    assert [c[c.index("--node_rank") + 1] for c in commands] == ["0", "1"]
    assert all(c[c.index("--master_addr") + 1] == "gpu01" for c in commands)
    assert all(c[c.index("--hostfile") + 1] == "runs/hostfile-42" for c in commands)
