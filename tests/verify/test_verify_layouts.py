"""``paratrain verify`` under sharded, tensor-parallel and pipeline strategies: gradients are
compared whole (a shard or a stage is not the model), and ranks that read one batch together
(tensor-parallel peers, pipeline stages) count their samples once."""

from __future__ import annotations

import pytest

from paratrain.verify import cli as verify_module

LAYOUTS = {
    "fsdp": "{}",
    "zero2": "{}",
    # The test MLP is Sequential(Linear, Tanh, Linear): split the pair Megatron-style.
    "tp": '{"plan": {"0": "colwise", "2": "rowwise"}}',
    "pipeline": '{"split_points": [2]}',
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(LAYOUTS))
def test_each_layout_matches_the_reference_with_exit_0(strategy, capsys):
    argv = ["--model", "test_verify:mlp_model", "--data", "test_verify:data", "--steps", "2",
            "--factorizations", "2x4x1", "--strategy", strategy,
            "--strategy-options", LAYOUTS[strategy]]
    code = verify_module.main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    row = next(line for line in captured.out.splitlines() if line.startswith("2x4x1"))
    assert row.endswith("ok"), captured.out
    assert "all factorizations match the reference" in captured.out


def test_a_failed_probe_is_one_line_with_exit_2(capsys):
    argv = ["--model", "test_verify:mlp_model", "--data", "test_verify:data", "--steps", "1",
            "--factorizations", "2x4x1", "--strategy", "tp"]
    assert verify_module.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paratrain verify: a multi-process probe failed: rank ")
    assert "raised ValueError: no adapter knows Sequential" in err and "\n" not in err
