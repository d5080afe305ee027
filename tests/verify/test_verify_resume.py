"""``paratrain verify --resume`` passes an exact resume and names the first thing that differs."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paratrain.checkpoint import sharded
from paratrain.verify import cli as verify_module
from paratrain.verify.resume import first_difference, verify_resume
from paratrain.verify.runner import ProbeSetup


# -- setups: module-level so the probe's child processes can import them -----------
def bn_model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.2),
                         nn.Linear(16, 2))


def bn_model_without_rank_buffers():
    """The model, in a process whose sharded checkpoints keep one copy of each buffer
    (as before they kept every rank's): what verify --resume must catch."""
    sharded._rank_buffers = lambda *args: {}
    return bn_model()


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 6, generator=g)  # 4 steps per epoch at 8: resumes mid-epoch
    return TensorDataset(x, (x[:, 0] > 0).long())


def plain_loader(run, dataset, micro_batch):
    """Not resumable: a resumed run reads the epoch from its first batch again."""
    return DataLoader(dataset, batch_size=micro_batch)


def setup(**fields):
    return ProbeSetup(**{"model_fn": bn_model, "data_fn": data, "num_steps": 2, **fields})


# -- pure logic -------------------------------------------------------------------------
def snap(**categories):
    return {name.replace("_", " "): values for name, values in categories.items()}


def test_the_first_difference_is_named_causes_first():
    same = snap(step_counter={"": 2}, parameter={"'w'": torch.ones(3)})
    assert first_difference([same, same], [same, same]) is None
    moved = snap(step_counter={"": 2}, parameter={"'w'": torch.tensor([1.0, 1.5, 1.0])})
    assert first_difference([same, same], [same, moved]) == (
        "parameter 'w' on rank 1 (max abs diff 5.0e-01)")
    # Other samples explain other parameters: the samples are named, not the effect.
    later = {**moved, "samples": {"": torch.tensor([1.0, 2.0])}}
    assert first_difference([{**same, "samples": {"": torch.tensor([1.0, 3.0])}}] * 2,
                            [same, later])[:len("samples on rank 0")] == "samples on rank 0"
    cursor = snap(data_cursor={"": torch.tensor([0, 8])})
    assert first_difference([cursor], [snap(data_cursor={"": torch.tensor([0, 0])})]) == (
        "data cursor on rank 0 (uninterrupted [0, 8], resumed [0, 0])")
    assert first_difference([snap(buffer={"'b'": torch.zeros(1)})], [snap(buffer={})]) == (
        "buffer 'b' on rank 0 (missing after resuming)")
    assert first_difference([snap(step_counter={"": 2})], [snap(step_counter={"": 0})]) == (
        "step counter on rank 0 (uninterrupted 2, resumed 0)")
    nan = torch.tensor([float("nan")])
    assert first_difference([snap(parameter={"'w'": nan})], [snap(parameter={"'w'": nan})]) is None


# -- in one process ------------------------------------------------------------------------
def test_single_process_resume_is_exact_with_dropout_and_batchnorm():
    report = verify_resume(setup(), factorizations=["1x8x1"])
    assert report.ok, report.format()
    assert report.format().splitlines()[1].split() == ["1x8x1", "single", "ok"]


def test_a_loader_that_restarts_its_epoch_is_named():
    report = verify_resume(setup(loader_fn=plain_loader), factorizations=["1x8x1"])
    assert not report.ok
    assert report.results[0].difference.startswith(
        "resume: differs at step 3: samples on rank 0 (max abs diff")


# -- with 2 gloo ranks -------------------------------------------------------------------
VERIFY_FSDP = ["--resume", "--strategy", "fsdp", "--data", "test_verify_resume:data",
               "--factorizations", "2x4x1", "--steps", "2"]


@pytest.mark.slow
def test_fsdp_batchnorm_resume_passes(capsys):
    assert verify_module.main([*VERIFY_FSDP, "--model", "test_verify_resume:bn_model"]) == 0
    out = capsys.readouterr().out
    assert "2x4x1     fsdp      ok" in out and "resume is exact" in out


@pytest.mark.slow
def test_fsdp_buffers_saved_once_are_caught(capsys):
    """Without per-rank buffers in the sharded checkpoint, rank 0 resumes with rank 1's."""
    argv = [*VERIFY_FSDP, "--model", "test_verify_resume:bn_model_without_rank_buffers"]
    assert verify_module.main(argv) == 1
    out = capsys.readouterr().out
    assert ("resume: differs after loading step 2: buffer '1.running_mean' on rank 0 "
            "(max abs diff") in out


@pytest.mark.slow
def test_pipeline_stages_resume_exactly():
    report = verify_resume(setup(strategy="pipeline",
                                 strategy_options={"split_points": (2,), "num_microbatches": 2}),
                           factorizations=["2x8x1"])
    assert report.ok, report.format()


# -- the command ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--resume", "--tolerance", "1e-3"], "--tolerance does not apply to --resume"),
    (["--resume", "--factorizations", "2x4"], "is not WORLDxMICROxACCUM"),
    (["--strategy-options", "{split"], "--strategy-options must be a JSON object"),
    (["--strategy", "fsdp", "--strategy-options", '{"nope": 1}'],
     "strategy_options has unknown field(s) ['nope'] for strategy 'fsdp'"),
])
def test_cli_bad_resume_input_is_one_line_and_exit_2(argv, message, capsys):
    assert verify_module.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
