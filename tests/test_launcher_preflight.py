"""Preflight without a cluster: the env-file rules, the probe run locally, and every verdict on
made-up probe results. The real multi-host runs are in test_multihost.py."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deepseek_ds.launcher import envfile, preflight, probe, remote
from deepseek_ds.launcher.bandwidth import RESULT_MARKER, bandwidth_command
from deepseek_ds.launcher.preflight import PreflightOptions, Status, format_report, run_preflight

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# ---------------------------------------------------------------- .deepspeed_env


def test_deepspeed_env_parses_key_values():
    assert envfile.parse_deepspeed_env("A=1\nNCCL_IB_HCA==mlx5_0:1\nB=x=y\n", "e") == \
        {"A": "1", "NCCL_IB_HCA": "=mlx5_0:1", "B": "x=y"}


@pytest.mark.parametrize("text, expected", [
    ("A=1\n\nB=2\n", "e:2: blank line"),           # DeepSpeed: ValueError, not enough values to unpack
    ("# NCCL=1\nA=1\n", "e:1: comment line"),       # DeepSpeed: `export # NCCL=1; ...` runs nothing
    ("A=1\nNOEQUALS\n", "e:2: 'NOEQUALS' is not KEY=VALUE"),
    ("1A=1\n", "is not KEY=VALUE"),
])
def test_deepspeed_env_rejects_what_breaks_the_launcher(text, expected):
    with pytest.raises(envfile.EnvFileError, match=expected):
        envfile.parse_deepspeed_env(text, "e")


def test_env_files_are_read_in_deepspeed_order(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (cwd / ".deepspeed_env").write_text("A=cwd\n")
    paths = envfile.deepspeed_env_paths({"HOME": str(home)}, cwd)
    assert paths == [home / ".deepspeed_env", cwd / ".deepspeed_env"]
    files = [envfile.read_deepspeed_env(p) for p in paths]
    env = envfile.launch_environment(files, {"NCCL_DEBUG": "INFO", "B": "launcher", "A": "launcher"})
    assert env == {"NCCL_DEBUG": "INFO", "A": "cwd", "B": "home"}  # only NCCL* leaks from the launcher
    (cwd / "custom").write_text("C=1\n")
    assert envfile.deepspeed_env_paths({"HOME": str(home), "DS_ENV_FILE": "custom"}, cwd) == [cwd / "custom"]


@pytest.mark.parametrize("spec, expected", [
    ("eth", ["eth0", "eth1"]),
    ("=eth0", ["eth0"]),
    ("^eth,lo", ["ib0", "docker0"]),
    ("^=eth0", ["lo", "eth1", "ib0", "docker0"]),
    ("ib0,eth1", ["eth1", "ib0"]),
    ("mlx5_0:1,eth1:2", ["eth1"]),   # NCCL_IB_HCA style ports are ignored
    ("bond", []),
])
def test_nccl_interface_selection(spec, expected):
    assert envfile.nccl_select(spec, ["lo", "eth0", "eth1", "ib0", "docker0"]) == expected


def test_gloo_interfaces_are_exact_names():
    assert envfile.gloo_missing("eth0,eth", ["lo", "eth0", "eth1"]) == ["eth"]


# ---------------------------------------------------------------- probe, run here


def test_probe_over_stdin_like_ssh(tmp_path):
    source = Path(probe.__file__).read_text()
    out = subprocess.run([PYTHON, "-", "--port", "0", "--checkpoint-dir", str(tmp_path)], input=source,
                         capture_output=True, text=True, check=True)
    facts = json.loads(out.stdout.split(probe.MARKER, 1)[1])
    assert facts["executable"] == PYTHON
    assert facts["packages"]["deepspeed"] and facts["packages"]["torch"]
    assert facts["port"]["free"] is True
    assert facts["checkpoint_dir"]["ok"] is True
    assert list(tmp_path.iterdir()) == []  # the write test cleans up after itself


def test_probe_port_in_use():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        assert probe.port_free(s.getsockname()[1]) == {"free": False, "error": "in use"}


def test_probe_checkpoint_dir(tmp_path):
    assert probe.checkpoint_dir_status(str(tmp_path))["ok"]
    later = probe.checkpoint_dir_status(str(tmp_path / "a" / "b"))
    assert later["ok"] and "can be created" in later["detail"]
    (tmp_path / "file").write_text("")
    assert probe.checkpoint_dir_status(str(tmp_path / "file")) == \
        {"ok": False, "detail": f"{tmp_path / 'file'} exists and is not a directory"}
    # /proc refuses new files even to root.
    assert probe.checkpoint_dir_status("/proc")["ok"] is False


def test_probe_reads_infiniband_sysfs(tmp_path):
    for device, port, state in [("mlx5_0", "1", "4: ACTIVE"), ("mlx5_1", "1", "1: DOWN")]:
        d = tmp_path / device / "ports" / port
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "link_layer").write_text("InfiniBand\n")
    assert probe.infiniband_ports(str(tmp_path)) == {
        "mlx5_0": [{"port": "1", "state": "4: ACTIVE", "link_layer": "InfiniBand"}],
        "mlx5_1": [{"port": "1", "state": "1: DOWN", "link_layer": "InfiniBand"}]}
    assert probe.infiniband_ports(str(tmp_path / "none")) == {}


# ---------------------------------------------------------------- verdicts on made-up hosts


def facts(gpus=8, ib=None, interfaces=("lo", "eth0", "ib0"), torch="2.13.0", port_free=True, ckpt_ok=True):
    return {"python": "3.11.7", "executable": PYTHON, "packages": {"torch": torch, "deepspeed": "0.19.8"},
            "gpus": {"count": gpus, "error": None if gpus else "nvidia-smi not found"},
            "infiniband": {"mlx5_0": [{"port": "1", "state": "4: ACTIVE", "link_layer": "InfiniBand"}]}
            if ib is None else ib,
            "interfaces": list(interfaces), "port": {"free": port_free, "error": None if port_free else "in use"},
            "first_address": "10.0.0.1", "checkpoint_dir": {"ok": ckpt_ok, "detail": "d"}}


def run_with(monkeypatch, tmp_path, per_host, hostfile="a slots=8\nb slots=8\n", env_text=None, sees=None,
             calls=None, **options):
    """run_preflight with each host's probe result replaced by per_host[host] (facts or a ProbeResult), and
    whether each other host reads back the first host's checkpoint-dir token by sees[host] (default: yes); each
    round of probes' arguments are appended to `calls`."""
    (tmp_path / "hosts").write_text(hostfile)
    if env_text is not None:
        (tmp_path / ".deepspeed_env").write_text(env_text)
    calls = [] if calls is None else calls

    def fake_probe_hosts(hosts, python, args_for, timeout, ssh_port=None):
        calls.append({h: args_for[h] for h in hosts})
        if len(calls) == 1:  # the facts
            assert "--port" in args_for[hosts[0]] and all("--port" not in args_for[h] for h in hosts[1:])
            return {h: per_host[h] if isinstance(per_host[h], remote.ProbeResult)
                    else remote.ProbeResult(h, 0.1, _with_token(per_host[h], args_for[h])) for h in hosts}
        mode, path = args_for[hosts[0]]
        if mode == "--expect-token":  # the other hosts read it back
            return {h: remote.ProbeResult(h, 0.1, {"token": {"seen": (sees or {}).get(h, True), "detail": "d"}})
                    for h in hosts}
        assert mode == "--remove-token" and hosts == list(calls[0])[:1]
        return {hosts[0]: remote.ProbeResult(hosts[0], 0.1, {"token": {"removed": True, "detail": "d"}})}

    monkeypatch.setattr(remote, "probe_hosts", fake_probe_hosts)
    opts = PreflightOptions(hostfile=tmp_path / "hosts", cwd=tmp_path, environ={"HOME": str(tmp_path / "nohome")},
                            checkpoint_dir="/ckpt", **options)
    _, checks = run_preflight(opts)
    return {(c.host, c.name): c for c in checks}, checks


def _with_token(facts: dict, args: list[str]) -> dict:
    """The first host's facts, with the token file it was asked to write."""
    if "--share-token" not in args or not facts["checkpoint_dir"]["ok"]:
        return facts
    token = args[args.index("--share-token") + 1]
    path = f"/ckpt/{probe.TOKEN_PREFIX}{token}"
    return {**facts, "checkpoint_dir": {**facts["checkpoint_dir"], "token": {"path": path, "detail": "wrote"}}}


def test_healthy_gpu_cluster_passes(monkeypatch, tmp_path):
    by, checks = run_with(monkeypatch, tmp_path, {"a": facts(), "b": facts()},
                          env_text="NCCL_SOCKET_IFNAME=eth\nGLOO_SOCKET_IFNAME=eth0\nNCCL_IB_HCA=mlx5\n")
    assert not preflight.failed(checks)
    assert {c.status for c in checks} == {Status.PASS}
    assert by[("a", "gpus")].detail == "8 GPUs, 8 slots used"
    assert by[("a", "master")].detail.startswith("port 29500 free; DeepSpeed will use address 10.0.0.1")
    assert ("b", "master") not in by  # only the first host hosts the rendezvous
    assert format_report(checks).endswith("preflight passed")


def test_each_failure_names_host_and_fix(monkeypatch, tmp_path):
    ib_down = {"mlx5_0": [{"port": "1", "state": "1: DOWN", "link_layer": "InfiniBand"}]}
    by, checks = run_with(monkeypatch, tmp_path, {
        "a": facts(gpus=4, port_free=False),
        "b": facts(ib=ib_down, torch="2.12.0", interfaces=("lo", "ens1"), ckpt_ok=False)},
        env_text="GLOO_SOCKET_IFNAME=eth0\n")
    expected = {
        ("a", "gpus"): ("4 GPUs, but slot 7 is used", "set 'a slots=4'"),
        ("a", "master"): ("port 29500 on a: in use", "--master_port"),
        ("b", "versions"): ("torch 2.12.0", "same Python, torch and DeepSpeed"),
        ("b", "infiniband"): ("no ACTIVE port: mlx5_0:1 (DOWN)", "ibstat"),
        ("b", "interfaces"): ("GLOO_SOCKET_IFNAME names missing eth0 (has: lo, ens1)", "ip -br link"),
        ("b", "checkpoint dir"): ("d", "writable"),
    }
    assert {k for k, c in by.items() if c.status is Status.FAIL} == set(expected)
    for key, (detail, fix) in expected.items():
        assert detail in by[key].detail and fix in by[key].fix, by[key]
    assert "a has" in by[("b", "versions")].detail  # the reference host is named
    report = format_report(checks)
    assert report.splitlines()[-1] == "preflight FAILED: 6 checks on a, b"
    assert report.count("fix: ") == 6


def test_checkpoint_dir_must_be_one_directory_all_hosts_see(monkeypatch, tmp_path):
    hosts, calls = "a slots=8\nb slots=8\nc slots=8\n", []
    by, checks = run_with(monkeypatch, tmp_path, {h: facts() for h in "abc"}, hostfile=hosts, calls=calls)
    assert by[("*", "checkpoint shared")].status is Status.PASS
    assert by[("*", "checkpoint shared")].detail == "2 other hosts read back the file a wrote in /ckpt"
    first, readers, removal = calls
    token = first["a"][first["a"].index("--share-token") + 1]
    assert len(token) == 32 and all("--share-token" not in first[h] for h in "bc")  # random, first host only
    path = f"/ckpt/{probe.TOKEN_PREFIX}{token}"
    assert readers == {"b": ["--expect-token", path], "c": ["--expect-token", path]}
    assert removal == {"a": ["--remove-token", path]}  # after everyone read it

    by, checks = run_with(monkeypatch, tmp_path, {h: facts() for h in "abc"}, hostfile=hosts, sees={"c": False})
    shared = by[("*", "checkpoint shared")]
    assert shared.status is Status.FAIL and preflight.failed(checks) == [shared]  # each host alone: writable
    assert shared.detail.startswith("1 host of 3 do not see the file a wrote in /ckpt (c: d): /ckpt is not one")
    assert "shared filesystem" in shared.fix and "checkpoint.dir" in shared.fix

    by, _ = run_with(monkeypatch, tmp_path, {"a": facts(ckpt_ok=False), "b": facts()})
    assert ("*", "checkpoint shared") not in by and by[("a", "checkpoint dir")].status is Status.FAIL
    calls.clear()
    by, _ = run_with(monkeypatch, tmp_path, {"a": facts()}, hostfile="a slots=8\n", calls=calls)
    assert ("*", "checkpoint shared") not in by and len(calls) == 1  # one host: nothing to share


def test_token_file_round_trip_through_the_probe(tmp_path):
    source = Path(probe.__file__).read_text()

    def probe_here(*args):
        out = subprocess.run([PYTHON, "-", *args], input=source, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.split(probe.MARKER, 1)[1])

    # checkpoint.dir does not exist yet: the token goes where it would be created
    written = probe_here("--checkpoint-dir", str(tmp_path / "ckpt"), "--share-token", "f00d")["checkpoint_dir"]
    path = tmp_path / f"{probe.TOKEN_PREFIX}f00d"
    assert written["token"] == {"path": str(path), "detail": f"wrote {path}"} and path.read_text() == "f00d"
    assert probe_here("--expect-token", str(path)) == {"token": {"seen": True, "detail": f"read {path}"}}
    elsewhere = tmp_path / "other-host-local-disk"
    elsewhere.mkdir()
    (elsewhere / path.name).write_text("stale")
    assert probe_here("--expect-token", str(elsewhere / path.name))["token"]["seen"] is False  # not our token
    assert probe_here("--remove-token", str(path))["token"]["removed"] is True and not path.exists()
    missing = probe_here("--expect-token", str(path))["token"]
    assert missing == {"seen": False, "detail": f"{path}: No such file or directory"}


def test_unreachable_host_reports_only_ssh(monkeypatch, tmp_path):
    down = remote.ProbeResult("b", 0.0, None, "ssh connection refused", "start sshd on b")
    by, _ = run_with(monkeypatch, tmp_path, {"a": facts(), "b": down})
    assert [k for k in by if k[0] == "b"] == [("b", "ssh")]
    assert by[("b", "ssh")].status is Status.FAIL and by[("b", "ssh")].fix == "start sshd on b"


def test_cpu_hosts_fail_unless_allowed(monkeypatch, tmp_path):
    cpu = facts(gpus=None, ib={})
    by, _ = run_with(monkeypatch, tmp_path, {"a": cpu, "b": cpu})
    assert by[("a", "gpus")].status is Status.FAIL and "--allow-cpu" in by[("a", "gpus")].fix
    assert by[("a", "infiniband")].status is Status.WARN and "NCCL_IB_DISABLE" in by[("a", "infiniband")].fix
    by, checks = run_with(monkeypatch, tmp_path, {"a": cpu, "b": cpu}, allow_cpu=True)
    assert by[("a", "gpus")].status is Status.WARN and by[("a", "gpus")].detail.startswith("cpu: ")
    assert by[("a", "infiniband")].status is Status.SKIP
    assert not preflight.failed(checks)


@pytest.mark.parametrize("env_text, status, detail", [
    ("NCCL_IB_HCA=mlx5_1\n", Status.FAIL, "NCCL_IB_HCA=mlx5_1 matches none of mlx5_0, mlx4_0"),
    ("NCCL_IB_HCA=^mlx4\n", Status.PASS, "mlx5_0:1 ACTIVE (InfiniBand)"),
    ("NCCL_IB_HCA=mlx\n", Status.WARN, "ACTIVE: mlx5_0:1; not: mlx4_0:1 (INIT)"),
    ("NCCL_IB_DISABLE=1\n", Status.SKIP, "NCCL uses TCP sockets"),
])
def test_infiniband_follows_nccl_ib_hca(monkeypatch, tmp_path, env_text, status, detail):
    ib = {"mlx5_0": [{"port": "1", "state": "4: ACTIVE", "link_layer": "InfiniBand"}],
          "mlx4_0": [{"port": "1", "state": "2: INIT", "link_layer": "Ethernet"}]}
    by, _ = run_with(monkeypatch, tmp_path, {"a": facts(ib=ib), "b": facts(ib=ib)}, env_text=env_text)
    assert by[("a", "infiniband")].status is status
    assert detail in by[("a", "infiniband")].detail


def test_broken_env_file_fails_before_launch(monkeypatch, tmp_path):
    by, _ = run_with(monkeypatch, tmp_path, {"a": facts(), "b": facts()}, env_text="# NCCL tuning\nNCCL_DEBUG=INFO\n")
    assert by[("*", "env file")].status is Status.FAIL
    assert "comment line" in by[("*", "env file")].detail and "launch/nccl.env" in by[("*", "env file")].fix


def test_only_selected_hosts_are_probed(monkeypatch, tmp_path):
    by, _ = run_with(monkeypatch, tmp_path, {"b": facts(gpus=2)}, include="b:0,1")
    assert by[("*", "hostfile")].detail.endswith("1 host, 2 slots")
    assert by[("b", "gpus")].status is Status.PASS  # slots 0,1 need only 2 GPUs


@pytest.mark.parametrize("stderr, cause, fix", [
    ("ssh: connect to host n1 port 22: Connection refused", "refused", "start sshd on n1"),
    ("ssh: Could not resolve hostname n1: Name or service not known", "does not resolve", "/etc/hosts"),
    ("root@n1: Permission denied (publickey).", "key not accepted", "ssh-copy-id n1"),
    ("Host key verification failed.", "host key", "ssh n1 true"),
    ("ssh: connect to host n1 port 22: Connection timed out", "timed out", "firewall"),
    ("kex_exchange_identification: read: Connection reset by peer", "ssh failed: kex", "ssh -o BatchMode=yes n1"),
])
def test_ssh_errors_become_causes_and_fixes(monkeypatch, stderr, cause, fix):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 255, "", stderr))
    result = remote.run_probe("n1", PYTHON, [], timeout=5)
    assert result.facts is None and result.stage == "ssh"
    assert cause in result.error and fix in result.fix


def test_ssh_command_is_batch_mode_with_timeouts():
    command = remote.probe_command("n1", "/venv/bin/python", ["--port", "29500"], timeout=7, ssh_port=2222)
    assert command == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=7", "-p", "2222", "n1",
                       "/venv/bin/python - --port 29500"]
    assert remote.probe_command("localhost", "/p y", [], 7, None) == ["bash", "-c", "'/p y' -"]


def test_missing_python_on_host(tmp_path):
    result = remote.run_probe("localhost", str(tmp_path / "no-python"), [], timeout=5)
    assert result.stage == "python" and "not found on localhost" in result.error
    assert "same Python environment" in result.fix


# ---------------------------------------------------------------- the command, on this machine


def preflight_cli(*args, cwd):
    return subprocess.run([PYTHON, "-m", "deepseek_ds.launcher", "preflight", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_cli_on_localhost_hostfile(tmp_path):
    out = preflight_cli("--hostfile", str(REPO / "hostfiles" / "localhost"), "--include", "localhost:0,1",
                        "--allow-cpu", "--checkpoint-dir", str(tmp_path / "ckpt"), "--master-port", "29533",
                        "--no-ssh-check", cwd=tmp_path)
    if shutil.which("nvidia-smi") is None:
        assert out.returncode == 0, out.stdout + out.stderr
        assert re.search(r"localhost +gpus +WARN +cpu: ", out.stdout)
        assert out.stdout.splitlines()[-1].startswith("preflight passed")
    assert re.search(r"localhost +ssh +PASS +local; the launch skips DeepSpeed's ssh check", out.stdout)


def test_localhost_ssh_is_checked_as_deepspeeds_hostfile_launch_does(tmp_path):
    """`deepspeed --hostfile` ssh-es even to a single localhost: preflight reports what that launch will meet."""
    out = preflight_cli("--hostfile", str(REPO / "hostfiles" / "localhost"), "--include", "localhost:0,1",
                        "--allow-cpu", "--master-port", "29534", "--timeout", "5", cwd=tmp_path)
    works = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "localhost", "true"],
                           capture_output=True, timeout=30).returncode == 0 if shutil.which("ssh") else False
    if works:
        assert re.search(r"localhost +ssh +PASS +local; `ssh localhost` works", out.stdout)
    else:
        assert out.returncode == 1, out.stdout + out.stderr
        assert re.search(r"localhost +ssh +FAIL +local, but `ssh localhost` fails", out.stdout)
        assert "--no_ssh_check --master_addr 127.0.0.1" in out.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has GPUs")
def test_cli_exits_1_on_cpu_host_without_allow_cpu(tmp_path):
    out = preflight_cli("--hostfile", str(REPO / "hostfiles" / "localhost"), cwd=tmp_path)
    assert out.returncode == 1
    assert re.search(r"localhost +gpus +FAIL +no GPUs", out.stdout) and "fix: " in out.stdout


def test_cli_exits_2_on_bad_hostfile_or_filter(tmp_path):
    (tmp_path / "hosts").write_text("node-0 slots=8\nnode-0 slots=8\n")
    out = preflight_cli("--hostfile", str(tmp_path / "hosts"), cwd=tmp_path)
    assert out.returncode == 2 and "host 'node-0' is listed again" in out.stderr
    out = preflight_cli("--hostfile", str(REPO / "hostfiles" / "2node"), "--include", "node-7", cwd=tmp_path)
    assert out.returncode == 2 and "host 'node-7' is not in" in out.stderr
    out = preflight_cli("--hostfile", "x", "--include", "a", "--exclude", "b", cwd=tmp_path)
    assert out.returncode == 2 and "not allowed with argument" in out.stderr  # argparse: mutually exclusive


def test_bandwidth_command_for_a_local_job(tmp_path):
    opts = PreflightOptions(hostfile=Path("h"), include="localhost:0", master_port=29555, cwd=tmp_path)
    command = bandwidth_command(opts, ["localhost"])
    assert command[1:] == ["-m", "deepspeed.launcher.runner", "--hostfile", "h", "--master_port", "29555",
                           "--no_ssh_check", "--master_addr", "127.0.0.1", "--include", "localhost:0",
                           str(REPO / "deepseek_ds" / "launcher" / "allreduce_bench.py")]
    remote_opts = PreflightOptions(hostfile=Path("h"), ssh_port=2222)
    assert "--no_ssh_check" not in bandwidth_command(remote_opts, ["n0", "n1"])


def test_bandwidth_marker_matches_the_script():
    text = (REPO / "deepseek_ds" / "launcher" / "allreduce_bench.py").read_text()
    assert f'RESULT_MARKER = "{RESULT_MARKER}"' in text
