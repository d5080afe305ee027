"""Tensor parallel (``tp``) and ``fsdp_tp`` on gloo ranks against a single-process GPT."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.parallel.options import TensorParallel as TPOptions
from paratrain.parallel.presets import preset
from paratrain.strategies.capabilities import ShardedState
from paratrain.strategies.tensor.plan import automatic_plan, resolve_plan
from paratrain.strategies.tensor.sequence import (
    apply_loss_parallel,
    block_container,
    find_output_layer,
    sequence_parallel_styles,
)
from paratrain.testing.numerics import (
    REASSOCIATION,
    TrainingBound,
    assert_losses_within,
    assert_params_within,
)
from paratrain.testing.pool import spawn

VOCAB, WIDTH, HEADS, SEQ = 32, 16, 4, 8
STEPS = 3


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS
        # No q/k/v bias: a key bias gets a zero gradient up to rounding, which Adam
        # would amplify into noise that differs between layouts.
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        # Heads from self.n_head, which tensor parallel divides by its degree.
        q, k, v = (f(x).view(b, t, self.n_head, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.mlp = nn.ModuleDict({"fc": nn.Linear(WIDTH, 4 * WIDTH),
                                  "proj": nn.Linear(4 * WIDTH, WIDTH)})

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp["proj"](F.gelu(self.mlp["fc"](self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def tokens(n=32):
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def train(strategy, options, global_batch=8, checkpoint_dir=None, resume=None):
    run = paratrain.Run(strategy=strategy, strategy_options=options, progress=False,
                        accelerator="cpu", seed=5, max_grad_norm=0.5)
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # The reference replays Adam's arithmetic: how far another layout may drift.
    bound = TrainingBound(model, optimizer) if strategy == "single" else None
    model, optimizer = run.prepare(model, optimizer)
    if resume:
        run.load(resume)
    strategy = run.strategy
    loader = run.loader(tokens(), batch_size=global_batch // strategy.data_parallel_size)
    losses = []
    for _, (x, y) in zip(range(STEPS), loader):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        run.backward(loss)
        run.step(optimizer)
        losses.append(strategy.all_reduce(loss.detach(), "mean").item())
    # Exact evaluation; under loss_parallel the logits are vocabulary-sharded DTensors.
    held_out = run.eval_loader(tokens(12), batch_size=4)
    evaluation = run.evaluate(model, held_out, loss_fn=lambda out, y: F.cross_entropy(
        out.flatten(0, 1), y.flatten(), reduction="sum"))
    saved = run.save(checkpoint_dir) if checkpoint_dir else None
    state = (strategy.full_state_dict(model) if isinstance(strategy, ShardedState)
             else model.state_dict())
    params = {k: v.detach().clone() for k, v in state.items()}
    run.close()
    return {"losses": losses, "params": params, "saved": saved, "evaluation": evaluation,
            "bound": bound}


def worker(rank, world_size, strategy, options, checkpoint_dir=None):
    return train(strategy, options, checkpoint_dir=checkpoint_dir)


def assert_matches(result, reference):
    # Bounds from float32 arithmetic and Adam's (paratrain.testing.numerics), per
    # element: Adam divides by the gradient's size, so a rounding difference in a small
    # gradient may become a larger parameter difference, never one in a real gradient.
    assert_losses_within(result["losses"], reference["losses"])
    assert result["evaluation"]["count"] == reference["evaluation"]["count"] == 12 * SEQ
    assert result["evaluation"]["loss"] == pytest.approx(reference["evaluation"]["loss"],
                                                         rel=REASSOCIATION)
    # A count of argmaxes: equal unless two logits tie within rounding.
    assert result["evaluation"]["accuracy"] == reference["evaluation"]["accuracy"]
    assert result["params"].keys() == reference["params"].keys()
    assert_params_within(result["params"], reference["params"], reference["bound"])


@pytest.fixture(scope="module")
def reference():
    return train("single", {})


def test_automatic_plan_splits_attention_and_mlp_and_bad_plans_are_named():
    plan = automatic_plan(TinyGPT())
    assert plan["blocks.0.attn.q"] == plan["blocks.1.mlp.fc"] == "colwise"
    assert plan["blocks.0.attn.proj"] == plan["blocks.1.mlp.proj"] == "rowwise"
    assert "head" not in plan and len(plan) == 12
    assert resolve_plan(TinyGPT(), {"blocks.*.attn.[qkv]": "colwise"}) == {
        f"blocks.{i}.attn.{n}": "colwise" for i in range(2) for n in "qkv"}
    with pytest.raises(ValueError, match="plan pattern 'blocks.*.attn.c_attn' matches no module"):
        resolve_plan(TinyGPT(), {"blocks.*.attn.c_attn": "colwise"})
    with pytest.raises(ValueError, match=r"plan\['blocks.\*.ln1'\] has style 'sequence'"):
        TPOptions(plan={"blocks.*.ln1": "sequence"})
    with pytest.raises(ValueError, match="matches 'blocks.0.ln1', a LayerNorm"):
        resolve_plan(TinyGPT(), {"blocks.0.ln1": "colwise"})
    with pytest.raises(ValueError, match="Parallel.tp must be an integer >= 1, or -1 to fill the world, got 0"):
        preset("fsdp_tp", {"tensor_degree": 0}, local_world_size=4)


@pytest.mark.slow
def test_tp2_matches_single_and_resumes_under_single(reference, tmp_path):
    results = spawn(worker, 2, "tp", {}, str(tmp_path), timeout=240)
    for result in results:
        assert_matches(result, reference)
    # Saved under tp=2 (a DCP directory), resumed by one process: same weights.
    resumed = paratrain.Run(strategy="single", progress=False, accelerator="cpu", seed=5)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = resumed.prepare(model, optimizer)
    resumed.load(results[0]["saved"])
    # A checkpoint round trip computes nothing: bitwise what the 2 ranks saved.
    for key, value in results[0]["params"].items():
        assert torch.equal(model.state_dict()[key], value), key
    assert resumed.global_step == STEPS and optimizer.state  # Adam moments came back
    resumed.close()


@pytest.mark.slow
def test_tp2_with_sequence_and_loss_parallel_matches_single(reference):
    results = spawn(worker, 2, "tp", {"sequence_parallel": True, "loss_parallel": True},
                    timeout=240)
    for result in results:
        assert_matches(result, reference)


@pytest.mark.slow
def test_fsdp_x_tp_with_sequence_and_loss_parallel_on_four_ranks_matches_single(reference):
    # Plain fsdp_tp on four ranks runs in tests/test_examples.py (the GPT example).
    options = {"tensor_degree": 2, "sequence_parallel": True, "loss_parallel": True}
    results = spawn(worker, 4, "fsdp_tp", options, timeout=300)
    for result in results:
        assert_matches(result, reference)


def test_sequence_parallel_shards_norms_and_gathers_once_per_attention_module():
    plan = automatic_plan(TinyGPT())
    owner, blocks = block_container(TinyGPT(), plan)
    assert (owner, blocks) == ("blocks", ["blocks.0", "blocks.1"])
    styles, gathered = sequence_parallel_styles(TinyGPT(), plan, blocks)
    kinds = {name: type(style).__name__ for name, style in styles.items()}
    assert kinds["blocks.0.ln1"] == kinds["blocks.1.ln2"] == "SequenceParallel"
    # attn is called as a module: gathered once for q, k and v. The MLP is a ModuleDict
    # the block calls into, so fc gathers its own input.
    assert gathered == ["blocks.0.attn", "blocks.1.attn"]
    assert "Shard(dim=1)" in repr(styles["blocks.0.mlp.fc"].input_layouts)
    assert "Replicate" in repr(styles["blocks.0.attn.q"].input_layouts)
    assert "Shard(dim=1)" in repr(styles["blocks.1.attn.proj"].output_layouts)
    assert "tok" not in kinds and "ln" not in kinds and "head" not in kinds
    assert sum(kind == "SequenceParallel" for kind in kinds.values()) == 4


def test_sequence_and_loss_parallel_bad_input_is_named():
    model = TinyGPT()
    with pytest.raises(ValueError, match="'blocks.1' has no planned layer"):
        block_container(model, {"blocks.0.attn.q": "colwise"})
    with pytest.raises(ValueError, match="'head' is not in one"):
        block_container(model, {"head": "colwise"})
    with pytest.raises(ValueError, match="output_layer is only used with loss_parallel=True"):
        TPOptions(output_layer="head")
    with pytest.raises(ValueError, match="sequence_parallel must be True or False"):
        preset("fsdp_tp", {"sequence_parallel": "yes"}, local_world_size=4)
    assert find_output_layer(model, None) == "head"
    with pytest.raises(ValueError, match="output_layer 'ln' is LayerNorm"):
        find_output_layer(model, "ln")
    model.head = nn.Identity()
    with pytest.raises(ValueError, match="output_layer 'head' is Identity"):
        find_output_layer(model, None)
    del model.head
    with pytest.raises(ValueError, match="no output layer named head, lm_head, output"):
        find_output_layer(model, None)

    class ThreeRanks:
        def size(self):
            return 3

    with pytest.raises(ValueError, match="head.out_features=32 is not divisible by the tensor "
                                         "degree 3; pad the vocabulary"):
        apply_loss_parallel(TinyGPT(), ThreeRanks(), "head")


def test_one_process_runs_as_single_and_degrees_are_checked_once():
    from paratrain.distributed.topology import Topology
    from paratrain.strategies import create_strategy

    one = create_strategy("fsdp_tp", Topology(), {"tensor_degree": 2})
    assert "running as 'single'" in one.notice() and one.data_parallel_size == 1
    four = Topology(rank=3, world_size=4, local_world_size=4, local_rank=3)
    layout = create_strategy("fsdp_tp", four, {"tensor_degree": 2})
    assert (layout.data_parallel_size, layout.data_parallel_rank) == (2, 1)
    assert create_strategy("tp", four).data_parallel_size == 1
    with pytest.raises(ValueError, match="tp=3 does not divide the world size 4"):
        create_strategy("fsdp_tp", four, {"tensor_degree": 3})


def test_a_head_count_the_degree_does_not_divide_is_named():
    from paratrain.strategies.tensor.plan import check_divisible

    model = TinyGPT()
    with pytest.raises(ValueError, match=r"blocks.0.attn.n_head=4 is not divisible by the "
                                         "tensor degree 8"):
        check_divisible(model, {"blocks.0.attn.q": "colwise"}, 8)
    with pytest.raises(ValueError, match="blocks.0.attn.q.out_features=16 is not divisible"):
        check_divisible(model, {"blocks.0.attn.q": "colwise"}, 3)


class DropoutGPT(TinyGPT):
    """Dropout on the residual stream, which every tensor rank holds whole."""

    def forward(self, idx):
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = F.dropout(block(x), p=0.5, training=self.training)
        return self.head(self.ln(x))


def dropout_worker(rank, world_size):
    run = paratrain.Run(strategy="tp", progress=False, accelerator="cpu", seed=5)
    torch.manual_seed(0)
    model = DropoutGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = run.prepare(model, optimizer)
    losses = []
    for _, (x, y) in zip(range(STEPS), run.loader(tokens(), batch_size=8)):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        run.backward(loss)
        run.step(optimizer)
        losses.append(loss.item())
    # This rank's own copy of the replicated parameters (no collective that would hide
    # a difference between the copies).
    replicated = {name: p.detach().clone() for name, p in model.named_parameters()
                  if not hasattr(p, "to_local")}
    run.close()
    return {"losses": losses, "replicated": replicated}


@pytest.mark.slow
def test_tensor_parallel_peers_draw_the_same_dropout_masks():
    first, second = spawn(dropout_worker, 2, timeout=240)
    # Different masks would feed different activations into each rank's half of a layer
    # and let the replicated embeddings, norms and head drift apart.
    assert first["losses"] == second["losses"]
    assert first["replicated"].keys() == second["replicated"].keys() >= {"head.weight", "ln.weight"}
    for name, value in first["replicated"].items():
        assert torch.equal(value, second["replicated"][name]), name


def test_sequence_parallel_refuses_a_matrix_the_plan_leaves_whole():
    # Attention left whole (as GPT-2's fused c_attn is) would attend within each rank's
    # slice of the sequence: refused, not trained wrong.
    plan = resolve_plan(TinyGPT(), {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"})
    _, blocks = block_container(TinyGPT(), plan)
    with pytest.raises(ValueError, match=r"^sequence parallel cannot shard the sequence around "
                                         r"'blocks.0.attn.q' \(Linear\): it holds a matrix"):
        sequence_parallel_styles(TinyGPT(), plan, blocks)
