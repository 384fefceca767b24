"""Run under torchrun: Hugging Face's own Trainer with a DeepSpeed config, on CPU ranks (issue 14).

    hf_trainer.py OUTPUT_DIR STAGE

A small Llama built from a config (odd sizes, tied embeddings, no download) and a word-level tokenizer
built in code, trained ``MAX_STEPS`` steps; the Trainer writes ``OUTPUT_DIR/checkpoint-N`` (config,
generation config, tokenizer files, ``trainer_state.json``, the DeepSpeed shards).  Rank 0 then writes
``OUTPUT_DIR/live.pt``: the trained model's full state dict and its logits on a fixed input, gathered
from the live ZeRO-3 partitions - what a consolidated export must reproduce.
"""
import sys

import torch

MAX_STEPS = 3
VOCAB = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(93)]  # 97 entries: odd


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def model_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(VOCAB), hidden_size=36, intermediate_size=53, num_hidden_layers=2,
                       num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=32,
                       tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=3)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(4, len(VOCAB), (12,), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}


def main(output_dir: str, stage: str) -> None:
    import deepspeed
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    deepspeed.init_distributed("gloo")  # before the model: zero.Init must see the real world size
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "zero_optimization": {"stage": int(stage)},
                 "zero_allow_untested_optimizer": True}
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, deepspeed=ds_config, max_steps=MAX_STEPS,
                             per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=1,
                             save_steps=MAX_STEPS, save_strategy="steps", report_to=[], seed=11,
                             dataloader_num_workers=0)
    torch.manual_seed(11)
    model = LlamaForCausalLM(model_config())
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), processing_class=tokenizer())
    trainer.train()
    engine_model = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
    params = list(engine_model.parameters())
    probe = torch.arange(4, 16).reshape(1, 12)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        state = {k: v.detach().clone().float() for k, v in engine_model.state_dict().items()}
        engine_model.eval()
        with torch.no_grad():
            logits = engine_model(input_ids=probe).logits.float()
    if torch.distributed.get_rank() == 0:
        torch.save({"state_dict": state, "probe": probe, "logits": logits}, f"{output_dir}/live.pt")
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    from job_exit import leave

    leave()
