"""Integrations with cluster systems that start the processes themselves.

A paratrain script needs no code of its own under them: each sets torchrun's variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...) that :class:`paratrain.Topology` reads, and
``Run`` reuses a process group one has already formed. A module here holds only what a
system's own API needs on top (``paratrain.cluster.ray``: Ray Train). docs/clusters.md
describes each.
"""
