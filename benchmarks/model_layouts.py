"""Models x layouts: does each model train under each layout as it does in one process?

The models (Hugging Face Llama, the same Llama with tied embeddings, GPT-2, OPT, a BERT
classifier, torchvision's ViT and ResNet-18, ``paratrain.models.GPT``, and GPT-NeoX,
Mistral, Phi and Gemma2, which come through transformers' own tensor plans), built tiny from
configs with random init and dropout off, train 3 SGD steps under each layout (gloo ranks
on the CPU, each cell in its own spawn with a timeout) and under one process, on the same
global batch. A cell is ``ok`` when losses and the gathered parameters and buffers are
within what reordering float32 sums allows (``paratrain.testing.numerics``), ``DIFFERS``
beyond it, ``refused`` when paratrain raised one line, ``FAILS`` on any other error (a
raw torch error is a bug). One failing cell does not stop the table.

    python benchmarks/model_layouts.py                         # all, ~15 min on 2 quiet cores
    python benchmarks/model_layouts.py --models llama,resnet18 --layouts ddp,tp
    python benchmarks/model_layouts.py --out /tmp/table.md     # also write the markdown
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from layout_cells import BufferBound, RoundingPerturbation, compare, describe_error, spread

import paratrain
from paratrain.distributed.spawn import WorkerFailed, spawn
from paratrain.strategies.capabilities import ShardedState, local_module
from paratrain.testing.numerics import TrainingBound

STEPS, GLOBAL_BATCH, SEQ, VOCAB, CLASSES = 3, 8, 12, 64, 4
# SGD: a rounding difference in a gradient reaches the parameter once, times lr (Adam
# would divide it by sqrt(v), which is ~0 for gradients that are zero in exact
# arithmetic, and turn rounding into lr-sized differences; see numerics.TrainingBound).
LR = 0.1


@dataclass(frozen=True)
class ModelSpec:
    build: Any           # () -> nn.Module, seeded inside
    batch: Any           # () -> (inputs, targets), the global batch
    needs: str | None    # the package the model comes from
    batchnorm: bool = False
    lr: float = LR


def _llama(tied: bool):
    def build():
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            attention_dropout=0.0, tie_word_embeddings=tied)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)
    return build


def _hf(config_name: str, model_name: str, **fields: Any):
    """A family transformers ships a tensor plan for: no code in paratrain knows it."""
    def build():
        import transformers

        config = getattr(transformers, config_name)(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=SEQ, **fields)
        torch.manual_seed(0)
        return getattr(transformers, model_name)(config)
    return build


def _gpt2():
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                     n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _opt():
    import transformers

    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    word_embed_proj_dim=32, max_position_embeddings=SEQ,
                                    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                                    layerdrop=0.0, bos_token_id=0, eos_token_id=0,
                                    pad_token_id=1)
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(config)


def _bert():
    import transformers

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=SEQ, num_labels=CLASSES,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def _vit():
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                             hidden_dim=32, mlp_dim=64, num_classes=CLASSES)


def _resnet18():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=CLASSES)


def _gpt():
    from paratrain.models import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)


def _tokens():
    data = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return data[:, :-1], data[:, 1:]


def _labelled(shape):
    def batch():
        g = torch.Generator().manual_seed(7)
        return (torch.randn(GLOBAL_BATCH, *shape, generator=g),
                torch.randint(CLASSES, (GLOBAL_BATCH,), generator=g))
    return batch


def _sentences():
    g = torch.Generator().manual_seed(7)
    return (torch.randint(VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(CLASSES, (GLOBAL_BATCH,), generator=g))


MODELS = {
    "llama": ModelSpec(_llama(False), _tokens, "transformers"),
    "llama_tied": ModelSpec(_llama(True), _tokens, "transformers"),
    "gpt2": ModelSpec(_gpt2, _tokens, "transformers"),
    "opt": ModelSpec(_opt, _tokens, "transformers"),
    "bert": ModelSpec(_bert, _sentences, "transformers"),
    "vit": ModelSpec(_vit, _labelled((3, 16, 16)), "torchvision"),
    # At lr 0.1 (loss 1.8 -> 13) or 0.01 (1.8 -> 0.16), 8 images' BatchNorm statistics
    # amplify a one-ulp change of the initial weights, in one process, to 9e-4 after 3
    # steps: no layout could be judged by rounding. At 0.003 it stays within the bound.
    "resnet18": ModelSpec(_resnet18, _labelled((3, 32, 32)), "torchvision", batchnorm=True,
                          lr=0.003),
    "gpt": ModelSpec(_gpt, _tokens, None),
    # Through transformers' own tensor plans (paratrain.adapters.transformers_plans).
    "gpt_neox": ModelSpec(_hf("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_dropout=0.0,
                              attention_dropout=0.0), _tokens, "transformers"),
    "mistral": ModelSpec(_hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=2),
                         _tokens, "transformers"),
    "phi": ModelSpec(_hf("PhiConfig", "PhiForCausalLM", num_key_value_heads=2, resid_pdrop=0.0,
                         embd_pdrop=0.0, attention_dropout=0.0), _tokens, "transformers"),
    # Tied embedding and head (Gemma's default): both stay whole under the plan.
    "gemma2": ModelSpec(_hf("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2,
                            head_dim=8), _tokens, "transformers"),
}

#: layout -> (ranks, Run keywords): named presets with strategy=, degrees with parallel=.
LAYOUTS = {
    "ddp": (2, {"strategy": "ddp"}),
    "fsdp": (2, {"strategy": "fsdp"}),
    "zero1": (2, {"strategy": "zero1"}),
    "zero2": (2, {"strategy": "zero2"}),
    "tp": (2, {"strategy": "tp"}),
    "tp_sp_lp": (2, {"strategy": "tp", "strategy_options": {"sequence_parallel": True,
                                                          "loss_parallel": True}}),
    "fsdp_tp": (4, {"strategy": "fsdp_tp", "strategy_options": {"tensor_degree": 2}}),
    "pp_gpipe": (2, {"strategy": "pipeline",
                     "strategy_options": {"schedule": "gpipe", "num_microbatches": 2}}),
    "pp_1f1b": (2, {"strategy": "pipeline",
                    "strategy_options": {"schedule": "1f1b", "num_microbatches": 2}}),
    "hsdp_2d": (4, {"parallel": "dp_replicate=2,dp_shard=2"}),
    "pp_fsdp_tp_3d": (8, {"parallel": "pp=2,dp_shard=2,tp=2"}),
}


def _loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    # Hugging Face models return an output object; the others return the logits. Token
    # logits (B, T, vocab) go in as (B, vocab, T) so a pipeline splits (B, T) targets.
    logits = getattr(output, "logits", output)
    if target.dim() == 2:
        logits = logits.transpose(1, 2)
    return F.cross_entropy(logits, target)


def train(model_name: str, run_options: dict[str, Any], reference: bool = False,
          perturbed: bool = False) -> dict:
    """Train ``STEPS`` steps of ``model_name`` under ``run_options``; losses and state.

    ``reference``: also the arithmetic bounds on another layout's parameters and buffers
    (replayed from this run's optimizer and BatchNorm inputs). ``perturbed``: gradients
    moved by the rounding bound (:class:`layout_cells.RoundingPerturbation`).
    """
    spec = MODELS[model_name]
    run = paratrain.Run(progress=False, accelerator="cpu", seed=3,
                        sync_batchnorm=spec.batchnorm and not reference, **run_options)
    model = spec.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)
    bounds = (TrainingBound(model, optimizer), BufferBound(model)) if reference else None
    if perturbed:
        RoundingPerturbation(optimizer)
    aliases = {name: next(n for n, q in model.named_parameters() if q is p)
               for name, p in model.named_parameters(remove_duplicate=False)}
    model, optimizer = run.prepare(model, optimizer)
    strategy = run.strategy
    inputs, targets = spec.batch()
    share = GLOBAL_BATCH // strategy.data_parallel_size
    mine = slice(strategy.data_parallel_rank * share, (strategy.data_parallel_rank + 1) * share)
    losses = []
    for _ in range(STEPS):
        loss = _loss(model(inputs[mine]), targets[mine])
        run.backward(loss)
        run.step(optimizer)
        losses.append(float(run.mean(loss)))
    state = (strategy.full_state_dict(model) if isinstance(strategy, ShardedState)
             else local_module(strategy, model).state_dict())
    # The mesh axes the parameters are split over: proof the layout split the model.
    meshes = sorted({tuple(p.device_mesh.mesh_dim_names or ()) for p in model.parameters()
                     if hasattr(p, "device_mesh")})
    result = {"losses": losses, "meshes": meshes}
    if run.rank == 0:
        result["state"] = {k: v.detach().cpu().clone() for k, v in state.items()}
    if bounds:
        result.update(tolerances=bounds[0].tolerances(), buffer_tolerances=bounds[1].tolerances(),
                      aliases=aliases)
    run.close()
    return result


def reference_worker(rank: int, world_size: int, model_name: str) -> dict:
    result = train(model_name, {"strategy": "single"}, reference=True)
    if MODELS[model_name].batchnorm:  # the second-order term matters (RoundingPerturbation)
        result["spread"] = spread(result, train(model_name, {"strategy": "single"},
                                                perturbed=True))
    return result


def cell_worker(rank: int, world_size: int, model_name: str, layout: str, errors: str) -> dict:
    torch.set_num_threads(1)
    try:
        return train(model_name, LAYOUTS[layout][1])
    except BaseException as exc:
        # The parent sees only a traceback's text: leave the exception's facts for it.
        with open(os.path.join(errors, f"{rank}.json"), "w") as file:
            json.dump({"time": time.time(), **describe_error(exc)}, file)
        raise


def run_cell(model_name: str, layout: str, reference: dict, timeout: float) -> dict:
    """One cell: ``{"status": ok|DIFFERS|refused|FAILS, "max": largest difference,
    "meshes": the split's mesh axes, "note": the one line}`` (no max/meshes on errors)."""
    ranks = LAYOUTS[layout][0]
    with tempfile.TemporaryDirectory() as errors:
        try:
            results = spawn(cell_worker, ranks, model_name, layout, errors, timeout=timeout)
        except WorkerFailed as failure:
            reports = []
            for name in os.listdir(errors):
                with open(os.path.join(errors, name)) as file:
                    try:
                        reports.append(json.load(file))
                    except ValueError:  # a rank killed while writing: the others tell
                        continue
            if not reports:
                return {"status": "FAILS", "note": str(failure).splitlines()[0]}
            first = min(reports, key=lambda r: r["time"])
            return {"status": first["status"], "note": first["line"]}
    return {**compare(results, reference), "meshes": results[0]["meshes"]}


def _cell_text(cell: dict, notes: list[str]) -> str:
    if cell["status"] == "ok":
        return f"ok (max diff {cell['max']:.1e})"
    if cell["note"] not in notes:
        notes.append(cell["note"])
    mark = f"[{notes.index(cell['note']) + 1}]"
    if cell["status"] == "DIFFERS":
        return f"DIFFERS (max {cell['max']:.1e}) {mark}"
    return f"{cell['status']} {mark}"


def table(cells: dict[tuple[str, str], dict], models: list[str], layouts: list[str]) -> str:
    """The markdown grid (models x layouts) and, below it, the numbered one-line notes."""
    notes: list[str] = []
    lines = ["| model | " + " | ".join(layouts) + " |",
             "|---|" + "---|" * len(layouts)]
    for model in models:
        row = [_cell_text(cells[model, layout], notes) for layout in layouts]
        lines.append(f"| {model} | " + " | ".join(row) + " |")
    lines.append("")
    lines += [f"{i}. {note.replace('|', '/')}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds per cell on 2 ranks (4 ranks: x1.5, 8 ranks: x2)")
    args = parser.parse_args()
    models, layouts = args.models.split(","), args.layouts.split(",")
    for name, known in (*((m, MODELS) for m in models), *((lay, LAYOUTS) for lay in layouts)):
        if name not in known:
            parser.error(f"unknown {name!r}; known: {', '.join(known)}")
    cells, start = {}, time.monotonic()
    for model in models:
        needs = MODELS[model].needs
        if needs and importlib.util.find_spec(needs) is None:
            for layout in layouts:
                cells[model, layout] = {"status": "FAILS", "note": f"model not built: "
                                        f"{needs} is not installed"}
            continue
        try:
            reference = spawn(reference_worker, 1, model, timeout=args.timeout)[0]
        except WorkerFailed as failure:
            line = f"one-process reference failed: {str(failure).splitlines()[-1]}"
            cells.update({(model, layout): {"status": "FAILS", "note": line}
                          for layout in layouts})
            continue
        for layout in layouts:
            scale = {2: 1.0, 4: 1.5, 8: 2.0}[LAYOUTS[layout][0]]
            cell = run_cell(model, layout, reference, args.timeout * scale)
            cells[model, layout] = cell
            print(f"[{time.monotonic() - start:6.0f} s] {model:10s} {layout:14s} "
                  f"{cell['status']} {cell.get('max', '')} {cell.get('meshes', '')} "
                  f"{cell.get('note', '')}", flush=True)
    markdown = table(cells, models, layouts)
    print(markdown)
    if args.out:
        with open(args.out, "w") as file:
            file.write(markdown + "\n")


if __name__ == "__main__":
    main()
