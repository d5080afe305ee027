"""The parameter server: protocol pieces (pure), then gloo jobs against single-process references."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.distributed.topology import Topology
from paratrain.strategies.ps import protocol as proto
from paratrain.strategies.ps.server import average_round, staleness_weight
from paratrain.strategies.ps.strategy import PSOptions, PSStrategy, resolve_num_servers
from paratrain.strategies.ps.worker import assemble_state, split_state
from paratrain.testing.numerics import TrainingBound, assert_params_within
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification, train_steps

REPO = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 96
SPAWN_TIMEOUT = 600  # seconds; generous because CI machines may be shared and busy


def dataset(n=NUM_SAMPLES):
    return synthetic_classification(n)


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


# -- pure logic ---------------------------------------------------------------------------

def test_shards_are_balanced_and_cover_every_parameter():
    assert proto.shard_ranges(10, 3) == ((0, 4), (4, 7), (7, 10))
    model = mlp()
    optimizer = torch.optim.SGD([{"params": model[0].parameters()},
                                 {"params": model[2].parameters(), "lr": 0.5}], lr=0.1)
    layout = proto.FlatLayout.from_optimizer(optimizer, 3)
    covered = {i: [] for i in range(len(layout.shapes))}
    for server in range(3):
        lo, hi = layout.ranges[server]
        local = 0
        for piece in layout.pieces(server):
            assert piece.local == local  # pieces tile the shard in order
            local += piece.stop - piece.start
            covered[piece.param].append((piece.start, piece.stop))
            assert piece.group == (0 if piece.param < 2 else 1)
        assert local == hi - lo
    for index, ranges in covered.items():
        assert ranges[0][0] == 0 and ranges[-1][1] == layout.shapes[index].numel()
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_optimizer_state_splits_and_reassembles_for_any_server_count():
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    F.cross_entropy(model(dataset().tensors[0][:8]), dataset().tensors[1][:8]).backward()
    optimizer.step()
    state = optimizer.state_dict()["state"]
    for num_servers in (1, 2, 5):
        layout = proto.FlatLayout.from_optimizer(optimizer, num_servers)
        parts = [split_state(layout, state, s) for s in range(num_servers)]
        merged = assemble_state(layout, parts)
        assert sorted(merged) == sorted(state)
        for index, entry in state.items():
            for key, value in entry.items():
                assert torch.equal(merged[index][key], value), (num_servers, index, key)


def test_header_carries_learning_rates_exactly():
    header = proto.make_header(proto.PUSH, 1, [0.1, 3e-4])
    assert proto.parse_header(header) == (proto.PUSH, 1, [0.1, 3e-4])


@pytest.mark.parametrize("options, message", [
    ({"mode": "bsp"}, "mode must be one of"),
    ({"mode": "sync", "staleness": 2}, "staleness applies to mode='ssp' only"),
    ({"mode": "ssp", "staleness": -1}, "staleness must be an integer >= 0"),
    ({"num_servers": 0}, "num_servers must be an integer >= 1"),
    ({"optimizer_factory": 3}, "optimizer_factory must be callable"),
    ({"mode": "ssp", "staleness_weighting": "linear"}, "staleness_weighting must be one of"),
])
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        PSOptions(**options)


def test_round_average_is_the_plain_mean_unless_stale_gradients_are_weighted_down():
    a, b, c = torch.tensor([3.0, 6.0]), torch.tensor([1.0, 2.0]), torch.tensor([5.0, -4.0])
    plain = (a + b + c) / 3
    assert torch.equal(average_round([a.clone(), b.clone(), c.clone()], [0, 2, 1], "equal"),
                       plain)
    # Every gradient fresh: weight 1 each, the same sum in the same order as "equal".
    assert torch.equal(average_round([a.clone(), b.clone(), c.clone()], [0, 0, 0], "inverse"),
                       plain)
    # Weights 1, 1/3, 1/2: (a + b/3 + c/2) / (1 + 1/3 + 1/2).
    weighted = average_round([a.clone(), b.clone(), c.clone()], [0, 2, 1], "inverse")
    torch.testing.assert_close(weighted, (a + b / 3 + c / 2) / (11 / 6))
    assert staleness_weight(3, "inverse") == 0.25 and staleness_weight(3, "equal") == 1.0


def outbox_worker(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        got = []
        for _ in range(5):
            buffer = torch.empty(1000)
            dist.recv(buffer, 0, tag=7)
            got.append(int(buffer[0]))
        dist.send(torch.zeros(1), 0, tag=8)  # the next request: every reply was read
        return got
    outbox = proto.Outbox(None)
    for i in range(5):
        outbox.send(torch.full((1000,), float(i)), 1, tag=7)
    dist.recv(torch.empty(1), 1, tag=8)
    before = len(outbox)
    outbox.settle(0)  # nothing was sent to rank 0
    unchanged = len(outbox)
    outbox.settle(1)
    return before, unchanged, len(outbox)


def test_outbox_releases_a_peers_buffers_once_it_has_read_them():
    # Gloo reports a send complete only once waited for: without settle() a server would
    # keep every parameter copy it ever sent (gigabytes over an epoch).
    (before, unchanged, after), got = spawn(outbox_worker, 2, timeout=SPAWN_TIMEOUT)
    assert got == [0, 1, 2, 3, 4]
    assert (before, unchanged, after) == (5, 5, 0)


def test_server_count_from_launcher_environment():
    assert resolve_num_servers(PSOptions(), {}) == 1
    assert resolve_num_servers(PSOptions(), {"PARATRAIN_PS_SERVERS": "2"}) == 2
    assert resolve_num_servers(PSOptions(num_servers=3), {"PARATRAIN_PS_SERVERS": "2"}) == 3
    with pytest.raises(ValueError, match="PARATRAIN_PS_SERVERS='x' must be an integer"):
        resolve_num_servers(PSOptions(), {"PARATRAIN_PS_SERVERS": "x"})


def test_a_job_without_workers_is_refused():
    with pytest.raises(ValueError, match="needs more than 2 processes"):
        PSStrategy(Topology(rank=0, world_size=2, local_world_size=2), PSOptions(num_servers=2))
    with pytest.raises(ValueError, match="--ps-servers"):
        paratrain.Run(strategy="ps", progress=False, accelerator="cpu")


# -- gloo jobs ------------------------------------------------------------------------------

def make_optimizer(name, model):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(strategy, batch_size, num_steps, options=None, optimizer="sgd", *, log_every_step=False,
          **run_kwargs):
    """Train ``num_steps`` per epoch for 2 epochs: ``(params, stats)`` (``ps``), or
    ``(params, bound)`` (``single``: how far another layout may drift, see
    :mod:`paratrain.testing.numerics`); None on a parameter-server rank.

    ``log_every_step``: also average the loss over workers after every step (a collective).
    """
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=7,
                        strategy_options=options or {}, **run_kwargs)
    model = mlp()
    opt = make_optimizer(optimizer, model)
    bound = TrainingBound(model, opt) if strategy == "single" else None
    try:
        model, opt = run.prepare(model, opt)
    except SystemExit as exit_:
        assert exit_.code == 0
        return None  # a server: it served until every worker had finished
    loader = run.loader(dataset(), batch_size=batch_size)
    train_steps(run, model, opt, loader, num_steps=num_steps, num_epochs=2,
                mean_losses=log_every_step)
    params = {k: v.detach().clone() for k, v in run.strategy.unwrap(model).state_dict().items()}
    stats = None
    if strategy == "ps":
        run.mean(torch.tensor(0.0))  # parks every worker: all their gradients are applied
        stats = run.strategy.stats() if run.is_main else None
    run.close()
    return params, bound if strategy == "single" else stats


def train_worker(rank, world_size, strategy, batch_size, num_steps, options, optimizer="sgd",
                 run_kwargs=None):
    return train(strategy, batch_size, num_steps, options, optimizer, **(run_kwargs or {}))


def train_worker_logging(rank, world_size, strategy, batch_size, num_steps, options):
    return train(strategy, batch_size, num_steps, options, log_every_step=True)


def assert_params_close(got, expected):
    # The same gradients through the same elementwise optimizer arithmetic (one worker,
    # or the same workers' gradients averaged in the same order): they differ by no
    # more than an ulp of an update (~1e-9 here), far below 1e-6.
    for name, ref in expected.items():
        torch.testing.assert_close(got[name], ref, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sync_equals_ddp_equals_single_process_and_ssp0_equals_sync():
    reference, bound = train("single", 8, 5)
    # 2 workers x batch 4 = the reference's batch of 8; the parameters span 2 servers.
    # A per-step run.mean (a collective, so a park at the servers) must not change that.
    sync = spawn(train_worker_logging, 4, "ps", 4, 5, {"num_servers": 2}, timeout=SPAWN_TIMEOUT)
    # ssp(0) with staleness weighting: every gradient is fresh, so it is sync exactly.
    ssp0 = spawn(train_worker, 3, "ps", 4, 5,
                 {"mode": "ssp", "staleness": 0, "staleness_weighting": "inverse"},
                 timeout=SPAWN_TIMEOUT)
    ddp = spawn(train_worker, 2, "ddp", 4, 5, {}, timeout=SPAWN_TIMEOUT)
    assert sync[2:] == [None, None] and ssp0[2] is None  # servers return nothing
    for params, _ in [*sync[:2], *ssp0[:2], *ddp]:
        # Two workers' half-batch gradients averaged: float32 sums in another order,
        # carried through SGD (paratrain.testing.numerics).
        assert set(params) == set(reference)
        assert_params_within(params, reference, bound)
    # Same gradients averaged in the same order: sync and ssp(0) agree bitwise.
    for name in reference:
        assert torch.equal(sync[0][0][name], ssp0[0][0][name])
        assert torch.equal(sync[0][0][name], sync[1][0][name])
    stats = sync[0][1]
    assert stats.updates == 10 and stats.pushes == 20
    assert stats.max_staleness == 0 and int(stats.histogram.sum()) == 2 * 20
    # Parameters travel once per worker at start and once per push: the parks in front
    # of the per-step collectives found nothing changed and sent only a flag.
    assert stats.replies == 2 + 20
    # The server released the buffers of replies its workers had read: only the last
    # exchange with each worker can still be held (it had 40+ before Outbox.settle).
    assert stats.pending_sends <= 2 * 3


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_async_with_one_worker_equals_single_process():
    reference, _ = train("single", 8, 4, optimizer="adam")
    worker, server = spawn(train_worker, 2, "ps", 8, 4, {"mode": "async"}, "adam", timeout=SPAWN_TIMEOUT)
    assert server is None
    assert_params_close(worker[0], reference)
    assert worker[1].updates == 8 and worker[1].max_staleness == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ssp_never_exceeds_its_staleness_bound_under_a_straggler(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    results = spawn(train_worker, 4, "ps", 4, 4, {"mode": "ssp", "staleness": 2}, "sgd",
                    {"metrics_path": str(metrics)}, env={"PARATRAIN_STRAGGLER": "1:0.15"},
                    timeout=SPAWN_TIMEOUT)
    stats = results[0][1]
    assert stats.histogram.shape == (3, proto.STALENESS_BINS)
    assert int(stats.histogram.sum()) == stats.pushes == 3 * 8
    assert stats.max_staleness <= 2
    # The fast workers did run ahead of the straggler: the bound was exercised.
    assert int(stats.histogram[:, 1:].sum()) > 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1]
    assert rows[-1]["ps_staleness_max"] <= 2 and rows[-1]["ps_updates_per_s"] > 0
    assert "ps_staleness_w1" in rows[-1]


def fixed_batch(worker, step):
    start = ((worker + 2 * step) * 4) % NUM_SAMPLES
    return slice(start, start + 4)


def unequal_worker(rank, world_size, directory):
    run = paratrain.Run(strategy="ps", progress=False, accelerator="cpu", seed=7)
    model = mlp()
    try:
        model, opt = run.prepare(model, make_optimizer("sgd", model))
    except SystemExit:
        return None
    x, y = dataset().tensors
    for step in range(3 + 2 * rank):  # worker 0: 3 steps, worker 1: 5 steps
        batch = fixed_batch(rank, step)
        run.backward(F.cross_entropy(model(x[batch]), y[batch]))
        run.step(opt)
    path = run.save(directory)  # worker 0 waits here while worker 1 finishes alone
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    run.close()
    return params, path


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_workers_with_different_step_counts_finish_and_rank0_saves_the_final_model(tmp_path):
    torch.manual_seed(7)
    model = mlp()
    optimizer = make_optimizer("sgd", model)
    x, y = dataset().tensors
    steps = [3, 5]
    for step in range(max(steps)):
        grads = []
        for worker in [w for w in range(2) if steps[w] > step]:
            model.zero_grad()
            batch = fixed_batch(worker, step)
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs[1:], gs[0].clone()) / len(gs)
        optimizer.step()
    (params0, path), (params1, none_path), server = spawn(unequal_worker, 3, str(tmp_path), timeout=SPAWN_TIMEOUT)
    assert server is None and none_path is None
    assert_params_close(params0, model.state_dict())
    assert_params_close(params1, model.state_dict())
    saved = torch.load(path, weights_only=True)
    assert_params_close(saved["models"][0], model.state_dict())
    # The servers' momentum, in torch's own per-parameter layout.
    expected_state = optimizer.state_dict()["state"]
    for index, entry in saved["optimizers"][0]["state"].items():
        torch.testing.assert_close(entry["momentum_buffer"],
                                   expected_state[index]["momentum_buffer"], atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_resume_restores_server_shards_and_optimizer_state_with_other_server_count(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    run_kwargs = {"checkpoint_dir": str(first), "checkpoint_every": 5, "keep_checkpoints": 10}
    full = spawn(train_worker, 3, "ps", 4, 100, {}, "adam", run_kwargs, timeout=SPAWN_TIMEOUT)
    # Resume from step 10 (mid epoch 0 of 12 steps) with 2 servers instead of 1.
    second.mkdir()
    (first / "step-000000010.pt").rename(second / "step-000000010.pt")
    resumed = spawn(train_worker, 4, "ps", 4, 100, {"num_servers": 2}, "adam",
                    {"checkpoint_dir": str(second)}, timeout=SPAWN_TIMEOUT)
    assert resumed[0][1].updates == 24 - 10
    for worker in range(2):
        assert_params_close(resumed[worker][0], full[0][0])


def run_cli(*argv, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "paratrain.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def leftover_processes(marker):
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline:
            found.append(proc.pid)
    return found


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_unchanged_script_runs_under_launch_with_a_server(tmp_path):
    out = tmp_path / "model.pt"
    result = run_cli("launch", "--nproc-per-node", "3", "--ps-servers", "1",
                     str(REPO / "tests" / "scripts" / "train_tiny.py"), "--strategy", "ps",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameter server: 2 worker(s) (ranks 0-1), 1 server(s), mode sync" in result.stdout
    assert "epoch 1 step 26" in result.stdout
    assert set(torch.load(out)) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert leftover_processes(str(out)) == []


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_killed_worker_fails_the_job_with_a_clear_message(tmp_path):
    out = tmp_path / "killed.pt"
    start = time.monotonic()
    result = run_cli("launch", "--nproc-per-node", "3", "--ps-servers", "1",
                     str(REPO / "tests" / "scripts" / "train_tiny.py"), "--strategy", "ps",
                     "--out", str(out),
                     env={"PARATRAIN_KILL_AT_STEP": "3", "PARATRAIN_KILL_RANK": "1"})
    assert result.returncode == 1
    assert "worker rank 1 (local rank 1) failed first with signal SIGKILL" in result.stderr
    assert time.monotonic() - start < 200  # the launcher stops the others; nothing waits
    assert not out.exists()
    assert leftover_processes(str(out)) == []
