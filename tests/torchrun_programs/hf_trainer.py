"""A program written for torchrun on Hugging Face's `Trainer`, as many pretraining and most fine-tuning scripts are.

    torchrun --nproc-per-node 2 hf_trainer.py --out DIR [--max-steps N]

`Trainer` (through accelerate) finds the world in torchrun's environment and joins it itself: no process group is set
up here (see the end of `main` for how it leaves). It trains a tiny Llama causal LM on fixed random tokens from a
fixed seed, on the CPU where there is no CUDA (gloo), with its own DDP wrapping, its own distributed sampler, its own
logging and tqdm bar. Each rank writes ``DIR/rank<RANK>.json``: the world Trainer saw (its process index and count)
and the loss history it logged.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed

VOCAB, CONTEXT = 64, 16


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences: the same on every rank, so Trainer's sampler gives each rank its share."""

    def __init__(self, size: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (size, CONTEXT), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="the folder each rank writes rank<RANK>.json to")
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()
    set_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT))
    training = TrainingArguments(output_dir=str(Path(args.out) / "trainer"), max_steps=args.max_steps,
                                 per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                                 report_to=[], use_cpu=not torch.cuda.is_available(), seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(64))
    trainer.train()
    state = trainer.state
    record = {"process_index": training.process_index, "world_size": training.world_size,
              "losses": [entry["loss"] for entry in state.log_history if "loss" in entry]}
    (Path(args.out) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
    # Leave without the interpreter's teardown. Freeing Trainer's DDP model at exit tears its gloo process group down
    # while gloo's worker thread waits for the interpreter's lock to free a finished all-gather's tensors (torch
    # 2.13): the process hangs, or aborts ("terminate called without an active exception"), under torchrun as under
    # the supervisor, in about one run in ten here; destroy_process_group() does not help, as the model still holds
    # the group.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
