"""Cheap cross-rank consistency checks, and naming the rank that went missing.

Four things, all through torch.distributed:

* At start, every rank gathers a fingerprint of the :class:`RunConfig` (one
  hash per field) and its host address: a node started with other settings
  fails at once with a :class:`HealthError` naming the rank and the fields.
* In ``run.prepare()``, the ranks compare a hash of their model's parameter
  names, shapes and dtypes (not values): a rank that built another model fails
  with a :class:`HealthError` naming the rank and the first differing parameter.
* Every ``PARATRAIN_HEALTH_EVERY`` optimizer steps of this process (default
  50, ``0`` disables) the ranks gather ``(steps, global step, epoch, sample
  offset, collective sequence number)``. Ranks that drifted apart (e.g. nodes
  that resumed from different checkpoints) are reported by the first
  divergent rank instead of hanging at the end of the epoch.
* When a collective fails (a peer died, a link is down, the timeout hit),
  :meth:`HealthMonitor.lost_peer_error` asks the job's store which ranks still
  answer and names the missing ones and their hosts in a :class:`PeerLostError`.

Both gathers run on a separate small gloo group, so they never pair with a
collective of the training group even when the ranks disagree.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from paratrain.distributed import _compat
from paratrain.distributed.topology import Topology

ENV_EVERY = "PARATRAIN_HEALTH_EVERY"
ENV_TIMEOUT = "PARATRAIN_TIMEOUT_S"
ADDRESS_BYTES = 64
# Fields that may differ per node without changing the computation.
_LOCAL_FIELDS = frozenset({"progress", "metrics_path", "tensorboard_dir", "checkpoint_dir",
                           "loggers"})  # used on rank 0 only
_STATE_NAMES = ("steps in this process", "global step", "epoch", "sample offset",
                "collective sequence")
# How gloo/NCCL/the store say that a peer is gone (their messages name no rank).
_PEER_FAILURE = re.compile(
    r"timed out|timeout|connection (closed|reset|refused|abort)|broken pipe|"
    r"ncclRemoteError|ncclSystemError", re.IGNORECASE)


class HealthError(RuntimeError):
    """Ranks disagree (configuration, step or data position); names the first divergent rank."""


class PeerLostError(RuntimeError):
    """A collective failed because a peer died or became unreachable; names it."""


def field_hash(value: Any) -> int:
    """A stable signed 64-bit hash of ``repr(value)`` (Python's hash() is salted per process)."""
    # Object addresses (functions, classes defined in a script) differ per process.
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def config_fingerprint(config: Any) -> tuple[list[str], torch.Tensor]:
    """Names and per-field hashes of a config dataclass, plus the paratrain and torch versions."""
    from paratrain import __version__

    names, hashes = [], []
    for f in dataclasses.fields(config):
        if f.name not in _LOCAL_FIELDS:
            names.append(f.name)
            hashes.append(field_hash(getattr(config, f.name)))
    names += ["paratrain version", "torch version"]
    hashes += [field_hash(__version__), field_hash(torch.__version__)]
    return names, torch.tensor(hashes, dtype=torch.int64)


def model_fingerprint(model: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every parameter of ``model``, in registration order.

    Values are left out on purpose: ranks may legitimately start from different
    weights (a strategy broadcasts or shards them), but never with other shapes.
    """
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for name, p in model.named_parameters()]


def describe_model_difference(rows: Sequence[Sequence[tuple[str, tuple[int, ...], str]]],
                              bad: int, ref: int) -> str:
    """Where rank ``bad``'s fingerprint first differs from rank ``ref``'s, in words."""
    mine, theirs = list(rows[bad]), list(rows[ref])
    for (name, shape, dtype), (ref_name, ref_shape, ref_dtype) in zip(mine, theirs):
        if name != ref_name:
            return f"at parameter {name!r}: rank {ref} has {ref_name!r} in its place"
        if shape != ref_shape:
            return f"at {name!r}: shape {shape} vs {ref_shape}"
        if dtype != ref_dtype:
            return f"at {name!r}: dtype {dtype} vs {ref_dtype}"
    extra = mine[len(theirs)] if len(mine) > len(theirs) else theirs[len(mine)]
    return (f"in its parameter count: {len(mine)} vs {len(theirs)} (first unmatched "
            f"{extra[0]!r})")


def first_divergent(rows: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """``(divergent_rank, reference_rank)`` or None when all rows agree.

    The reference is the row most ranks hold (ties: the lowest rank's); the
    divergent rank is the lowest rank whose row differs from it.
    """
    rows = [tuple(r) for r in rows]
    counts = Counter(rows)
    if len(counts) == 1:
        return None
    best = max(counts.values())
    reference = next(r for r in rows if counts[r] == best)
    ref_rank = rows.index(reference)
    return next(i for i, r in enumerate(rows) if r != reference), ref_rank


def local_address(master_addr: str | None, master_port: str | None) -> str:
    """The address this host uses to reach the master (no packet is sent), else the hostname."""
    if master_addr:
        try:
            family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                # A UDP connect only picks the route and source address.
                probe.connect((master_addr, int(master_port or 1)))
                return probe.getsockname()[0]
        except (OSError, ValueError):
            pass
    return socket.gethostname()


def _encode(text: str) -> torch.Tensor:
    data = text.encode()[:ADDRESS_BYTES]
    return torch.tensor(list(data.ljust(ADDRESS_BYTES, b"\0")), dtype=torch.uint8)


def _decode(blob: torch.Tensor) -> str:
    return bytes(blob.tolist()).rstrip(b"\0").decode(errors="replace")


def _collective_sequence() -> int:
    """How many collectives the default group has issued on this rank; -1 if unknown.

    A private c10d API (there is no public one): ranks that issued different numbers
    of collectives are out of step even when their step counters agree. Where a torch
    version lacks it, every rank reports -1 and the other fields are still compared.
    """
    return _compat.collective_sequence_number()


class HealthMonitor:
    """Consistency checks and failure diagnosis for one rank.

    Args:
        topology: this process's place in the job.
        every: optimizer steps between consistency checks (0 disables them).
    """

    def __init__(self, *, topology: Topology, every: int, restarts_left: int = 0) -> None:
        self.topology = topology
        self.every = every
        self.restarts_left = restarts_left  # torchrun's --max-restarts not used up yet
        self.local_steps = 0
        self.hosts = [local_address(os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))]
        self.group: Any = None
        if topology.is_distributed and dist.is_initialized():
            # Gloo and CPU tensors: no device sync, and its own tag sequence.
            self.group = dist.new_group(backend="gloo")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-gather a small CPU tensor over the health group: one row per rank."""
        parts = [torch.empty_like(tensor) for _ in range(self.topology.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.stack(parts)

    def host(self, rank: int) -> str:
        return self.hosts[rank] if rank < len(self.hosts) else "unknown host"

    def check_config(self, config: Any) -> None:
        """Gather host addresses and config fingerprints; HealthError if any rank differs."""
        if self.group is None:
            return
        self.hosts = [_decode(b) for b in self.gather(_encode(self.hosts[0]))]
        names, fingerprint = config_fingerprint(config)
        rows = self.gather(fingerprint).tolist()
        found = first_divergent(rows)
        if found is None:
            return
        bad, ref = found
        fields = [n for n, a, b in zip(names, rows[bad], rows[ref]) if a != b]
        raise HealthError(
            f"rank {bad} (host {self.host(bad)}) was started with a different configuration "
            f"than rank {ref} (host {self.host(ref)}): {', '.join(fields)} "
            f"{'differs' if len(fields) == 1 else 'differ'}; start every "
            "node with the same script arguments and paratrain/torch versions"
        )

    def check_model(self, model: Any) -> None:
        """Compare :func:`model_fingerprint` across ranks; HealthError naming the first difference.

        One all-gather of a 64-bit hash; the full fingerprints are gathered only
        when the hashes differ. A mismatch caught here would otherwise surface as a
        shape error deep inside DDP's first broadcast, or abort the process in FSDP.
        """
        if self.group is None:
            return
        fingerprint = model_fingerprint(model)
        hashes = self.gather(torch.tensor([field_hash(fingerprint)], dtype=torch.int64))
        found = first_divergent(hashes.tolist())
        if found is None:
            return
        bad, ref = found
        rows: list[Any] = [None] * self.topology.world_size
        dist.all_gather_object(rows, fingerprint, group=self.group)
        raise HealthError(
            f"rank {bad}'s model differs from rank {ref}'s "
            f"{describe_model_difference(rows, bad, ref)}; build the same model on every rank "
            f"(rank {bad} runs on host {self.host(bad)})"
        )

    def after_step(self, *, global_step: int, epoch: int, offset: int) -> None:
        """Count a step; every ``every`` steps check that all ranks are at the same place."""
        self.local_steps += 1
        if self.group is None or not self.every or self.local_steps % self.every:
            return
        state = torch.tensor([self.local_steps, global_step, epoch, offset, _collective_sequence()],
                             dtype=torch.int64)
        rows = self.gather(state).tolist()
        found = first_divergent(rows)
        if found is None:
            return
        bad, ref = found
        diffs = [f"{n} {a} vs {b}" for n, a, b in zip(_STATE_NAMES, rows[bad], rows[ref])
                 if a != b]
        raise HealthError(
            f"rank {bad} (host {self.host(bad)}) diverged from rank {ref} "
            f"(host {self.host(ref)}): {'; '.join(diffs)}; did the nodes resume from different "
            "checkpoints or run different code?"
        )

    # -- after a failed collective -------------------------------------------------
    def is_peer_failure(self, exc: BaseException) -> bool:
        """True for the errors a collective raises when a peer is gone."""
        if not self.topology.is_distributed or isinstance(exc, (HealthError, PeerLostError)):
            return False
        return isinstance(exc, dist.DistBackendError) or (
            isinstance(exc, RuntimeError) and bool(_PEER_FAILURE.search(str(exc))))

    def lost_peer_error(self, exc: BaseException, *, wait_s: float = 2.0) -> PeerLostError:
        """A PeerLostError naming the ranks that do not answer through the job's store."""
        missing = self._unanswered_ranks(wait_s)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        first = re.sub(r"^\[[^\]]*\]\s*", "", first)[:160]  # drop gloo's source location
        if missing is None:
            lost = (f"lost contact with rank 0 (host {self.host(0)}, which holds the job's "
                    "store)")
        elif missing:
            lost = "lost " + ", ".join(f"rank {r} (host {self.host(r)})" for r in missing)
        else:
            lost = "every rank still answers; a peer is stuck or too slow"
        then = ("torchrun restarts it from the last checkpoint" if self.restarts_left else
                "use `paratrain launch --max-restarts N` to restart from the last checkpoint")
        return PeerLostError(
            f"rank {self.topology.rank}: a collective failed ({first}); {lost}; the job stops "
            f"({then})")

    def _unanswered_ranks(self, wait_s: float) -> list[int] | None:
        """Ranks that do not write their key within ``wait_s``; None if the store is gone."""
        try:
            store = dist.PrefixStore("paratrain/alive", _compat.default_store())
        except (RuntimeError, ValueError, AttributeError):
            return None
        answer: dict[str, list[int]] = {}

        def probe() -> None:
            try:
                store.set_timeout(datetime.timedelta(seconds=max(wait_s, 1.0)))
                store.set(str(self.topology.rank), "1")
                deadline = time.monotonic() + wait_s
                missing = list(range(self.topology.world_size))
                while missing and time.monotonic() < deadline:
                    missing = [r for r in missing if not store.check([str(r)])]
                    time.sleep(0.1)
                answer["missing"] = missing
            except Exception:  # noqa: BLE001 - an unreachable store is the answer
                return

        # A thread bounds the probe: a store behind a cut link can block for minutes.
        thread = threading.Thread(target=probe, daemon=True, name="paratrain-health-probe")
        thread.start()
        thread.join(wait_s + 1.0)
        return answer.get("missing")
