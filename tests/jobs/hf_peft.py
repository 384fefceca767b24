"""Run under torchrun: Transformers' Trainer training a PEFT LoRA adapter with DeepSpeed (issue 23).

    hf_peft.py OUTPUT_DIR STAGE

The Llama of tests/jobs/hf_trainer.py wrapped by ``peft.get_peft_model`` (LoRA on q_proj and v_proj);
the Trainer saves ``checkpoint-3`` the way it saves PEFT runs (the DeepSpeed checkpoint with
``exclude_frozen_parameters=True``, ``adapter_config.json`` beside it).  Rank 0 writes
``OUTPUT_DIR/live.pt``: the adapter as PEFT names it (``get_peft_model_state_dict``) and the model's
logits on a fixed input, gathered from the live partitions.
"""
import os
import sys

import torch

from hf_trainer import Tokens, model_config, tokenizer


def main(output_dir: str, stage: str) -> None:
    import deepspeed
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    deepspeed.init_distributed("gloo")
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "zero_optimization": {"stage": int(stage)},
                 "zero_allow_untested_optimizer": True}
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, deepspeed=ds_config, max_steps=3,
                             per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, save_steps=3,
                             save_strategy="steps", report_to=[], seed=11, dataloader_num_workers=0)
    torch.manual_seed(11)
    base = LlamaForCausalLM(model_config())
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), processing_class=tokenizer())
    trainer.train()
    live = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    probe = torch.arange(4, 16).reshape(1, 12)
    with deepspeed.zero.GatheredParameters(list(live.parameters()), modifier_rank=None):
        adapter = {k: v.detach().clone().float() for k, v in get_peft_model_state_dict(live).items()}
        live.eval()
        with torch.no_grad():
            logits = live(input_ids=probe).logits.float()
    if torch.distributed.get_rank() == 0:
        torch.save({"adapter": adapter, "probe": probe, "logits": logits}, f"{output_dir}/live.pt")
    torch.distributed.barrier()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main(sys.argv[1], sys.argv[2])
    from job_exit import leave

    leave()
