"""Hugging Face checkpoints: ``run.save_pretrained`` from any layout, ``run.load_pretrained``
into a sharded model built on the meta device, checked through ``transformers`` itself."""

from __future__ import annotations

import filecmp
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import paratrain
from paratrain.checkpoint import huggingface
from paratrain.checkpoint.meta_init import empty_weights
from paratrain.distributed import spawn as fresh
from paratrain.models import GPT
from paratrain.strategies.capabilities import local_module
from paratrain.strategies.dtensor_params import whole_model_state
from paratrain.testing.pool import spawn

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB, SEQ = 101, 8
SMALL_SHARD = 20_000  # bytes: the tiny GPT-2 below spreads over several files


def gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                   n_positions=16)


def llama_config():
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=VOCAB, max_position_embeddings=32)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def save_worker(rank: int, world_size: int, directory: str) -> dict:
    """One fsdp step on a tiny GPT-2 (tied head), then save_pretrained one file and sharded."""
    with paratrain.Run(strategy="fsdp", strategy_options={"wrap_policy": "GPT2Block"},
                       accelerator="cpu", progress=False, seed=3) as run:
        model = transformers.GPT2LMHeadModel(gpt2_config())
        model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        run.backward(lm_loss(model, tokens(rank)))
        run.step(optimizer)
        one = run.save_pretrained(os.path.join(directory, "one"))
        many = run.save_pretrained(os.path.join(directory, "many"), max_shard_size=SMALL_SHARD)
        full = whole_model_state(local_module(run.strategy, model))
    return {"full": full, "one": one, "many": many}


@pytest.mark.slow
def test_fsdp_save_pretrained_loads_in_transformers_bitwise(tmp_path):
    """From fsdp on 2 ranks: transformers loads the files and holds the run's full state
    bitwise (same logits); the files equal a single-process export byte for byte."""
    results = spawn(save_worker, 2, str(tmp_path), timeout=300)
    full = results[0]["full"]
    assert results[1]["one"] == [] and len(results[0]["many"]) > 2
    for name in ("one", "many"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        state = loaded.state_dict()
        assert sorted(state) == sorted(full)
        assert all(torch.equal(state[k], v) for k, v in full.items())
        assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again
        reference = transformers.GPT2LMHeadModel(gpt2_config()).eval()
        reference.load_state_dict(full)
        assert torch.equal(loaded(tokens(9)).logits, reference(tokens(9)).logits)
        # The same weights exported in one process, with transformers' own writer.
        reference.save_pretrained(tmp_path / f"{name}-reference",
                                  max_shard_size=SMALL_SHARD if name == "many" else "5GB")
        written = sorted(p.name for p in (tmp_path / name).iterdir())
        assert written == sorted(p.name for p in (tmp_path / f"{name}-reference").iterdir())
        for file in written:
            assert filecmp.cmp(tmp_path / name / file, tmp_path / f"{name}-reference" / file,
                               shallow=False), file
    index = json.loads((tmp_path / "many" / huggingface.INDEX_FILE).read_text())
    assert "lm_head.weight" not in index["weight_map"]  # the tied copy, as transformers
    assert not (tmp_path / "one" / huggingface.INDEX_FILE).exists()


FAMILIES = {"llama": (transformers.LlamaForCausalLM, llama_config),
            "gpt2": (transformers.GPT2LMHeadModel, gpt2_config)}


def load_worker(rank: int, world_size: int, directory: str, strategy: str, family: str) -> dict:
    """A model built on the meta device, prepared under ``strategy``, then filled."""
    cls, config = FAMILIES[family]
    options = {"wrap_policy": "GPT2Block"} if family == "gpt2" and strategy == "fsdp" else {}
    with paratrain.Run(strategy=strategy, strategy_options=options, accelerator="cpu",
                       progress=False, seed=4) as run:
        with empty_weights():
            model = cls(config())
        assert next(model.parameters()).device.type == "meta"
        model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        module = local_module(run.strategy, model)
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                    for p in module.parameters())
        run.load_pretrained(directory)
        full = {k: v.clone() for k, v in whole_model_state(module).items()}  # before the step
        logits = model.eval()(tokens(9)).logits.detach()  # GPT-2 has dropout
        model.train()
        run.backward(lm_loss(model, tokens(rank)))  # it trains from there
        run.step(optimizer)
    return {"full": full, "logits": logits, "local": local}


@pytest.mark.slow
@pytest.mark.parametrize("strategy, family", [("fsdp", "llama"), ("ddp", "llama"),
                                              ("fsdp", "gpt2")])
def test_load_pretrained_into_meta_model(tmp_path, strategy, family):
    """Files written by transformers load into a model built on meta: equal to the original
    (state and logits); under fsdp each rank only ever held half the parameters. Llama's
    rotary buffers are not in the files; GPT-2's head is tied to its embedding."""
    cls, config = FAMILIES[family]
    torch.manual_seed(0)
    original = cls(config()).eval()
    original.save_pretrained(tmp_path, max_shard_size=SMALL_SHARD)
    results = spawn(load_worker, 2, str(tmp_path), strategy, family, timeout=300)
    expected = original.state_dict()
    total = sum(p.numel() for p in original.parameters())
    for result in results:
        assert sorted(result["full"]) == sorted(expected)
        assert all(torch.equal(result["full"][k], v) for k, v in expected.items())
        # Same weights, same arithmetic (fsdp gathers before the same kernels).
        assert torch.equal(result["logits"], original(tokens(9)).logits)
    held = [r["local"] for r in results]
    if strategy == "fsdp":  # dim-0 shards: about half each, never the whole model
        assert sum(held) == total and max(held) < 0.6 * total
    else:
        assert held == [total, total]


def test_gpt_writes_safetensors_without_config(tmp_path):
    """A model that is not a transformers model: model.safetensors only, its own names."""
    from safetensors.torch import load_file

    with paratrain.Run(strategy="single", accelerator="cpu", progress=False) as run:
        model = run.prepare(GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_embd=16,
                                n_head=2))
        written = run.save_pretrained(tmp_path)
    assert [Path(p).name for p in written] == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    loaded = load_file(tmp_path / "model.safetensors")
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_compiled_module_keeps_its_own_names(tmp_path):
    """torch.compile's ``_orig_mod.`` prefix is not written (transformers would not load it)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config())
    huggingface.save_pretrained(tmp_path, torch.compile(model), max_shard_size=SMALL_SHARD)
    index = json.loads((tmp_path / huggingface.INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(k for k in model.state_dict()
                                                 if k != "lm_head.weight")


def test_max_shard_size_and_plan():
    assert huggingface.parse_size("5GB") == 5 * 10**9
    assert huggingface.parse_size("2GiB") == 2 * 2**30
    assert huggingface.parse_size(1000) == 1000
    with pytest.raises(ValueError, match="max_shard_size"):
        huggingface.parse_size("lots")
    # A tensor over the limit gets a file of its own; the others fill files in order.
    plan = huggingface.plan_files([("a", 4), ("b", 4), ("big", 20), ("c", 4), ("d", 4)], 10)
    assert plan == [["big"], ["a", "b"], ["c", "d"]]
    assert huggingface.file_names(2) == ["model-00001-of-00002.safetensors",
                                         "model-00002-of-00002.safetensors"]


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_bad_input_is_one_line(tmp_path):
    """A file as directory, a directory without weights, a missing shard, a wrong shape."""
    model = transformers.GPT2LMHeadModel(gpt2_config())
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(ValueError) as exc:
        huggingface.save_pretrained(target, model)
    assert one_line(exc) == f"save_pretrained: {target} is a file, not a directory; " \
                            "give a directory path"
    with pytest.raises(FileNotFoundError) as exc:
        huggingface.load_pretrained(tmp_path, model)
    assert "holds neither model.safetensors nor model.safetensors.index.json" in one_line(exc)
    huggingface.save_pretrained(tmp_path / "many", model, max_shard_size=SMALL_SHARD)
    (tmp_path / "many" / "model-00002-of-00007.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as exc:
        huggingface.load_pretrained(tmp_path / "many", model)
    assert "model-00002-of-00007.safetensors named by model.safetensors.index.json is " \
           "missing (1 of 7 files)" in one_line(exc)
    huggingface.save_pretrained(tmp_path / "one", model)
    wider = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB + 1, n_positions=16))
    with pytest.raises(ValueError) as exc:
        huggingface.load_pretrained(tmp_path / "one", wider)
    assert one_line(exc) == (f"load_pretrained: {tmp_path / 'one'} does not match the model: "
                             "'transformer.wte.weight' is [101, 32] in the files but "
                             "[102, 32] in the model")


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(RuntimeError) as exc:
        huggingface.save_pretrained(tmp_path, torch.nn.Linear(2, 2))
    assert one_line(exc) == ("Hugging Face checkpoints need safetensors, which is not "
                             "installed; install the hf extra: pip install 'paratrain[hf]'")


def layout_worker(rank: int, world_size: int, directory: str, strategy: str) -> dict:
    """paratrain's GPT prepared under ``strategy``, saved; its state before prepare."""
    with paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, seed=6) as run:
        model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_embd=16, n_head=2)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        model = run.prepare(model)
        run.save_pretrained(directory, max_shard_size=SMALL_SHARD)
        held = len(local_module(run.strategy, model).state_dict())
    return {"initial": initial, "held": held}


@pytest.mark.slow
@pytest.mark.parametrize("strategy, ranks", [("ddp", 2), ("tp", 2), ("pipeline", 2),
                                             ("fsdp_tp", 4)])
def test_every_layout_writes_the_single_process_bytes(tmp_path, strategy, ranks):
    """Replicated, tensor-parallel and 2-D (DTensor pieces) and pipeline stages (tensors
    sent to rank 0 from the stage holding them) write the files one process writes."""
    results = spawn(layout_worker, ranks, str(tmp_path / "run"), strategy, timeout=300)
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_embd=16, n_head=2)
    model.load_state_dict(results[0]["initial"])
    everything = len(model.state_dict())
    # Not vacuous: pipeline ranks each hold only their stage.
    held = [r["held"] for r in results]
    if strategy == "pipeline":
        assert sum(held) == everything and held[0] < everything
    else:
        assert held == [everything] * ranks
    huggingface.save_pretrained(tmp_path / "one", model, max_shard_size=SMALL_SHARD)
    written = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert written == sorted(p.name for p in (tmp_path / "one").iterdir())
    assert len(written) > 2  # files and index
    for file in written:
        assert filecmp.cmp(tmp_path / "run" / file, tmp_path / "one" / file, shallow=False), file


def test_meta_model_in_one_process_keeps_ties_and_optimizer(tmp_path):
    """Materialised whole: the tied head is tied again and the optimizer built over the
    meta parameters steps the real ones."""
    torch.manual_seed(0)
    original = transformers.GPT2LMHeadModel(gpt2_config())
    original.save_pretrained(tmp_path)
    with paratrain.Run(strategy="single", accelerator="cpu", progress=False) as run:
        with empty_weights():
            model = transformers.GPT2LMHeadModel(gpt2_config())
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        run.load_pretrained(tmp_path)
        assert model.lm_head.weight is model.transformer.wte.weight
        assert {id(p) for g in optimizer.param_groups for p in g["params"]} == \
            {id(p) for p in model.parameters()}
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in original.state_dict().items())
        run.backward(lm_loss(model, tokens(0)))
        run.step(optimizer)
        assert not torch.equal(model.transformer.wte.weight, original.transformer.wte.weight)


def test_unsaved_buffer_on_meta_is_one_line():
    """Llama's rotary frequencies are computed in __init__ and never saved: built under
    torch.device("meta") nothing could restore them, so prepare says what to do."""
    with paratrain.Run(strategy="single", accelerator="cpu", progress=False) as run:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(llama_config())
        with pytest.raises(ValueError) as exc:
            run.prepare(model)
    assert one_line(exc) == (
        "buffer 'model.rotary_emb.inv_freq' was built on the meta device and checkpoints do "
        "not hold it; build the model under paratrain.checkpoint.meta_init.empty_weights() "
        "instead")


def alone_on_rank_0(rank: int, world_size: int, directory: str) -> str:
    """``if run.is_main: run.save_pretrained(...)`` under fsdp: the gather needs every rank."""
    run = paratrain.Run(strategy="fsdp", accelerator="cpu", progress=False, timeout_s=60)
    try:
        run.prepare(GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_embd=16, n_head=2))
        if rank != 0:
            return "closed"
        run.save_pretrained(directory)
    except Exception as exc:  # noqa: BLE001 - the test compares the line
        return str(exc)
    finally:
        run.close()
    return "no error"


@pytest.mark.slow
def test_save_pretrained_on_rank_0_only_is_named(tmp_path):
    # Fresh processes: rank 1's process ending is what breaks rank 0's gather.
    results = fresh.spawn(alone_on_rank_0, 2, str(tmp_path), timeout=180)
    assert results[1] == "closed"
    assert results[0].startswith("rank 0 called run.save_pretrained() but rank 1 did not "
                                 "(it called run.close()); ")


def meta_pipeline_worker(rank: int, world_size: int) -> str:
    with paratrain.Run(strategy="pipeline", accelerator="cpu", progress=False) as run:
        with empty_weights():
            model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_embd=16, n_head=2)
        try:
            run.prepare(model)
        except ValueError as exc:
            return str(exc)
    return "no error"


@pytest.mark.slow
def test_meta_model_under_pipeline_is_one_line():
    """Stages are cut from a real model: a meta one is refused before any stage is built."""
    assert spawn(meta_pipeline_worker, 2, timeout=180) == [
        "strategy 'pipeline' splits a model built on the CPU only; build it without the meta "
        "device (or use fsdp)"] * 2
