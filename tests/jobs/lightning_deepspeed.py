"""Run under torchrun: a Lightning-style DeepSpeed checkpoint, saved the way Lightning's DeepSpeedStrategy
saves one (which needs CUDA to run, so CI cannot use the strategy itself).

    lightning_deepspeed.py LIGHTNING_CKPT OUT_DIR STAGE PRECISION [bare]

LIGHTNING_CKPT: a checkpoint Lightning's own Trainer wrote on the CPU (its real dict: epoch,
global_step, loops, callbacks, hyper_parameters, ...).  As ``DeepSpeedStrategy.save_checkpoint`` does:
the LightningModule inside a wrapper whose attribute is ``_forward_module`` (Lightning's
``_LightningModuleWrapperBase``), two training steps, then ``engine.save_checkpoint(OUT_DIR,
client_state=<that dict without state_dict and optimizer_states>, tag="checkpoint")``.  Rank 0 also
writes ``OUT_DIR/live.pt``: the LightningModule's gathered state dict (the oracle).  ``bare``: the LightningModule
itself, unwrapped, as Lightning 2.6's DeepSpeedStrategy hands it to ``deepspeed.initialize`` (no prefix).
"""
import sys

import torch
from torch import nn

from dsckpt.runtime.commands import quiet_deepspeed
from dsckpt.runtime.engine import Runtime, full_state_dict, rank, shutdown
from dsckpt.runtime.train import TrainOptions


class Wrapper(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self._forward_module = module

    def forward(self, tokens):
        return self._forward_module(tokens)


def main(lightning_ckpt: str, out_dir: str, stage: str, precision: str, layout: str = "wrapped") -> None:
    from lit_model import LitOdd, batches

    quiet_deepspeed()
    client = torch.load(lightning_ckpt, weights_only=True)
    hparams = client["hyper_parameters"]
    runtime = Runtime(TrainOptions(stage=int(stage), precision=precision).deepspeed_config())
    torch.manual_seed(5)
    wrap = (lambda module: module) if layout == "bare" else Wrapper
    engine = runtime.setup(lambda: wrap(LitOdd(**hparams)),
                           lambda params: torch.optim.AdamW(params, lr=hparams["lr"]))
    for batch in list(batches())[:2]:
        loss = engine(batch.to(engine.device))
        engine.backward(loss)
        engine.step()
    state = {k: v for k, v in client.items() if k not in ("state_dict", "optimizer_states")}
    engine.save_checkpoint(out_dir, client_state=state, tag="checkpoint")
    live = full_state_dict(getattr(engine.module, "_forward_module", engine.module))
    if rank() == 0:
        torch.save(live, f"{out_dir}/live.pt")


if __name__ == "__main__":
    main(*sys.argv[1:6])
    shutdown(exit_process=True)
