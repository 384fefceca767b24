"""Other optimizers than Adam through `convert --to dcp`: ``optimizers.py train|fsdp2 ROOT`` at any world size.

``train``: for each of torch's SGD (momentum 0.9, Nesterov) and Adagrad, the odd model (a frozen layer, a tied head,
sizes no world size divides) trained 3 steps by DeepSpeed ZeRO-2 with that optimizer as the client's, saved to
ROOT/<name>/ckpt; rank 0 records every trainable parameter's fp32 master and optimizer state as DeepSpeed holds them
(``safe_get_full_optimizer_state``) in ROOT/<name>/reference.pt.
``fsdp2``: the same model under FSDP2 with the same torch optimizer loads ROOT/<name>/dcp through get_state_dict /
dcp.load / set_state_dict, records what it holds in ROOT/<name>/fsdp2.pt, then trains one step (every trainable
parameter must move). ``muon`` / ``muon_fsdp2``: the same for DeepSpeed's Muon (its MuonWithAuxAdam in the FSDP2
job, at one rank: Muon orthogonalizes whole matrices).
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from odd_model import build  # noqa: E402

OPTIMIZERS = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), ("momentum_buffer",)),
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01), ("sum",)),
}


def batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step * 7 + dist.get_rank())
    return torch.randint(0, 101, (2, 9), generator=gen)


def train(root: Path) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    for name, (make, keys) in OPTIMIZERS.items():
        torch.manual_seed(5)
        model = build()
        optimizer = make([p for p in model.parameters() if p.requires_grad])
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        for step in range(3):
            loss = engine(batch(step))
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(str(root / name / "ckpt"), tag="step3", client_state={"optimizer": name})
        reference = {"fp32": {}, **{k: {} for k in keys}}
        for n, p in engine.module.named_parameters():
            if p.requires_grad:
                reference["fp32"][n] = safe_get_full_fp32_param(p).detach().clone()
                for k in keys:
                    reference[k][n] = safe_get_full_optimizer_state(p, k).detach().clone()
        if dist.get_rank() == 0:
            torch.save(reference, root / name / "reference.pt")
        dist.barrier()


def muon(root: Path) -> None:
    """DeepSpeed's Muon (ZeRO-3; its matrices keep a momentum buffer, the rest Adam's moments): ROOT/muon/ckpt and
    reference.pt as ``train`` writes them."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(5)
    model = build()
    for p in model.parameters():
        p.use_muon = p.ndim >= 2
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "reduce_scatter": False},
              "optimizer": {"type": "Muon", "params": {"lr": 0.02}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=config)
    for step in range(3):
        loss = engine(batch(step))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(root / "muon" / "ckpt"), tag="step3", client_state={"optimizer": "muon"})
    reference = {"fp32": {}, "momentum_buffer": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            reference["fp32"][n] = safe_get_full_fp32_param(p).detach().clone()
            for key in ("momentum_buffer",) if p.use_muon else ("exp_avg", "exp_avg_sq"):
                reference[key][n] = safe_get_full_optimizer_state(p, key).detach().clone()
    if dist.get_rank() == 0:
        torch.save(reference, root / "muon" / "reference.pt")
    dist.barrier()


def fsdp2(root: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()  # noqa: E731
    for name, (make, keys) in OPTIMIZERS.items():
        torch.manual_seed(123)  # other values than the run's
        model = build()
        fully_shard(model.up)
        fully_shard(model)
        optimizer = make([p for p in model.parameters() if p.requires_grad])
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / name / "dcp"))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        record = {"fp32": {n: full(p) for n, p in trainable.items()},
                  **{k: {n: full(optimizer.state[p][k]) for n, p in trainable.items()} for k in keys},
                  "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
        model(batch(3)).backward()
        optimizer.step()
        record["moved"] = all(not torch.equal(full(p), record["fp32"][n]) for n, p in trainable.items())
        if dist.get_rank() == 0:
            torch.save(record, root / name / "fsdp2.pt")
        dist.barrier()
    dist.destroy_process_group()


def muon_fsdp2(root: Path) -> None:
    """FSDP2 with DeepSpeed's own MuonWithAuxAdam (the optimizer the Muon run used, as a torch optimizer) and the
    same two param groups loads ROOT/muon/dcp; records what it holds in ROOT/muon/fsdp2.pt, then trains one step."""
    import torch.distributed.checkpoint as dcp
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()  # noqa: E731
    muon_names = set(torch.load(root / "muon" / "reference.pt", weights_only=True)["momentum_buffer"])
    torch.manual_seed(123)
    model = build()
    fully_shard(model.up)
    fully_shard(model)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = MuonWithAuxAdam([
        {"params": [p for n, p in trainable if n in muon_names], "use_muon": True, "lr": 0.02, "momentum": 0.95,
         "weight_decay": 0},
        {"params": [p for n, p in trainable if n not in muon_names], "use_muon": False, "lr": 0.02,
         "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0}])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "muon" / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    record = {"fp32": {n: full(p) for n, p in trainable}, "momentum_buffer": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for n, p in trainable:
        for key in ("momentum_buffer",) if n in muon_names else ("exp_avg", "exp_avg_sq"):
            record[key][n] = full(optimizer.state[p][key])
    model(batch(3)).backward()
    optimizer.step()
    record["moved"] = all(not torch.equal(full(p), record["fp32"][n]) for n, p in trainable)
    if dist.get_rank() == 0:
        torch.save(record, root / "muon" / "fsdp2.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"train": train, "muon": muon, "fsdp2": fsdp2, "muon_fsdp2": muon_fsdp2}[sys.argv[1]](Path(sys.argv[2]))
    from job_exit import leave

    leave()  # no interpreter teardown under gloo threads (job_exit)
