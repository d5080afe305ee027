"""Expert parallel: mixture-of-experts layers whose experts are split across ranks.

:mod:`.moe` is the layer (router, experts, load-balancing loss, router statistics);
:mod:`.dispatch` moves token copies to the ranks holding their experts (dropless,
uneven all-to-all); :mod:`.apply` splits a model's experts over an expert-parallel group.
"""
