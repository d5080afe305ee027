"""A plain script that leaves its process group and a reference cycle to interpreter exit.

It reports, at exit, whether the cycle was collected and the group destroyed
before the interpreter shut down (``paratrain launch`` does both).
"""

import gc
import os

import torch.distributed as dist

_destroy = dist.destroy_process_group


def destroy(*args, **kwargs):
    print(f"destroyed, still initialized={dist.is_initialized()}", flush=True)
    return _destroy(*args, **kwargs)


class Holder:
    """Stands for DDP's reducer: in a cycle, holding the group."""

    def __init__(self):
        self.me = self
        self.group = dist.group.WORLD

    def __del__(self):
        print("cycle collected", flush=True)


def main():
    dist.init_process_group("gloo")
    dist.destroy_process_group = destroy
    gc.disable()  # only an explicit collection may free the cycle
    Holder()
    print(f"rank {os.environ['RANK']} done", flush=True)


if __name__ == "__main__":
    main()
