"""Cells of the models x layouts table (benchmarks/model_layouts.py, docs/benchmarks.md):
a model users bring trains under a layout as in one process, or is refused in one line."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

pytest.importorskip("transformers")
pytest.importorskip("torchvision")

import layout_cells  # noqa: E402
import model_layouts  # noqa: E402

from paratrain.testing import pool  # noqa: E402
from paratrain.testing.numerics import REASSOCIATION  # noqa: E402


@pytest.fixture(autouse=True)
def cells_on_the_pool(monkeypatch):
    """The benchmark spawns fresh ranks per cell; here the cells run on the rank pool."""
    monkeypatch.setattr(model_layouts, "spawn", pool.spawn)


def reference(model):
    # One process needs no group: trained here, saving a process start per cell.
    return model_layouts.reference_worker(0, 1, model)


@pytest.mark.slow
@pytest.mark.parametrize("model, layout, meshes", [
    ("llama_tied", "fsdp", [("shard",)]),  # tied embedding and head in one FSDP unit
    ("bert", "tp", [("tensor",)]),         # the hf-encoder adapter's plan and head counts
    ("gpt2", "tp", [("tensor",)]),         # Conv1D MLP split, fused attention whole
    ("resnet18", "ddp", []),               # BatchNorm over both ranks (sync_batchnorm)
    # 8 ranks: the embedding tied to the head across stages, both whole under the
    # tensor-parallel plan, their copies' gradients summed over one group per position.
    ("llama_tied", "pp_fsdp_tp_3d", [("shard",), ("shard", "tensor")]),
])
def test_model_under_layout_matches_one_process(model, layout, meshes):
    cell = model_layouts.run_cell(model, layout, reference(model), timeout=300)
    # Losses, parameters and BatchNorm buffers within what reordering float32 sums
    # allows (TrainingBound replays SGD; BufferBound the running statistics).
    assert cell["status"] == "ok", cell
    assert cell["meshes"] == meshes  # the layout did split the model


@pytest.mark.slow
@pytest.mark.parametrize("model, line", [
    ("resnet18", "tensor parallel splits transformer linears and has no meaning for a "
                 "ResNet (convolutions); use dp_replicate (ddp, with sync_batchnorm=True) "
                 "or dp_shard (fsdp)"),
    ("vit", "tensor parallel of torchvision's ViT is not available: nn.MultiheadAttention "
            "packs q/k/v in one in_proj_weight; use dp_shard (fsdp) or dp_replicate (ddp)"),
])
def test_tensor_parallel_without_meaning_is_refused_in_one_line(model, line):
    cell = model_layouts.run_cell(model, "tp", None, timeout=240)
    assert cell == {"status": "refused", "note": line}


def _result(state, losses):
    return {"state": state, "losses": losses}


def test_a_difference_beyond_the_rounding_bound_is_reported():
    weight, buffer = torch.ones(3), torch.zeros(2)
    reference = {"losses": [2.0], "state": {"w": weight, "b": buffer, "t": weight},
                 "tolerances": {"w": torch.full((3,), 1e-6)}, "buffer_tolerances": {},
                 "aliases": {"w": "w", "t": "w"}}
    close = {"w": weight + 5e-7, "b": buffer.clone()}  # "t" is tied to "w": may be left out
    assert layout_cells.compare([_result(close, [2.0])], reference)["status"] == "ok"
    far = {"w": weight + torch.tensor([0, 0, 2e-6]), "b": buffer}
    assert layout_cells.compare([_result(far, [2.0])], reference)["note"].startswith(
        "w: differs by 2e-06, bound 1e-06")
    # An entry no bound covers (a buffer no forward updated) must be equal.
    moved = {"w": weight, "b": buffer + 1e-9}
    assert layout_cells.compare([_result(moved, [2.0])], reference)["status"] == "DIFFERS"
    loss = 2.0 * (1 + 2 * REASSOCIATION)
    assert "loss at step 0" in layout_cells.compare([_result(close, [loss])], reference)["note"]
    assert "missing ['b']" in layout_cells.compare([_result({"w": weight}, [2.0])],
                                                   reference)["note"]


def test_a_measured_spread_widens_each_tensor_bound_to_twice_its_largest_entry():
    weight = torch.ones(3)
    reference = {"losses": [2.0], "state": {"w": weight},
                 "tolerances": {"w": torch.full((3,), 1e-6)}, "buffer_tolerances": {},
                 "aliases": {"w": "w"}}
    perturbed = {"losses": [2.0], "state": {"w": weight + torch.tensor([0, 0, 3e-6])}}
    reference["spread"] = layout_cells.spread(reference, perturbed)
    inside = {"w": weight + torch.tensor([5e-6, 0, 0])}  # another element than the spread's
    assert layout_cells.compare([_result(inside, [2.0])], reference)["status"] == "ok"
    beyond = {"w": weight + torch.tensor([7e-6, 0, 0])}
    assert layout_cells.compare([_result(beyond, [2.0])], reference)["status"] == "DIFFERS"


def test_paratrain_one_liners_are_refusals_and_other_errors_are_failures():
    from paratrain.parallel import Parallel

    try:
        Parallel(tp=0)
    except ValueError as exc:
        refused = layout_cells.describe_error(exc)
    assert refused == {"status": "refused", "line": "Parallel.tp must be an integer >= 1, "
                                                    "or -1 to fill the world, got 0"}
    try:
        torch.ones(2) @ torch.ones(3)
    except RuntimeError as exc:
        failed = layout_cells.describe_error(exc)
    assert failed["status"] == "FAILS" and failed["line"].startswith("RuntimeError: ")
