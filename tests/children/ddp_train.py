"""A tiny DDP training run on CPU (gloo); prints the final loss from rank 0.

argv: [--fail-rank N]  (that rank raises under torch's @record at step 2)
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel


@record
def main() -> None:
    fail_rank = (
        int(sys.argv[sys.argv.index("--fail-rank") + 1]) if "--fail-rank" in sys.argv else -1
    )
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    loss = torch.zeros(())
    for step in range(5):
        if step == 2 and rank == fail_rank:
            raise RuntimeError(f"rank {rank} diverged at step {step}")
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        print(f"final_loss={total.item() / dist.get_world_size():.8f}", flush=True)
    # Tear down together, and let the process group really go before the
    # interpreter finalizes: while DDP holds it, its gloo threads live on, and
    # one dropping the last collective's tensors during finalization needs the
    # GIL and aborts the process ("terminate called without an active exception").
    dist.barrier()
    del model, opt, loss, total
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
