"""Compile that stays compiled while MFU's FLOPs are counted, under every layout.

The FLOP counter is a dispatch mode, under which Dynamo runs a frame eagerly: held around
the first step it made that step (or, on older torch, every step) run uncompiled. The
counting backend here records each compiled graph's calls, step by step, with the counter
on (``peak_flops`` turns it on on CPU), and the FLOPs a compiled step reports are compared
with the eager count of the same step.
"""

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.utils.data import TensorDataset

import paratrain
from paratrain.compile import CompileOptions, compile_model, repeated_blocks
from paratrain.strategies.pipeline.layout import PipelineLayout
from paratrain.testing.numerics import REASSOCIATION
from paratrain.testing.pool import spawn

VOCAB, WIDTH, LAYERS, LENGTH, BATCH, SAMPLES = 48, 32, 4, 16, 4, 32


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Dynamo's caches outlive a Run: earlier compiles of the same code in this process
    # (other tests, other backends) would count against its recompile limit here.
    torch.compiler.reset()
    yield
    torch.compiler.reset()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        # A pipeline stage holds only its part: the embedding or the head may be None.
        h = self.embed(tokens) if self.embed is not None else tokens
        for layer in self.layers:
            h = layer(h)
        return self.head(h) if self.head is not None else h

    def pipeline_layout(self):
        return PipelineLayout(before=("embed",), blocks="layers", after=("head",))


class GraphLog:
    """A backend through AOTAutograd (as inductor is) that logs compiles and calls."""

    def __init__(self):
        self.compiles = 0
        self.calls = 0

    def backend(self):
        def forward_compiler(graph, example_inputs):
            self.compiles += 1

            def run(args):
                self.calls += 1
                return graph(*args)
            run._boxed_call = True
            return run
        return aot_autograd(fw_compiler=forward_compiler,
                            bw_compiler=lambda graph, _: make_boxed_func(graph))


def tokens():
    return TensorDataset(torch.randint(0, VOCAB, (SAMPLES, LENGTH),
                                       generator=torch.Generator().manual_seed(4)))


def train(log=None, *, strategy="single", count_flops=True, scope="auto", options=None):
    """Calls of compiled graphs per step, FLOPs per sample, losses."""
    compile = False if log is None else {"backend": log.backend(), "scope": scope}
    run = paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, seed=2,
                        compile=compile, peak_flops=1e12 if count_flops else None,
                        strategy_options=options or {})
    model = TinyLM()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls, losses = [], []
    for _ in run.epochs(1):
        for (batch,) in run.loader(tokens(), batch_size=BATCH):
            before = log.calls if log else 0
            logits = model(batch)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.flatten())
            run.backward(loss)
            run.step(optimizer)
            calls.append((log.calls if log else 0) - before)
            losses.append(loss.item())
    flops = run.throughput.flops_per_sample
    run.close()
    return calls, flops, losses


# -- one process ---------------------------------------------------------------------------
def test_compiled_blocks_run_on_every_step_while_flops_are_counted():
    log = GraphLog()
    calls, flops, _ = train(log)
    steps = SAMPLES // BATCH
    # Regional compile: the four blocks share one graph, called four times a step,
    # from the first step on (the counted one).
    assert log.compiles == 1
    assert calls == [LAYERS] * steps
    _, eager_flops, _ = train(None)
    assert flops == eager_flops  # compiled graphs counted as the eager step is


def test_the_flop_counter_compiles_no_more_and_no_fewer_frames():
    counted, quiet = GraphLog(), GraphLog()
    train(counted, count_flops=True)
    train(quiet, count_flops=False)
    assert counted.compiles == quiet.compiles == 1
    assert counted.calls == quiet.calls


def test_scope_model_compiles_the_whole_forward_once():
    log = GraphLog()
    calls, flops, _ = train(log, scope="model")
    assert log.compiles == 1 and calls == [1] * (SAMPLES // BATCH)
    assert flops == train(None)[1]


def test_repeated_blocks_are_found_and_scope_blocks_needs_them():
    model = TinyLM()
    assert repeated_blocks(model) == list(model.layers)
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    assert repeated_blocks(mlp) == []
    with pytest.raises(ValueError, match="compile\\['scope'\\] is 'blocks' but Sequential"):
        compile_model(mlp, CompileOptions(scope="blocks", backend="eager"))
    with pytest.raises(ValueError, match="compile\\['scope'\\] must be one of"):
        CompileOptions(scope="layers")


# -- layouts ----------------------------------------------------------------------------------
def worker(rank, world_size, strategy, options):
    log = GraphLog()
    calls, flops, losses = train(log, strategy=strategy, options=options)
    eager_calls, eager_flops, eager_losses = train(None, strategy=strategy, options=options)
    return calls, flops, eager_flops, losses, eager_losses


LAYOUTS = [
    ("ddp", {}, 2),
    ("fsdp", {}, 2),
    ("tp", {"plan": {"layers.*.up": "colwise", "layers.*.down": "rowwise"}}, 2),
    ("pipeline", {"num_microbatches": 2}, 2),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy, options, ranks", LAYOUTS, ids=[s for s, _, _ in LAYOUTS])
def test_compiled_graphs_run_on_every_step_under_each_layout(strategy, options, ranks):
    for calls, flops, eager_flops, losses, eager_losses in spawn(
            worker, ranks, strategy, options, timeout=500):
        assert calls and all(c > 0 for c in calls), calls  # the first step compiled too
        assert len(set(calls[1:])) == 1, calls  # as many graph calls on every step
        # A pipeline's first step also infers the stages' output shapes (more calls).
        assert calls[0] == calls[1] or (strategy == "pipeline" and calls[0] > calls[1])
        # Graph-by-graph count equals the live count. A pipeline's first step also runs
        # the schedule's shape inference, which the two counts see differently: there
        # only a count is asserted (a known gap, docs/throughput.md).
        if strategy == "pipeline":
            assert flops and eager_flops
        else:
            assert flops == pytest.approx(eager_flops, rel=1e-9)
        assert losses == pytest.approx(eager_losses, rel=REASSOCIATION)


def test_a_model_compiled_by_the_script_stays_compiled_and_mfu_is_na(capsys):
    log = GraphLog()
    run = paratrain.Run(accelerator="cpu", progress=False, seed=2, peak_flops=1e12)
    model = torch.compile(TinyLM(), backend=log.backend())
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in run.epochs(1):
        for (batch,) in run.loader(tokens(), batch_size=BATCH):
            run.backward(F.cross_entropy(model(batch).flatten(0, 1), batch.flatten()))
            run.step(optimizer)
    flops = run.throughput.flops_per_sample
    run.close()
    assert log.calls == SAMPLES // BATCH  # compiled from the first step on
    assert flops is None
    assert "compiled before prepare, so MFU is n/a" in capsys.readouterr().out


def test_epoch_stats_report_graphs_and_recompiles():
    log = GraphLog()
    run = paratrain.Run(accelerator="cpu", progress=False, seed=2,
                        compile={"backend": log.backend()})
    model = TinyLM()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # 32 samples in batches of 5: the last batch (2) is a new shape, compiled again.
    for _ in run.epochs(1):
        for (batch,) in run.loader(tokens(), batch_size=5):
            run.backward(F.cross_entropy(model(batch).flatten(0, 1), batch.flatten()))
            run.step(optimizer)
    stats = run.epoch_stats[-1]
    run.close()
    assert stats["compile_s"] > 0
    assert stats["graphs"] == log.compiles == 2 and stats["recompiles"] == 1


def test_more_hugging_face_blocks_than_dynamos_limit_all_compile():
    # A Hugging Face layer guards on its own KV-cache slot: each block its own graph of
    # the shared code. Past Dynamo's default limit (8) the later blocks ran eagerly, and
    # their FLOPs were lost from the count.
    from transformers import AutoModelForCausalLM, LlamaConfig

    def llama_run(compile):
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64,
                             num_hidden_layers=12, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=LENGTH)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        log = GraphLog()
        run = paratrain.Run(accelerator="cpu", progress=False, seed=1, peak_flops=1e12,
                            compile={"backend": log.backend()} if compile else False)
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        losses = []
        for _ in run.epochs(1):
            for (batch,) in run.loader(tokens(), batch_size=8):
                out = model(input_ids=batch, labels=batch)  # keyword inputs, out.loss
                run.backward(out.loss)
                run.step(optimizer)
                losses.append(out.loss.item())
        flops = run.throughput.flops_per_sample
        run.close()
        return log, flops, losses

    log, flops, losses = llama_run(True)
    _, eager_flops, eager_losses = llama_run(False)
    assert log.calls == 12 * (SAMPLES // 8)  # every block compiled, every step
    assert flops == eager_flops
    assert losses == pytest.approx(eager_losses, rel=REASSOCIATION)
