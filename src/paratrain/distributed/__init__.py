"""Who is where: topology, device mesh, process group, partitioning, device utilities and
process spawning. Private torch APIs live in :mod:`~paratrain.distributed._compat`."""
