"""``paratrain COMMAND --help`` prints the command's usage and exits 0, for every command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from paratrain.cli import COMMANDS, main


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as done:  # argparse's --help exits
        return int(done.code or 0)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_prints_its_help_and_exits_0(command, flag, capsys):
    assert exit_code([command, flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: paratrain {command}"), out[:200]


def test_the_commands_listed_are_the_documented_ones():
    assert set(COMMANDS) >= {"launch", "demo", "verify", "bench", "plan", "slurm"}


def test_paratrain_help_lists_every_command(capsys):
    assert exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {command} " in out for command in COMMANDS)


def test_slurm_help_from_the_shell_exits_0():
    done = subprocess.run([sys.executable, "-m", "paratrain.cli", "slurm", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: paratrain slurm") and not done.stderr
