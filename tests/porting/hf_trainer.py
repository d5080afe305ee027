"""An unchanged Hugging Face Trainer script, started with `paratrain launch` (docs/porting.md)."""

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _common import fingerprint  # noqa: E402


class Snippets(torch.utils.data.Dataset):
    def __init__(self, num_samples=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, 100, (num_samples, 12), generator=g)
        self.labels = (self.ids[:, 0] > 50).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long),
                "labels": self.labels[i]}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, max_steps=args.max_steps,
            learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
            disable_tqdm=True, logging_strategy="no", seed=0, dataloader_num_workers=0,
            ddp_find_unused_parameters=False)
        trainer = Trainer(model=model, args=training_args, train_dataset=Snippets())
        result = trainer.train()
    print(f"rank {training_args.process_index}/{training_args.world_size} "
          f"fingerprint {fingerprint(model):.6f} steps {result.global_step}")


if __name__ == "__main__":
    main()
