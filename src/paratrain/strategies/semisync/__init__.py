"""Semi-synchronous training over the replicate axis: local SGD and (streaming) DiLoCo.

``Parallel(dp_replicate=R, ..., semi_sync=LocalSGD(every=H) | DiLoCo(every=H, ...))``:
each of the R replica groups (itself FSDP over ``dp_shard x cp`` and/or tensor parallel)
runs the user's optimizer on its own data with no communication across groups; every
H optimizer steps the groups synchronise (:class:`~.outer.OuterSync`, called by
:class:`~paratrain.strategies.layout.LayoutStrategy` around its optimizer step), so
the replicate axis carries about H times fewer bytes than gradient averaging.

* :mod:`.fragments`: units and fragments of the parameters, the sync schedule;
* :mod:`.outer`: the outer step (parameter mean, or DiLoCo's outer Nesterov SGD);
* :mod:`.quantize`: DiLoCo's int8 pseudo-gradients (per-rank scales, all-gathered);
* :mod:`.resume`: each rank's outer state, parameters and optimizer state in a sharded
  checkpoint, resumed bit for bit.
"""

from paratrain.strategies.semisync.fragments import due, fragment_parameters, unit_names
from paratrain.strategies.semisync.outer import OuterSync
from paratrain.strategies.semisync.resume import load_rank_state, save_rank_state

__all__ = ["OuterSync", "due", "fragment_parameters", "load_rank_state", "save_rank_state",
           "unit_names"]
