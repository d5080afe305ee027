"""``paratrain bench``: measure every strategy on this machine, side by side.

:mod:`~paratrain.bench.runner` plans and runs the jobs, :mod:`~paratrain.bench.worker` is one
measured process, :mod:`~paratrain.bench.report` the table; :mod:`~paratrain.bench.cli` the
command line.
"""

from paratrain.bench.report import BenchReport, BenchRow
from paratrain.bench.runner import BenchConfig, bench

__all__ = ["BenchConfig", "BenchReport", "BenchRow", "bench"]
