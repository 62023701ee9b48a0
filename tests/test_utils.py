"""The shared helpers of deepseek_ds.utils: flag spellings, formatting, the launcher lookup, ports."""

from __future__ import annotations

import argparse
import os
import socket

import pytest

from deepseek_ds.utils import cli_args, fmt, net, system
from deepseek_ds.utils.errors import LaunchError, UserError, run_command

pytestmark = pytest.mark.unit


def test_every_multi_word_flag_has_both_spellings():
    assert cli_args.spellings("--num_gpus") == ["--num_gpus", "--num-gpus"]
    assert cli_args.spellings("--seq-len") == ["--seq-len", "--seq_len"]
    assert cli_args.spellings("--config") == ["--config"]
    p = argparse.ArgumentParser()
    cli_args.add_run_args(p)
    cli_args.add_world_args(p)
    for argv in (["--deepspeed_config", "x.json", "--num_gpus", "3"], ["--deepspeed-config", "x.json", "--num-gpus", "3"]):
        args = p.parse_args(["--config", "r.yaml", *argv])
        assert (args.deepspeed_config, args.num_gpus, args.set) == ("x.json", 3, [])


def test_tables_and_bytes():
    table = fmt.text_table([["a long name", "1,234"], ["b", "5"]], ["name", "tokens"]).splitlines()
    assert table == ["name           tokens", "-----------  --------", "a long name     1,234", "b                   5"]
    md = fmt.markdown_table([["0", "1.00 KiB"]], ["ZeRO", "bytes"]).splitlines()
    assert md[0].startswith("| ZeRO") and md[1].startswith("|:--") and md[1].endswith(":|")
    assert [fmt.human_bytes(n) for n in (None, 512, 1536, 3 * 2**30)] == ["-", "512 B", "1.50 KiB", "3.00 GiB"]


def test_the_deepspeed_launcher_of_this_environment_comes_first(monkeypatch):
    assert system.deepspeed_executable() == os.path.join(system.bin_dir(), "deepspeed")
    monkeypatch.setattr(system.shutil, "which", lambda *a, **k: None)
    with pytest.raises(LaunchError, match="not on PATH"):
        system.deepspeed_executable()


def test_free_port_can_be_bound():
    port = net.free_port()
    assert 1024 <= port <= 65535  # an unprivileged port the OS chose, not 0 or a placeholder
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port


def _raising(error: Exception):
    def command():
        raise error
    return command


def test_run_command_reports_user_errors_with_their_exit_status(capsys):
    assert run_command(lambda: None) == 0
    assert run_command(_raising(UserError("bad field", hint="fix it"))) == 2
    assert capsys.readouterr().err == "deepseek-ds: error: bad field (fix it)\n"
    assert run_command(_raising(LaunchError("launch exited with 1"))) == 1
    with pytest.raises(KeyError):
        run_command(_raising(KeyError("a bug")))
