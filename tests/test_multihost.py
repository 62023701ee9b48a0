"""Multi-host launches for real, on a test cluster of network-namespace hosts with their own sshd
(launch/testcluster.sh): preflight, a host dying mid-run, the --no_ssh per-node mode, training
across 4 hosts against the same run on 4 local ranks, kill -9 of `deepseek-ds train` across 2 hosts leaving nothing
of the job anywhere, and `data prepare` over 2 and 4 hosts against one.

The cluster is built once for the whole session and removed at the end. Needs root, iproute2,
openssh-server and pdsh (launch/install_test_deps.sh); skipped with the reason otherwise (`-rs` prints it), and
under CI (CI=true, as .ci/run sets) failed with it: CI must not pass without the multi-host tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.multihost

REPO = Path(__file__).resolve().parents[1]
TESTCLUSTER = REPO / "launch" / "testcluster.sh"
BENCH = REPO / "deepseek_ds" / "launcher" / "allreduce_bench.py"
PYTHON = sys.executable
HOSTS = 4
READY_LINE = "allreduce_bench: ready"
# pdsh's ssh gives up on a silent host after 2 s x 3 unanswered keepalives (the wrapper's default
# is 10 s x 3); ranks give up on a lost peer after COLLECTIVE_TIMEOUT_S.
FAST_KEEPALIVE = "-o ServerAliveInterval=2 -o ServerAliveCountMax=3"
COLLECTIVE_TIMEOUT_S = 15


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, a bridge and sshd per test host)"
    missing = [t for t in ("ip", "pdsh", "ssh", "ssh-keygen") if shutil.which(t) is None]
    if not os.access("/usr/sbin/sshd", os.X_OK):
        missing.append("sshd")
    if missing:
        return f"{', '.join(missing)} not installed: run launch/install_test_deps.sh"
    name = f"dsprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns' is unavailable here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], check=True)
    return None


@dataclass(frozen=True)
class Cluster:
    hostfile: Path
    env_file: Path  # GLOO/NCCL_SOCKET_IFNAME for the hosts' interface
    master_addr: str
    hosts: tuple[str, ...]

    def control(self, *args: str) -> None:
        subprocess.run(["bash", str(TESTCLUSTER), *args], check=True, capture_output=True, timeout=60)

    def reset_host(self, index: int) -> None:
        """Undo whatever a test did to a host: link back up, everything in it killed, fresh sshd."""
        name = self.hosts[index]
        subprocess.run(["ip", "-n", name, "link", "set", "eth0", "up"], check=True)
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.kill(int(pid), signal.SIGKILL)
        self.control("sshd-start", str(index))


@pytest.fixture(scope="session")
def cluster():
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the multi-host test cluster cannot be set up under CI: {reason}", pytrace=False)
        pytest.skip(f"no multi-host test cluster: {reason}")
    up = subprocess.run(["bash", str(TESTCLUSTER), "up", str(HOSTS)], capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        info = dict(line.split(": ", 1) for line in up.stdout.splitlines() if ": " in line)
        yield Cluster(hostfile=Path(info["hostfile"]), env_file=Path(info["env"]), master_addr=info["master_addr"],
                      hosts=tuple(f"dsnode{i}" for i in range(HOSTS)))
    finally:
        subprocess.run(["bash", str(TESTCLUSTER), "down"], capture_output=True, timeout=120)


def preflight(cluster: Cluster, cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # The env file as .deepspeed_env, where both preflight and the deepspeed launcher look for it.
    shutil.copy(cluster.env_file, cwd / ".deepspeed_env")
    return subprocess.run([PYTHON, "-m", "deepseek_ds.launcher", "preflight", "--hostfile", str(cluster.hostfile),
                           "--allow-cpu", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def rows(stdout: str, host: str) -> dict[str, str]:
    """{check: "STATUS detail"} of one host in a preflight table (columns found from the header)."""
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("HOST "))
    check_at, status_at, detail_at = (header.index(c) for c in ("CHECK", "STATUS", "DETAIL"))
    return {line[check_at:status_at].strip(): f"{line[status_at:detail_at].strip()} {line[detail_at:]}"
            for line in lines if line[:check_at].strip() == host}


def launch_args(cluster: Cluster, *args: str) -> list[str]:
    """launch/pdsh.sh with the repo's NCCL env file plus the test cluster's interface names."""
    return ["bash", str(REPO / "launch" / "pdsh.sh"), "--hostfile", str(cluster.hostfile),
            "--env", str(REPO / "launch" / "nccl.env"), "--env", str(cluster.env_file), *args]


def end_job(job: subprocess.Popen) -> None:
    """SIGKILL a job started in a session of its own, if it still runs, and reap it."""
    if job.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


# ---------------------------------------------------------------- preflight


def test_preflight_passes_on_all_hosts(cluster, tmp_path):
    out = preflight(cluster, tmp_path, "--checkpoint-dir", str(tmp_path / "ckpt"), "--master-port", "29650")
    assert out.returncode == 0, out.stdout + out.stderr
    for host in cluster.hosts:
        checks = rows(out.stdout, host)
        assert checks["ssh"].startswith("PASS"), checks
        assert checks["versions"].startswith("PASS")
        assert checks["gpus"].startswith("WARN") and "cpu" in checks["gpus"]
        assert checks["interfaces"] == "PASS NCCL_SOCKET_IFNAME=eth0, GLOO_SOCKET_IFNAME=eth0"
        assert checks["checkpoint dir"].startswith("PASS")
    assert f"DeepSpeed will use address {cluster.master_addr}" in rows(out.stdout, "dsnode0")["master"]


def test_preflight_bandwidth_between_two_hosts(cluster, tmp_path):
    out = preflight(cluster, tmp_path, "--include", "dsnode0@dsnode1", "--master-port", "29651", "--bandwidth")
    assert out.returncode == 0, out.stdout + out.stderr
    bandwidth = rows(out.stdout, "*")["bandwidth"]
    assert bandwidth.startswith("PASS bus ") and "GB/s" in bandwidth and "2 ranks, gloo" in bandwidth


def test_preflight_fails_fast_naming_the_host_whose_sshd_is_down(cluster, tmp_path):
    cluster.control("sshd-stop", "2")
    # Fast means a refused connection reported as one, not preflight's 10 s ssh timeout running out: the row's
    # detail says which. The subprocess timeout only bounds a hang.
    try:
        out = preflight(cluster, tmp_path, "--master-port", "29652", timeout=60)
    finally:
        cluster.control("sshd-start", "2")
    assert out.returncode == 1, out.stdout + out.stderr
    assert rows(out.stdout, "dsnode2") == {"ssh": "FAIL ssh connection refused (sshd not running or on another port)"}
    assert "fix: start sshd on dsnode2" in out.stdout
    assert out.stdout.splitlines()[-1] == "preflight FAILED: 1 check on dsnode2"
    assert rows(out.stdout, "dsnode3")["ssh"].startswith("PASS")


def test_preflight_fails_when_master_port_is_taken(cluster, tmp_path):
    holder = subprocess.Popen(["ip", "netns", "exec", "dsnode0", PYTHON, "-c",
                               "import socket, time; s = socket.socket(); s.bind(('', 29653)); s.listen(); "
                               "print('listening', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "listening"
        out = preflight(cluster, tmp_path, "--master-port", "29653", timeout=30)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 1
    assert rows(out.stdout, "dsnode0")["master"] == "FAIL port 29653 on dsnode0: in use"
    assert "ss -ltnp 'sport = :29653' on dsnode0" in out.stdout


# ---------------------------------------------------------------- a host dies mid-run


def kill_host(cluster: Cluster, index: int) -> None:
    """Everything on the host dies at once (kernel panic, OOM of the whole box): peers see resets."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.hosts[index]], capture_output=True, text=True).stdout
    for pid in pids.split():
        os.kill(int(pid), signal.SIGKILL)


def cut_host(cluster: Cluster, index: int) -> None:
    """The host vanishes from the network (power loss, switch port): peers see nothing at all."""
    subprocess.run(["ip", "-n", cluster.hosts[index], "link", "set", "eth0", "down"], check=True)


@pytest.mark.parametrize("failure", [kill_host, cut_host], ids=["crash", "network-loss"])
def test_job_exits_nonzero_in_bounded_time_when_a_host_dies(cluster, tmp_path, failure):
    log = tmp_path / "launch.log"
    command = launch_args(cluster, "--include", "dsnode2@dsnode3", "--master_port", "29654", "--script", str(BENCH),
                          "--", "--size-mb", "1", "--iters", "100000000", "--timeout-s", str(COLLECTIVE_TIMEOUT_S))
    with log.open("w") as sink:
        job = subprocess.Popen(command, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "PDSH_SSH_ARGS_APPEND": FAST_KEEPALIVE})
    try:
        deadline = time.monotonic() + 120
        while READY_LINE not in log.read_text():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        failure(cluster, 3)
        # Bounded by pdsh's keepalives (FAST_KEEPALIVE, 6 s) or the ranks' COLLECTIVE_TIMEOUT_S (a silent ssh
        # session could otherwise hang for hours); the wait allows ten times their sum.
        returncode = job.wait(timeout=10 * (COLLECTIVE_TIMEOUT_S + 6))
    finally:
        end_job(job)
        cluster.reset_host(3)
    output = log.read_text()
    assert returncode != 0, output
    # pdsh names the lost host. (Rank 0 usually adds what broke, a reset connection or a timed-out
    # collective, but the job may end on pdsh's side first, so that line is not guaranteed.)
    assert "dsnode3: ssh exited with exit code 255" in output, output


# ---------------------------------------------------------------- --no_ssh, one launcher per host


def test_no_ssh_mode_starts_each_host_separately(cluster, tmp_path):
    env_args = ["--env", str(REPO / "launch" / "nccl.env"), "--env", str(cluster.env_file)]
    procs = [subprocess.Popen(["ip", "netns", "exec", cluster.hosts[rank], "bash", str(REPO / "launch" / "no_ssh.sh"),
                               "--hostfile", str(cluster.hostfile), "--include", "dsnode0@dsnode1",
                               "--node_rank", str(rank), "--master_port", "29655", *env_args,
                               "--script", str(BENCH), "--", "--size-mb", "1", "--iters", "3"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    # The master address defaulted to the first host's name, which every host resolves.
    assert "--master_addr dsnode0" in outputs[1]
    result = json.loads(outputs[0].split("DSBW ", 1)[1].splitlines()[0])
    assert result["world_size"] == 2 and result["backend"] == "gloo"


# ---------------------------------------------------------------- training across hosts


def read_losses(output_dir: Path) -> list[tuple[int, float]]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["loss"]) for m in map(json.loads, lines)]


def test_pipeline_and_data_parallel_across_four_hosts_matches_four_local_ranks(cluster, tmp_path):
    """PP=2 x DP=2: the same losses whether the 4 ranks run on 4 hosts over pdsh or on one host."""
    # Two steps: the second's loss depends on the first's update, gradients reduced across the hosts.
    overrides = ["--set", "parallel.pipeline_stages=2", "--set", "train.steps=2",
                 "--set", f"data.cache_dir={REPO / 'data_cache'}"]
    recipe, ds_config = str(REPO / "recipes" / "tiny-v3.yaml"), str(REPO / "ds_configs" / "zero1_pp.json")
    hosts = launch_args(cluster, "--config", recipe, "--deepspeed_config", ds_config, "--master_port", "29656",
                        "--master_addr", cluster.master_addr,
                        "--", *overrides, "--set", f"train.output_dir={tmp_path / 'hosts'}")
    local = [str(Path(PYTHON).with_name("deepspeed")), "--num_gpus", "4", "--master_port", "29657",
             str(REPO / "train.py"), "--config", recipe, "--deepspeed_config", ds_config,
             *overrides, "--set", f"train.output_dir={tmp_path / 'local'}"]
    # Both at once: the same code for both (and the wall time of one), whatever changes meanwhile.
    runs = {name: subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True,
                                   env={**os.environ, "PDSH_SSH_ARGS_APPEND": FAST_KEEPALIVE})
            for name, command in (("hosts", hosts), ("local", local))}
    try:
        outputs = {name: run.communicate(timeout=900)[0] for name, run in runs.items()}
    finally:
        for run in runs.values():
            end_job(run)
    for name, run in runs.items():
        assert run.returncode == 0, f"{name} run failed:\n{outputs[name][-6000:]}"
    on_hosts, on_one = read_losses(tmp_path / "hosts"), read_losses(tmp_path / "local")
    assert [s for s, _ in on_hosts] == [s for s, _ in on_one] and len(on_hosts) == 2
    for (step, a), (_, b) in zip(on_hosts, on_one, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), f"step {step}: {a} on 4 hosts vs {b} locally"


# ---------------------------------------------------------------- data prepare across hosts


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def prepare_command(out: Path, *hosts_args: str) -> list[str]:
    # The built-in corpus in many small shards, so that every host has a share of several and a kill lands mid-way.
    return [PYTHON, "-m", "deepseek_ds", "data", "prepare", "--out", str(out), "--builtin-mb", "4", "--shard-mb",
            "0.05", "--vocab-size", "512", "--no-progress", *hosts_args]


def test_data_prepare_on_two_and_four_hosts_is_byte_identical_to_one_and_resumes_after_a_host_dies(cluster, tmp_path):
    shutil.copy(cluster.env_file, tmp_path / ".deepspeed_env")
    on_hosts = ["--hostfile", str(cluster.hostfile), "--master_port", "29658"]
    runs = {"one": prepare_command(tmp_path / "one"),
            "two": prepare_command(tmp_path / "two", *on_hosts, "--include", "dsnode0@dsnode1")}
    procs = {name: subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, command in runs.items()}
    outputs = {name: proc.communicate(timeout=300)[0] for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name][-4000:]}"
    reference = tree(tmp_path / "one")
    assert len(reference) > 50 and tree(tmp_path / "two") == reference
    assert "data prepare: " in outputs["two"] and " shards to tokenize on 2 hosts" in outputs["two"]

    # Four hosts; host 3 dies as soon as its share has begun (its first shard record is on disk).
    four = tmp_path / "four"
    command = prepare_command(four, *on_hosts)
    log = tmp_path / "four.log"
    with log.open("w") as sink:
        job = subprocess.Popen(command, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "PDSH_SSH_ARGS_APPEND": FAST_KEEPALIVE})
    try:
        share = four / ".hosts" / "host-003.pkl"
        deadline = time.monotonic() + 180
        while not (share.is_file() and any((four / f"{t.name}.json").is_file()
                                           for t in pickle.loads(share.read_bytes())["tasks"])):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        kill_host(cluster, 3)
        returncode = job.wait(timeout=120)
    finally:
        end_job(job)
        cluster.reset_host(3)
    output = log.read_text()
    assert returncode == 2, output
    assert "shards of" in output and "are missing" in output and not (four / "meta.json").exists(), output
    rerun = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    left, total = map(int, rerun.stdout.split("data prepare: ", 1)[1].split(" shards")[0].split(" of "))
    assert 0 < left < total, rerun.stdout  # only what the dead host left
    assert tree(four) == reference


# ---------------------------------------------------------------- kill -9 of `deepseek-ds train` across hosts

JOB_MARKERS = ("launch.py", "deepspeed.launcher.launch", "deepseek_ds.training.main", "train.py")
LEFT_AFTER_S = 15.0  # issue 46: no process of the job within 15 s of kill -9 of the CLI


def job_processes(cluster: Cluster, hosts: tuple[str, ...], run_marker: str) -> list[str]:
    """'HOST: cmdline' of every process of the job: in each host's namespace, whatever runs launch.py or the
    training module (pdsh's remote shell included); on the launching host (outside every namespace), whatever
    carries the run's unique output directory in its argv (the deepspeed runner, pdsh and its ssh clients)."""
    in_host = {int(pid): name for name in hosts
               for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # a zombie runs nothing: its parent has yet to reap it
            host = in_host.get(int(entry.name), "launching host")
            ours = run_marker in cmdline or (host != "launching host" and any(m in cmdline for m in JOB_MARKERS))
            if ours:
                found.append(f"{host}: {cmdline}")
    return found


def test_kill_9_of_deepseek_ds_train_leaves_no_process_of_the_job_on_any_host(cluster, tmp_path):
    """issue 46 across hosts: the CLI dies (kill -9 of its process group); its runner's parent-death signal makes
    DeepSpeed's multi-node runner stop pdsh and pkill launch.py on every host, and each remote rank also watches
    its launch.py (launcher/lifeline.py). Nothing of the job may be left on the launching host or on any host."""
    shutil.copy(cluster.env_file, tmp_path / ".deepspeed_env")
    hosts = cluster.hosts[:2]
    output_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    command = [PYTHON, "-m", "deepseek_ds", "train", "--config", str(REPO / "recipes" / "tiny-v3.yaml"),
               "--hostfile", str(cluster.hostfile), "--include", "@".join(hosts), "--master_port", "29659",
               "--set", "train.steps=100000", "--set", "train.log_interval=1", "--set", "checkpoint.interval=0",
               "--set", "eval.interval=0", "--set", f"data.cache_dir={REPO / 'data_cache'}",
               "--set", f"train.output_dir={output_dir}"]
    with log.open("w") as sink:
        job = subprocess.Popen(command, cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "PDSH_SSH_ARGS_APPEND": FAST_KEEPALIVE})
    try:
        metrics = output_dir / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.is_file() and metrics.read_text().strip()):  # a step done: the ranks are training
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.2)
        running = job_processes(cluster, hosts, str(output_dir))
        for host in hosts:  # the job really spans both hosts (launch.py and a rank on each) before the kill
            assert sum(r.startswith(f"{host}: ") and "training.main" in r for r in running) >= 2, "\n".join(running)
        os.killpg(job.pid, signal.SIGKILL)
        killed = time.monotonic()
        job.wait()
        while (left := job_processes(cluster, hosts, str(output_dir))) and time.monotonic() - killed < LEFT_AFTER_S:
            time.sleep(0.2)
        took = time.monotonic() - killed
        assert left == [], (f"{len(left)} processes of the job still run {LEFT_AFTER_S:.0f} s after kill -9 of "
                            "`deepseek-ds train`:\n" + "\n".join(line[:200] for line in left))
        print(f"kill -9 of deepseek-ds train on {len(hosts)} hosts: no process of the job left after {took:.1f} s")
    finally:
        end_job(job)
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError, ValueError):
                if entry.name.isdigit() and str(output_dir).encode() in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)  # leftovers; reset_host clears the rest
        for index in range(len(hosts)):
            cluster.reset_host(index)


# ---------------------------------------------------------------- unattended recovery on fewer hosts


def test_elastic_restart_leaves_a_lost_host_out_and_goes_on_as_a_run_resumed_by_hand(cluster, tmp_path, request):
    """issue 52: 4 hosts of one slot, ZeRO-1 over 4 ranks (global batch 12 of micro-batches of 1: accumulation 3).
    Once step 3 is logged (checkpoints every 2 steps), dsnode3 drops off the network: the ranks' collectives time
    out, and `deepseek-ds train --max-restarts 1 --elastic` finds dsnode3 lost, leaves it out and resumes step 2's
    checkpoint on the 3 hosts left (accumulation 4, resharded through a universal checkpoint); the run ends with
    exit 0. The global batch is kept (12 samples a step), step 3 again takes the samples it took before the loss
    (its loss equals the lost attempt's within 1e-6), and steps 3-8 equal those of a run resumed from a copy of that
    checkpoint on the 3 hosts by hand within 1e-6. That reference run starts at the cut, while the job waits out
    its collectives' timeout."""
    from deepseek_ds.training.metrics import read_metrics

    shutil.copy(cluster.env_file, tmp_path / ".deepspeed_env")

    def train(name: str, *args: str) -> list[str]:
        return [PYTHON, "-m", "deepseek_ds", "train", "--config", str(REPO / "recipes" / "tiny-v3.yaml"),
                "--hostfile", str(cluster.hostfile), *args,
                *[a for s in ("train.steps=8", "train.micro_batch_size=1", "train.global_batch_size=12",
                              "train.log_interval=1", "checkpoint.interval=2", "checkpoint.keep=10",
                              "eval.interval=0", "train.dist_timeout_s=20", f"data.cache_dir={REPO / 'data_cache'}",
                              f"train.output_dir={tmp_path / name}", f"checkpoint.dir={tmp_path / name / 'ck'}")
                  for a in ("--set", s)]]

    env = {**os.environ, "PDSH_SSH_ARGS_APPEND": FAST_KEEPALIVE}

    def resume_by_hand(tag: str, name: str) -> tuple[subprocess.Popen, Path]:
        """The reference: a copy of the elastic run's checkpoint `tag` resumed by hand on the 3 hosts left."""
        shutil.copytree(tmp_path / "elastic" / "ck" / tag, tmp_path / name / "ck" / tag,
                        ignore=shutil.ignore_patterns("*universal*"))
        with (tmp_path / f"{name}.log").open("w") as sink:
            proc = subprocess.Popen(train(name, "--exclude", "dsnode3", "--master_port", "29662"), cwd=tmp_path,
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        request.addfinalizer(lambda: end_job(proc))  # whatever fails before it ends
        return proc, tmp_path / name

    log = tmp_path / "elastic.log"
    metrics = tmp_path / "elastic" / "metrics.jsonl"
    with log.open("w") as sink:
        job = subprocess.Popen(train("elastic", "--master_port", "29661", "--max-restarts", "1", "--elastic",
                                     "--restart-backoff", "1"),
                               cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 600
        while not (metrics.is_file() and any(r["step"] >= 3 for r in read_metrics(str(metrics)))):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.2)
        before = {r["step"]: r["loss"] for r in read_metrics(str(metrics))}
        cut_host(cluster, 3)
        # The reference run starts now, while the job's ranks wait out their collectives' timeout (the CPUs idle), on
        # the newest checkpoint published: the one the restart resumes, unless a step's save still completed after
        # the cut (then the reference runs again below, on the restart's checkpoint).
        hand_tag = (tmp_path / "elastic" / "ck" / "latest").read_text().strip()
        hand, hand_dir = resume_by_hand(hand_tag, "by-hand")
        returncode = job.wait(timeout=600)
    finally:
        end_job(job)
        cluster.reset_host(3)
    output = log.read_text()
    assert returncode == 0, output[-8000:]
    events = [r for r in read_metrics(str(metrics), events=True) if "event" in r]
    assert [(e["event"], e["hosts_left_out"], e["world_size"]) for e in events] == [("restart", ["dsnode3"], 3)], output
    resumed_at = events[0]["step"]
    assert resumed_at in (2, 4) and "deepseek-ds: leaving out dsnode3 (--exclude dsnode3): 3 ranks" in output
    elastic = read_metrics(str(metrics))
    assert [r["step"] for r in elastic] == list(range(1, 9))
    assert [r["consumed_samples"] for r in elastic] == [12 * s for s in range(1, 9)]
    step = resumed_at + 1
    if step in before:  # the same samples, the same weights: the loss the lost attempt logged for that step
        assert elastic[step - 1]["loss"] == pytest.approx(before[step], rel=1e-6)

    tag = f"step{resumed_at:08d}"
    hand.wait(timeout=600)
    if tag != hand_tag:
        hand, hand_dir = resume_by_hand(tag, "by-hand-again")
        hand.wait(timeout=600)
    assert hand.returncode == 0, (hand_dir.parent / f"{hand_dir.name}.log").read_text()[-9000:]
    by_hand = read_metrics(str(hand_dir / "metrics.jsonl"))
    assert [r["step"] for r in by_hand] == list(range(step, 9))
    for mine, theirs in zip(elastic[step - 1:], by_hand, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6, abs=1e-7), mine["step"]
