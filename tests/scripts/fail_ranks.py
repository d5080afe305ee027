"""Ends its rank the way ``--how`` says: an error on every rank, or a signal on rank 1."""

import os
import signal
import sys
import time


def main():
    how, rank = sys.argv[1], int(os.environ["RANK"])
    if how == "error":
        if rank == 0:
            time.sleep(5)  # rank 1 fails first, even on a loaded machine
        raise ValueError(f"bad input on rank {rank}")
    if rank == 1:
        os.kill(os.getpid(), getattr(signal, how))
    time.sleep(30)


if __name__ == "__main__":
    main()
