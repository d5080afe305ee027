"""``paratrain verify`` passes a correct setup and names the cause of each broken one."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import paratrain
from paratrain.datasets.images import DatasetNotFound, find_fashion_mnist
from paratrain.verify import cli as verify_module
from paratrain.verify.runner import Factorization, ProbeSetup, parse_factorizations, verify

TESTS = Path(__file__).parent


# -- setups: module-level so the probe's child processes can import them -----------
def mlp_model():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def batchnorm_model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))


def batchnorm_dropout_model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.3),
                         nn.Linear(16, 2))


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def masked_data():
    """Labels partly ignored (-100), unevenly: micro-batches hold different valid counts."""
    x, y = data().tensors
    y = y.clone()
    y[[0, 1, 2, 5, 9, 12, 13]] = -100
    return TensorDataset(x, y)


def global_step_fn(run, model, batch):
    """Correct: summed loss, divided by the global count of valid labels."""
    x, y = batch
    loss_sum, count = paratrain.losses.token_cross_entropy(model(x), y)
    run.backward(loss_sum, count=count)


def rank_rng_loader(run, dataset, micro_batch):
    """Broken: the shuffle comes from each rank's own RNG stream, not a shared seed."""
    order = torch.randperm(len(dataset))
    return DataLoader(Subset(dataset, order[run.rank::run.world_size].tolist()),
                      batch_size=micro_batch)


def setup(**fields):
    return ProbeSetup(**{"model_fn": mlp_model, "data_fn": data, **fields})


def by_label(report):
    return {r.factorization.label: r for r in report.results}


# -- pure logic -------------------------------------------------------------------------
def test_factorizations_parse_and_get_the_reference_first():
    parsed = parse_factorizations(["2x4x1", "1x2x4", "2x4x1"])
    assert [f.label for f in parsed] == ["1x8x1", "2x4x1", "1x2x4"]
    assert Factorization.parse("2x2x2").global_batch == 8


@pytest.mark.parametrize("items, message", [
    (["2x4"], "is not WORLDxMICROxACCUM"),
    (["2x4x1", "1x4x1"], "must share one global batch"),
    (["0x4x1"], "world_size must be >= 1"),
    ([], "at least one"),
])
def test_bad_factorizations_are_named(items, message):
    with pytest.raises(ValueError, match=message):
        parse_factorizations(items)


def test_bad_setup_fields_are_named():
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        ProbeSetup(num_steps=0)
    with pytest.raises(ValueError, match="unknown strategy 'fsdp9'"):
        ProbeSetup(strategy="fsdp9")


# -- in one process: accumulation factorizations ----------------------------------------
def test_loss_averaged_per_micro_batch_is_flagged_and_global_count_passes():
    factorizations = ["1x8x1", "1x2x4", "1x4x2"]
    broken = verify(setup(data_fn=masked_data), factorizations=factorizations)
    assert not broken.ok
    for label in ("1x2x4", "1x4x2"):
        assert by_label(broken)[label].flagged and by_label(broken)[label].causes == ["loss"]
    assert "averaged per micro-batch" in broken.format()
    fixed = verify(setup(data_fn=masked_data, step_fn=global_step_fn),
                   factorizations=factorizations)
    assert fixed.ok, fixed.format()


@pytest.mark.parametrize("model_fn", [batchnorm_model, batchnorm_dropout_model])
def test_batchnorm_under_accumulation_is_flagged(model_fn):
    report = verify(setup(model_fn=model_fn), factorizations=["1x8x1", "1x2x4"],
                    no_dropout=True)
    result = by_label(report)["1x2x4"]
    assert result.flagged and result.data_matches and result.causes == ["batchnorm"]


def test_probing_leaves_the_callers_rng_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    verify(setup(), factorizations=["1x8x1", "1x4x2"])
    assert torch.equal(torch.rand(3), expected)


# -- with 2 gloo ranks -------------------------------------------------------------------
@pytest.mark.slow
def test_correct_setup_passes_every_factorization():
    report = verify(setup(data_fn=masked_data, step_fn=global_step_fn))
    assert [r.factorization.label for r in report.results] == ["1x8x1", "2x4x1", "2x2x2",
                                                               "1x2x4"]
    assert report.ok, report.format()
    assert all(max(r.grad_rel_diff, r.param_rel_diff) < 1e-5 and r.data_matches
               for r in report.results)


@pytest.mark.slow
def test_batchnorm_per_rank_and_dropout_are_flagged_with_causes():
    report = verify(setup(model_fn=batchnorm_dropout_model),
                    factorizations=["1x8x1", "2x4x1", "1x2x4"])
    results = by_label(report)
    # Across ranks both the statistics and the dropout masks differ ...
    assert results["2x4x1"].flagged and results["2x4x1"].causes == ["batchnorm", "dropout"]
    # ... in one process only the statistics (the dropout stream is the same).
    assert results["1x2x4"].causes == ["batchnorm"]


@pytest.mark.slow
def test_sampler_not_seeded_alike_on_all_ranks_is_flagged():
    report = verify(setup(loader_fn=rank_rng_loader),
                    factorizations=["1x8x1", "2x4x1", "1x2x4"])
    results = by_label(report)
    assert results["2x4x1"].flagged and not results["2x4x1"].data_matches
    assert results["2x4x1"].causes == ["sampler"]
    assert not results["1x2x4"].flagged  # one process: one RNG stream, nothing to disagree


# -- the command ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--factorizations", "2x4x1,1x2x2"], "must share one global batch"),
    (["--model", "no_such_module:fn"], "--model 'no_such_module:fn' cannot be imported"),
    (["--step", "nocolon"], "--step must be MODULE:FUNCTION"),
    (["--steps", "0"], "num_steps must be >= 1"),
])
def test_cli_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert verify_module.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--factorizations", "2x4x1,1x2x2"], "must share one global batch"),
    (["--tolerance", "-1"], "tolerance must be > 0"),
    (["--accelerator", "tpu"], "accelerator must be"),
])
def test_cli_bad_argument_fails_before_touching_the_dataset(argv, message, capsys, monkeypatch):
    import paratrain.datasets.images

    touched = []

    def no_data(*args, **kwargs):
        touched.append(args)
        raise DatasetNotFound("Fashion-MNIST not found")
    monkeypatch.setattr(paratrain.datasets, "find_fashion_mnist", no_data)
    monkeypatch.setattr(paratrain.datasets, "fashion_mnist", no_data)
    assert verify_module.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and touched == []


def test_accelerator_auto_picks_cuda_when_every_process_gets_a_gpu(monkeypatch):
    from paratrain.verify.probe import resolve_accelerator

    factorizations = parse_factorizations(["2x4x1", "1x2x4"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_accelerator("auto", factorizations) == "cuda"
    assert resolve_accelerator("cpu", factorizations) == "cpu"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_accelerator("auto", factorizations[::2]) == "cuda"  # 1x8x1, 1x2x4
    assert resolve_accelerator("auto", factorizations) == "cpu"
    with pytest.raises(ValueError, match="2x4x1 needs 2 GPUs .* 1 visible; use --accelerator cpu"):
        resolve_accelerator("cuda", factorizations)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_accelerator("auto", factorizations[::2]) == "cpu"


def test_report_says_where_the_probes_ran():
    report = verify(setup(), factorizations=["1x8x1", "1x4x2"])
    assert report.accelerator == ("cuda" if torch.cuda.is_available() else "cpu")
    assert report.format().splitlines()[0].endswith(f"on {report.accelerator}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_accumulation_on_cuda_matches_the_reference():
    report = verify(setup(data_fn=masked_data, step_fn=global_step_fn),
                    factorizations=["1x8x1", "1x2x4"])
    assert report.accelerator == "cuda" and report.ok, report.format()


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "paratrain.cli", "verify", *argv], cwd=TESTS,
                          capture_output=True, text=True, timeout=300)


def test_cli_flags_a_broken_user_setup_with_exit_1(capsys):
    argv = ["--model", "test_verify:batchnorm_model", "--data", "test_verify:data",
            "--factorizations", "1x8x1,1x4x2"]
    assert verify_module.main(argv) == 1
    out = capsys.readouterr().out
    assert "FLAGGED" in out and "BatchNorm normalises" in out


def have_data():
    try:
        find_fashion_mnist()
    except DatasetNotFound:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not have_data(), reason="Fashion-MNIST missing: apt-get install dataset-fashion-mnist")
def test_cli_default_demo_setup_passes():
    done = run_cli("--steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    for label in ("1x8x1", "2x4x1", "2x2x2", "1x2x4"):
        assert label in done.stdout
    assert "all factorizations match the reference" in done.stdout


def test_arguments_are_checked_before_the_data_is_looked_for(monkeypatch, capsys):
    import paratrain.datasets.images

    def no_data(*args, **kwargs):
        raise FileNotFoundError("Fashion-MNIST not found")

    monkeypatch.setattr(paratrain.datasets, "find_fashion_mnist", no_data)
    assert verify_module.main(["--factorizations", "2x4x1,1x2x2"]) == 2
    assert "must share one global batch" in capsys.readouterr().err


def test_auto_accelerator_uses_cuda_only_when_every_probe_gets_its_own_gpus():
    from paratrain.verify.runner import parse_factorizations, resolve_accelerator

    factorizations = parse_factorizations(["1x8x1", "2x4x1"])
    assert resolve_accelerator("auto", factorizations, num_gpus=0) == "cpu"
    assert resolve_accelerator("auto", factorizations, num_gpus=1) == "cpu"
    assert resolve_accelerator("auto", factorizations, num_gpus=2) == "cuda"
    assert resolve_accelerator("cpu", factorizations, num_gpus=8) == "cpu"
