"""S37: voting through torch.distributed (gloo) in two real processes."""

from __future__ import annotations

import multiprocessing as mp
import socket


def _rank_main(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from tests.scheduler.utils import create_scheduler, drain, step

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def all_reduce_min(value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    try:
        sched = create_scheduler(all_reduce_min=all_reduce_min, prefill_attempt_interval=3,
                                 prefill_any_attempt_interval=5)
        sched.add_sequence(f"seed{rank}", [10] * 16, 1000)
        kinds = []
        for i in range(12):
            if rank == 1 and i == 1:
                sched.add_sequence("only_rank1", [10] * 16, 1000)
            out, _ = step(sched)
            kinds.append(out.prompt_run)
        drain(sched)
        queue.put((rank, kinds))
    finally:
        dist.destroy_process_group()


def test_s37_gloo_two_processes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results[0] == results[1]  # the same kind of step on both ranks, every step
    # rank 1's late request: ALL at decode_step 3 fails (rank 0 has nothing), ANY at 5 runs it
    assert results[0].count(True) == 2
