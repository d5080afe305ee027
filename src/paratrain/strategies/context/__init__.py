"""Context parallel: one sequence split across ranks, attention exact over all of it.

:mod:`.sequence` cuts a batch's sequence-shaped tensors (load-balanced head-tail order);
:mod:`.attention` computes attention across the cut (ring or all-to-all).
"""
