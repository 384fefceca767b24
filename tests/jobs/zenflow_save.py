"""Run on 1 rank: a background save of a ZenFlow run (an optimizer that writes its masters outside ``step``).

ARGS: OVERLAP OUT REPORT.  DeepSpeed's ZenFlow at ZeRO-2 with the optimizer offloaded to the CPU (``overlap_step``
0: in the step, 1: on a process of its own, which writes the masters while the next step runs).  OUT/ref: DeepSpeed's
own blocking save (tag t); OUT/async: ``enable_async_save``'s save of the same moment, three steps run at once
after its call; then the engine's ``load_checkpoint`` of OUT/async must give back the fp32 partitions held at the call.
"""
import json
import sys
from pathlib import Path

import torch


def partitions(engine):
    return [p.detach().clone() for p in engine.optimizer.single_partition_of_fp32_groups]


def main(overlap: str, out: str, report: str) -> None:
    import deepspeed

    import dsckpt
    from dsckpt.runtime.commands import quiet_deepspeed

    quiet_deepspeed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.Tanh(), torch.nn.Linear(53, 5))
    zenflow = {"topk_ratio": 0.2, "select_strategy": "step", "select_interval": 2, "update_interval": 2,
               "full_warm_up_rounds": 0, "overlap_step": overlap == "1"}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        loss = engine(torch.randn(2, 37, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()

    for i in range(5):
        step(i)
    root = Path(out)
    engine.save_checkpoint(str(root / "ref"), tag="t", client_state={"step": 5})
    at_call = partitions(engine)
    handle = dsckpt.enable_async_save(engine)
    engine.save_checkpoint(str(root / "async"), tag="t", client_state={"step": 5})
    for i in range(5, 8):
        step(i)
    handle.wait()
    moved = not all(torch.equal(a, b) for a, b in zip(at_call, partitions(engine)))
    engine.load_checkpoint(str(root / "async"), tag="t")
    restored = all(torch.equal(a, b) for a, b in zip(at_call, partitions(engine)))
    Path(report).write_text(json.dumps({"optimizer": type(engine.optimizer).__name__, "moved": moved,
                                        "restored": restored}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # (ZenFlow's overlapped step starts a process that imports this script)
    main(*sys.argv[1:])
