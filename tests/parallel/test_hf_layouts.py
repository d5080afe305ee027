"""Hugging Face models through ``Run(parallel=...)`` with the large-model degrees, against
one process: a Llama, a Mistral (its sliding window longer than the sequence) and a
Qwen2 with ``labels=`` under cp (the loader cuts ``input_ids`` and the
labels, shifted first, along the sequence; -100 labels stay exact) and a Mixtral under
ep (its stacked experts split over the data ranks), within float32's and AdamW's bound.
"""

import pytest
import torch
from torch.utils.data import Dataset

import paratrain
from paratrain.testing.language import whole_state
from paratrain.testing.numerics import TrainingBound, assert_losses_within, assert_params_within
from paratrain.testing.pool import spawn

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH, STEPS, GLOBAL_BATCH = 32, 16, 3, 4


class LabelledTokens(Dataset):
    """Token sequences with ``labels`` (the inputs, as HF causal LMs take them); some
    labels are -100, unevenly along the sequence, so the cp ranks count different tokens
    (every row alike: data ranks average their means, as one process's mean only when
    they count the same)."""

    def __init__(self, n: int = 16) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(VOCAB, (n, LENGTH), generator=generator)
        self.labels = self.ids.clone()
        self.labels[:, :5] = -100
        self.labels[:, 9:11] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def build(family: str):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  attn_implementation="sdpa", use_cache=False)
    if family in ("llama", "mistral", "qwen2"):
        config, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                         "mistral": ("MistralConfig", "MistralForCausalLM"),
                         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[family]
        return getattr(transformers, model)(getattr(transformers, config)(**common))
    config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def train(family: str, spec: str | None):
    run = paratrain.Run(parallel=spec, strategy="auto" if spec else "single", progress=False,
                        accelerator="cpu", seed=5, max_grad_norm=0.5)
    model = build(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bound = TrainingBound(model, optimizer) if spec is None else None
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(LabelledTokens(), batch_size=GLOBAL_BATCH // run.strategy.data_parallel_size)
    losses = []
    for _, batch in zip(range(STEPS), loader):
        loss = model(**batch).loss
        run.backward(loss)
        run.step(optimizer)
        losses.append(run.mean(loss))
    result = {"losses": losses, "params": whole_state(run, model), "bound": bound,
              "name": run.strategy.name}
    run.close()
    return result


def worker(rank, world_size, family, spec):
    return train(family, spec)


@pytest.mark.slow
@pytest.mark.parametrize("family, spec", [("llama", "cp=2"), ("mistral", "cp=2"),
                                          ("qwen2", "cp=2"), ("mixtral", "ep=2")])
def test_hugging_face_model_under_cp_or_ep_matches_one_process(family, spec):
    reference = train(family, None)
    for result in spawn(worker, 2, family, spec, timeout=300):
        assert result["name"] == "fsdp"
        # The losses a rank reports are its slice's mean (cp): only their update is exact.
        if spec.startswith("ep"):
            assert_losses_within(result["losses"], reference["losses"])
        assert result["params"].keys() == reference["params"].keys()
        assert_params_within(result["params"], reference["params"], reference["bound"])
