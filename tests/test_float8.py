"""``Run(precision="float8")``: torchao's float8 training linears under bf16 autocast.

On the CPU torchao emulates float8 (``emulate=True``: the same float8 roundings and
scales, wider matmuls), so a run is compared with torchao's own recipe trained by hand;
which Linears are converted, the recipes and the one-line refusals are checked too.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.config import RunConfig
from paratrain.distributed.mesh import ParallelDegrees
from paratrain.float8 import Float8, check_available, convert, output_heads
from paratrain.models import GPT
from paratrain.precision import Precision
from paratrain.testing.pool import spawn

VOCAB, BLOCK, STEPS = 64, 16, 4


@pytest.fixture
def torchao():
    return pytest.importorskip("torchao.float8", reason="needs torchao: pip install "
                                                        "'paratrain[float8]'")


def gpt() -> GPT:
    # Widths 32 and 128 (multiples of 16) are converted; the head (64) is the vocabulary.
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=32)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (4, BLOCK), generator=g) for _ in range(STEPS)]


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def run_losses(model: nn.Module, precision: str, strategy: str = "single",
               **config) -> list[float]:
    with paratrain.Run(strategy=strategy, precision=precision, accelerator="cpu",
                       progress=False, **config) as run:
        model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for tokens in batches():
            loss = lm_loss(model(tokens), tokens)
            run.backward(loss)
            run.step(optimizer)
            losses.append(loss.item())
    return losses


def reference_losses(model: nn.Module, recipe: str) -> list[float]:
    """torchao's recipe applied by hand: every Linear but the head, emulated, bf16 autocast."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, name: name != "head")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in batches():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(tokens)
        loss = lm_loss(logits, tokens)  # outside autocast, as run.backward's loss is
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_run_trains_as_torchaos_recipe_by_hand(torchao, recipe):
    model = gpt()
    reference = reference_losses(copy.deepcopy(model), recipe)
    # Bitwise: the run executes the same operations in the same order on the same values
    # (the step divides the loss by accumulate=1, which is exact; no clipping, no scaler),
    # so no rounding can differ and no tolerance is needed.
    assert run_losses(model, "float8", float8={"recipe": recipe}) == reference
    # The comparison sees float8: plain bf16 autocast ends elsewhere.
    assert run_losses(gpt(), "bf16-mixed") != reference
    assert reference[-1] < reference[0]


def linear_types(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, nn.Linear)}


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.narrow = nn.Linear(64, 24)   # out_features not a multiple of 16
        self.wide = nn.Linear(24, 32)     # in_features not a multiple of 16
        self.mid = nn.Linear(32, 32)
        self.last = nn.Linear(32, 16)     # no named head, no embedding: the last Linear

    def forward(self, x):
        return self.last(self.mid(self.wide(self.narrow(self.up(x)))))


def test_filter_keeps_the_head_and_non_multiples_of_16_and_converts_the_rest(torchao):
    with paratrain.Run(strategy="single", precision="float8", accelerator="cpu",
                       progress=False) as run:
        model = run.prepare(gpt())
        types = linear_types(model)
        assert types.pop("head") == "Linear"
        assert len(types) == 12 and set(types.values()) == {"Float8Linear"}
        odd = run.prepare(Odd())
        assert linear_types(odd) == {"up": "Float8Linear", "narrow": "Linear", "wide": "Linear",
                                     "mid": "Float8Linear", "last": "Linear"}
        out = odd(torch.randn(8, 32))
        run.backward(out.float().square().mean())
        assert all(p.grad is not None for p in odd.parameters())


def test_skip_patterns_replace_the_default_head():
    model = gpt()
    keep = Float8(skip=["blocks.0.*", "fc"]).module_filter_fn(model)
    modules = dict(model.named_modules())
    converted = {name for name, m in modules.items() if keep(m, name)}
    assert "head" in converted and "blocks.1.attn.q" in converted
    assert not {"blocks.0.attn.q", "blocks.0.mlp.proj", "blocks.1.mlp.fc"} & converted
    assert not keep(modules["ln_f"], "ln_f")  # not a Linear
    with pytest.raises(ValueError, match=r"'lm_haed' names no nn.Linear.*blocks.0.attn.q"):
        Float8(skip=["lm_haed"]).module_filter_fn(model)


def test_output_heads():
    assert output_heads(gpt()) == ["head"]
    assert output_heads(Odd()) == ["last"]
    # The last vocabulary-sized Linear, whatever its name: the vocabulary is the first
    # embedding's (the token table), not the position table's, which "c" matches.
    model = nn.ModuleDict({"emb": nn.Embedding(48, 32), "pos": nn.Embedding(32, 32),
                           "a": nn.Linear(32, 32), "b": nn.Linear(32, 48), "c": nn.Linear(48, 32)})
    assert output_heads(model) == ["b"]


def test_rowwise_recipe_converts_with_axiswise_scales(torchao):
    with paratrain.Run(strategy="single", precision="float8", float8={"recipe": "rowwise"},
                       accelerator="cpu", progress=False) as run:
        model = run.prepare(gpt())
        config = model.blocks[0].mlp.fc.config
        assert config.cast_config_input.scaling_granularity.value == "axiswise"
        assert config.round_scales_to_power_of_2 and config.emulate
        assert not config.enable_fsdp_float8_all_gather


def test_options_are_validated_in_one_line():
    cases = [({"recipe": "blockwise"}, "float8.recipe must be 'tensorwise' or 'rowwise'"),
             ({"recipee": "rowwise"}, r"float8 has unknown field\(s\) \['recipee'\]"),
             ({"skip": "lm_head"}, "float8.skip must be a list of module-name patterns"),
             ("rowwise", "float8 must be a dict")]
    for value, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            RunConfig(precision="float8", float8=value)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="float8 options were given with precision "
                                         "'bf16-mixed'; use precision='float8'"):
        paratrain.Run(precision="bf16-mixed", float8={}, accelerator="cpu", progress=False)
    with pytest.raises(ValueError, match="float8 options were given with precision '32'"):
        Precision("32", "cpu").convert_module(nn.Linear(16, 16), float8=Float8())
    assert RunConfig(precision="float8").float8 == Float8()
    assert RunConfig(precision="32").float8 is None


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ValueError, match=r"needs torchao: pip install 'paratrain\[float8\]'"):
        paratrain.Run(precision="float8", accelerator="cpu", progress=False)


def test_gpus_before_sm89_are_refused_and_the_cpu_asks_no_gpu(torchao, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer.*A100-SXM4-80GB is "
                                         r"sm_80: use precision='bf16-mixed'"):
        check_available("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    check_available("cuda")  # H100
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: 1 / 0)
    check_available("cpu")


def test_tensor_parallel_is_refused(torchao):
    tp = SimpleNamespace(name="tp", active=True, degrees=ParallelDegrees(tensor_degree=2))
    with pytest.raises(ValueError, match=r"tensor parallel \(strategy 'tp', tp > 1\) is not "
                                         r"supported yet; use tp=1"):
        convert(gpt(), Float8(), device_type="cpu", strategy=tp)


def ranks_worker(rank, world_size):
    losses = run_losses(gpt(), "float8", strategy="ddp")
    with paratrain.Run(strategy="fsdp", precision="float8", accelerator="cpu",
                       progress=False) as run:
        try:
            run.prepare(gpt())
        except ValueError as error:
            return losses, str(error)
    return losses, None


@pytest.mark.slow
def test_ddp_trains_in_float8_on_gloo_and_sharded_float8_is_refused(torchao):
    results = spawn(ranks_worker, 2, timeout=300)
    (losses0, error0), (losses1, error1) = results
    assert losses0[-1] < losses0[0] and len(losses1) == STEPS
    for error in (error0, error1):
        assert error is not None and "\n" not in error
        assert "a sharded layout (strategy 'fsdp') needs NCCL: gloo has no float8" in error


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_float8_matches_eager_on_the_cpu(torchao):
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def inductor(gm, example_inputs):  # inductor, recording what Dynamo captured
        graphs.append(str(gm.graph))
        return compile_fx(gm, example_inputs)

    eager = run_losses(gpt(), "float8")
    compiled = run_losses(gpt(), "float8", compile={"backend": inductor})
    # Compile sees the Float8Linears (converted before the strategy compiles the model):
    # the float8 casts are in the captured graph.
    assert graphs and any("float8_e4m3fn" in graph for graph in graphs)
    # The amaxes and scales are exact in any order; what differs is the float32 and bf16
    # rounding of fused, reordered sums, a bf16 half-ulp (2**-9) of a logit at most, and
    # through it the rare float8 rounding of an element on a boundary: 2**-6 of the loss
    # bounds both for these 4 steps (measured: ~2e-5).
    assert compiled == pytest.approx(eager, rel=2**-6)


@pytest.mark.gpu
def test_compiled_float8_on_cuda_matches_eager(torchao):
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip("float8 matmuls need sm_89 or newer")

    def losses(compile):
        torch.manual_seed(0)
        model = GPT(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=256)
        with paratrain.Run(strategy="single", precision="float8", accelerator="cuda",
                           compile=compile, progress=False) as run:
            model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters()))
            assert "Float8Linear" in linear_types(run.strategy.unwrap(model)).values()
            out = []
            for tokens in batches():
                tokens = tokens.cuda()
                loss = lm_loss(model(tokens), tokens)
                run.backward(loss)
                run.step(optimizer)
                out.append(loss.item())
        return out

    # Compiled kernels fuse the casts and round in another order: within float8's own
    # e4m3 half-ulp (2**-4) of the loss's size.
    assert losses(True) == pytest.approx(losses(False), rel=2**-4)


def test_the_other_precision_tables_take_float8(torchao):
    from paratrain.plan.device import autocast
    from paratrain.run.flops import compute_dtype
    from paratrain.verify.runner import DEFAULT_TOLERANCE

    assert compute_dtype("float8") == "bf16"  # MFU against the bf16 peak
    with autocast("float8", torch.device("cpu")):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert torch.is_autocast_enabled("cpu")
    assert DEFAULT_TOLERANCE["float8"] > DEFAULT_TOLERANCE["bf16-true"]
    assert Precision("float8", "cpu").autocast_dtype == torch.bfloat16
