"""``paratrain plan`` on the command line: JSON output, calibration, one-line errors."""

from __future__ import annotations

import json

import pytest

from paratrain.plan import STRATEGIES
from paratrain.plan.cli import main


def test_cli_json_output(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["--num-parameters", "1000000000", "--layers", "32", "--time-per-sample", "30ms",
                 "--activation-bytes", "100MB", "--devices-per-node", "8", "--nodes", "2",
                 "--bandwidth", "100GB", "--inter-node-bandwidth", "100Gbit", "--latency", "5us",
                 "--batch-size", "4", "--device-memory", "16GB", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["hardware"]["inter_node_bandwidth"] == pytest.approx(12.5e9)
    assert data["hardware"]["device_memory_bytes"] == 16 * 10**9
    assert len(data["predictions"]) == len(STRATEGIES)
    ddp = next(p for p in data["predictions"] if p["strategy"] == "ddp")
    assert ddp["fits"] is False
    assert data["recommendation"] != "ddp"
    printed = capsys.readouterr().out
    assert "recommendation: " + data["recommendation"] in printed


def test_cli_calibrates_default_and_named_model(capsys):
    assert main(["--strategies", "ddp,fsdp", "--batch-size", "4", "--repeats", "1",
                 "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["profile"]["num_parameters"] == 431_242
    assert [p["strategy"] for p in data["predictions"]] == ["ddp", "fsdp"]
    assert main(["--model", "paratrain.plan.cli:default_model", "--input-shape", "1,28,28",
                 "--strategies", "single", "--batch-size", "2", "--repeats", "1"]) == 0
    assert "single" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "flag"), [
    (["--bandwidth", "10Gx"], "--bandwidth"),
    (["--latency", "fast"], "--latency"),
    (["--nodes", "0"], "--nodes"),
    (["--device-memory", "lots"], "--device-memory"),
    (["--strategies", "ddp,magic"], "--strategies"),
    (["--overlap", "2"], "--overlap"),
    (["--model", "no_such_module_xyz:make"], "--model"),
    (["--model", "nocolon"], "--model"),
    (["--input-shape", "1,x"], "--input-shape"),
    (["--input-shape", "3,32,32", "--repeats", "1"], "--input-shape"),
    (["--num-parameters", "10", "--model", "a:b"], "--model"),
    (["--num-parameters", "100", "--batch-size", "1", "--microbatches", "9"], "--microbatches"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err
