"""Pure parts of ``gpu_peers.py``: job sizes per accelerator, variant lists, the table.

Nothing here imports a peer framework or touches a device, so
``tests/bench/test_peers_report.py`` checks it without them.
"""

from __future__ import annotations

import dataclasses
import statistics

PEERS = ("raw", "accelerate", "fabric")
"""The baselines; every variant is compared with the fastest of those that ran."""

PARATRAIN = ("paratrain", "paratrain+compile", "paratrain+cudagraphs")
JOBS = ("convnet", "resnet18", "gpt")


@dataclasses.dataclass(frozen=True)
class JobSize:
    """How big one job is: per-step batch, dataset length, and the model's size knobs."""

    batch_size: int
    samples: int | None  # None: the whole dataset (Fashion-MNIST's 60,000)
    seq_len: int = 0
    n_layer: int = 0
    n_embd: int = 0
    n_head: int = 0
    vocab_size: int = 0


# CUDA sizes are the jobs as named (GPT-2 small: 12 x 768, seq 1024); the CPU sizes
# keep a run of every variant within a few minutes on two cores.
DEFAULT_SIZES = {
    "cuda": {
        "convnet": JobSize(batch_size=64, samples=None),
        "resnet18": JobSize(batch_size=256, samples=16_384),
        "gpt": JobSize(batch_size=8, samples=512, seq_len=1024, n_layer=12, n_embd=768,
                       n_head=12, vocab_size=50_304),
    },
    "cpu": {
        "convnet": JobSize(batch_size=64, samples=2_000),
        "resnet18": JobSize(batch_size=16, samples=512),
        "gpt": JobSize(batch_size=8, samples=256, seq_len=128, n_layer=2, n_embd=128,
                       n_head=4, vocab_size=1_024),
    },
}

PRECISION = {"convnet": "32", "resnet18": "bf16-mixed", "gpt": "bf16-mixed"}
"""The jobs' precision on CUDA."""


def job_precision(job: str, *, accelerator: str, override: str | None = None) -> str:
    """The precision ``job`` runs at: ``override``, else as named on CUDA, float32 on CPU.

    CPUs without bf16 units (most, before AMX) emulate bf16 matmuls, so bf16 autocast
    there measures the emulation rather than the frameworks.
    """
    if override is not None:
        if override not in ("32", "bf16-mixed"):
            raise ValueError(f"precision must be '32' or 'bf16-mixed', got {override!r}")
        return override
    return PRECISION[job] if accelerator == "cuda" else "32"


def job_size(job: str, *, accelerator: str, batch_size: int | None = None,
             samples: int | None = None, seq_len: int | None = None,
             n_layer: int | None = None, n_embd: int | None = None) -> JobSize:
    """The default size of ``job`` on ``accelerator`` with the given fields replaced."""
    if job not in JOBS:
        raise ValueError(f"job must be one of {JOBS}, got {job!r}")
    if accelerator not in DEFAULT_SIZES:
        raise ValueError(f"accelerator must be 'cpu' or 'cuda', got {accelerator!r}")
    size = DEFAULT_SIZES[accelerator][job]
    changes = {"batch_size": batch_size, "samples": samples}
    if job == "gpt":
        changes |= {"seq_len": seq_len, "n_layer": n_layer, "n_embd": n_embd}
    size = dataclasses.replace(size, **{k: v for k, v in changes.items() if v is not None})
    if job == "gpt" and n_embd is not None:
        # A new width gets GPT-2's 64-wide heads.
        size = dataclasses.replace(size, n_head=max(1, n_embd // 64))
    return size


def variants(*, accelerator: str, compile_on_cpu: bool = False) -> tuple[str, ...]:
    """Variants that make sense on ``accelerator``.

    CUDA graphs need a CUDA device; compiling on a CPU takes minutes per job, so
    it runs there only when asked for.
    """
    names = PEERS + ("paratrain",)
    if accelerator == "cuda" or compile_on_cpu:
        names += ("paratrain+compile",)
    if accelerator == "cuda":
        names += ("paratrain+cudagraphs",)
    return names


def interleaved(names: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """ABAB...: odd repeats run the variants in reverse so drift favours no one."""
    return names if repeat % 2 == 0 else names[::-1]


@dataclasses.dataclass
class Result:
    """Every repeat of one (job, variant): samples/s and peak memory in MiB (None: unknown)."""

    job: str
    variant: str
    speeds: list[float] = dataclasses.field(default_factory=list)
    peaks_mib: list[float | None] = dataclasses.field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.speeds)

    @property
    def peak_mib(self) -> float | None:
        known = [p for p in self.peaks_mib if p is not None]
        return max(known) if known else None


def ratios_to_best_peer(results: list[Result]) -> dict[tuple[str, str], float | None]:
    """Median samples/s of each result over the fastest peer's median in the same job."""
    best: dict[str, float] = {}
    for r in results:
        if r.variant in PEERS and r.speeds:
            best[r.job] = max(best.get(r.job, 0.0), r.median)
    return {(r.job, r.variant): (r.median / best[r.job] if r.job in best and r.speeds else None)
            for r in results}


def markdown_table(results: list[Result], *, memory_label: str) -> str:
    """One row per (job, variant): median, range, ratio to the best peer, peak memory."""
    ratios = ratios_to_best_peer(results)
    lines = [f"| job | variant | samples/s (median) | min-max | vs best peer | {memory_label} |",
             "|---|---|---:|---:|---:|---:|"]
    for r in results:
        if not r.speeds:
            continue
        ratio = ratios[(r.job, r.variant)]
        peak = "n/a" if r.peak_mib is None else f"{r.peak_mib:.0f}"
        lines.append(f"| {r.job} | {r.variant} | {r.median:.1f} | "
                     f"{min(r.speeds):.1f}-{max(r.speeds):.1f} | "
                     f"{'n/a' if ratio is None else f'{ratio:.2f}'} | {peak} |")
    return "\n".join(lines)
