"""After porting an Accelerate script (docs/porting.md): a paratrain Run."""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import paratrain

sys.path.insert(0, str(Path(__file__).parent))
from _common import dataset, fingerprint, model  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--accumulate", type=int, default=2)
    args = parser.parse_args(argv)
    # Accelerator(gradient_accumulation_steps=2, mixed_precision="no") becomes:
    with paratrain.Run(accumulate=args.accumulate, precision="32", progress=False) as run:
        net = model()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        net, optimizer = run.prepare(net, optimizer, scheduler)   # was: accelerator.prepare(...)
        loader = run.loader(dataset(), batch_size=args.batch_size)
        for _ in run.epochs(2):
            for x, y in loader:                     # was: with accelerator.accumulate(net):
                loss = F.cross_entropy(net(x), y)
                run.backward(loss)                  # was: accelerator.backward(loss)
                run.step(optimizer)                 # steps optimizer and scheduler on boundaries
        gathered = run.gather(loss.detach())        # was: accelerator.gather(loss)
        value = fingerprint(run.strategy.unwrap(net))   # was: accelerator.unwrap_model(net)
        print(f"rank {run.rank}/{run.world_size} fingerprint {value:.6f} "
              f"gathered {len(gathered)} steps {run.global_step}")
        return value


if __name__ == "__main__":
    main()
