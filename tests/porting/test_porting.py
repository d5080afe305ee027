"""The "after" scripts of docs/porting.md: each runs with 2 workers and, where the math
allows, matches the same script run as one process.

One script (the Hugging Face Trainer one, which reads the launcher's environment through
transformers/accelerate) runs under a real `paratrain launch`; the others run unchanged as
``__main__`` on the persistent rank pool (``paratrain.testing.pool.run_script``), under
the same launcher environment, which saves an interpreter start and a torch import per
rank. They are all started the same way, so the launcher itself is exercised once here
(and by the examples' smoke runs in tests/test_examples.py).
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import paratrain.horovod as hvd
from paratrain.testing.pool import run_script

HERE = Path(__file__).resolve().parent
DOC = HERE.parents[1] / "docs" / "porting.md"
LINE = re.compile(r"rank (\d)/(\d) fingerprint (-?[\d.]+)")


def fingerprints(stdout):
    """The fingerprint both ranks printed, checked to be the same on both."""
    found = {int(r): (int(w), float(f)) for r, w, f in LINE.findall(stdout)}
    assert sorted(found) == [0, 1], stdout
    assert all(world == 2 for world, _ in found.values())
    # The replicas end bitwise identical (same printed fingerprint).
    assert found[0][1] == found[1][1]
    return found[0][1]


def launch(script, *args, timeout=240):
    """Under `paratrain launch --nproc-per-node 2`: the fingerprint and the launcher's stdout."""
    result = subprocess.run([sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node",
                             "2", str(HERE / script), *args],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return fingerprints(result.stdout), result.stdout


def on_two_ranks(script, *args, timeout=240):
    """The script unchanged as __main__ on 2 pool ranks: the fingerprint and the ranks' stdout."""
    runs = run_script(str(HERE / script), *args, nproc=2, timeout=timeout)
    for rank, run in enumerate(runs):
        assert run.returncode == 0, f"rank {rank}: {run.stderr[-3000:]}"
    stdout = "".join(run.stdout for run in runs)
    return fingerprints(stdout), stdout


def single_process(script, *args):
    spec = importlib.util.spec_from_file_location(f"porting_{script}", HERE / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(args))


def needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {missing}: run `make install` "
                              "(installs .[text] and scattertext)")


@pytest.mark.slow
@pytest.mark.parametrize("script, two_workers, one_process", [
    # Per-process batch on 2 workers vs the same global batch in one process.
    ("from_dataparallel", ["--batch-size", "8"], ["--batch-size", "16"]),
    ("from_ddp_torchrun", ["--batch-size", "8"], ["--batch-size", "16"]),
    ("from_accelerate", ["--batch-size", "4"], ["--batch-size", "8"]),
])
def test_paratrain_ports_match_one_process(script, two_workers, one_process):
    launched, _ = on_two_ranks(f"{script}.py", *two_workers)
    assert launched == pytest.approx(single_process(script, *one_process), abs=1e-4)


@pytest.mark.slow
def test_horovod_script_runs_with_only_the_import_changed():
    launched, stdout = on_two_ranks("from_horovod.py", "--batch-size", "4")
    assert "epoch 1 loss" in stdout
    hvd.shutdown()
    try:
        reference = single_process("from_horovod", "--batch-size", "8")
    finally:
        hvd.shutdown()
    assert launched == pytest.approx(reference, abs=1e-4)


@needs("transformers", "accelerate")
@pytest.mark.slow
def test_hf_trainer_script_runs_unchanged_under_launch():
    _, stdout = launch("hf_trainer.py")
    assert stdout.count("steps 4") == 2


def test_docs_show_the_tested_scripts():
    """Every ``after`` block of docs/porting.md is the tested script, verbatim."""
    text = DOC.read_text()
    blocks = dict(re.findall(r"<!-- after: (\S+) -->\n```python\n(.*?)```", text, re.S))
    expected = {"from_dataparallel.py", "from_ddp_torchrun.py", "from_horovod.py",
                "from_accelerate.py", "hf_trainer.py"}
    assert set(blocks) == expected
    for name, code in blocks.items():
        assert code == (HERE / name).read_text(), f"docs/porting.md is out of date for {name}"
