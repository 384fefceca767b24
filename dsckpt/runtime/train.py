"""`dsckpt train`: a training loop whose checkpoints carry a real, resumable client state.

Client state saved with every checkpoint (all plain Python / tensors, nothing custom to unpickle):
``global_step``, ``epoch``, ``data_position`` (index of the next synthetic batch), ``rng``
(``python``: ``random.getstate()``, ``torch``: the CPU generator state), ``args`` (this run's
options) and ``user`` (anything the caller adds).
"""
from __future__ import annotations

import importlib
import os
import random
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ..errors import ConfigError
from . import engine as eng
from .client_state import Position, interpret
from .config import TrainOptions  # noqa: F401  (its home is torch-free: `--nproc` parents read it)
from .demo_model import build_demo_model, synthetic_batch

STEPS_PER_EPOCH = 16  # synthetic data has no natural epoch; this makes `epoch` meaningful


def load_factory(spec: str | None, freeze: bool = False) -> Callable[[], torch.nn.Module]:
    if spec is None:
        return lambda: build_demo_model(freeze_first_block=freeze)
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ConfigError(f"--model {spec!r}: expected 'package.module:factory'")
    if os.getcwd() not in sys.path and "" not in sys.path:  # a module beside the user, as `python -m` finds it
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        hint = None
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]:
            hint = (f"{module_name.split('.')[0]} is neither an installed package nor a .py file in {os.getcwd()}: run "
                    "from the folder that holds it, or put its folder on PYTHONPATH")
        raise ConfigError(f"--model {spec!r}: cannot load ({exc})", hint=hint) from None
    return factory


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))  # a JSON round trip turns tuples into lists
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))


class Trainer:
    """Owns a Runtime and the loop position; ``client_state()`` is what a checkpoint carries."""

    def __init__(self, opts: TrainOptions):
        self.opts = opts
        self.runtime = eng.Runtime(opts.deepspeed_config(), async_save=not opts.sync_save)
        self.global_step = 0
        self.epoch = 0
        self.data_position = 0
        self.last_loss: float | None = None
        self.client_source: Any = None  # where a resumed run's client state came from (resume)
        random.seed(opts.seed)
        torch.manual_seed(opts.seed)
        factory = load_factory(opts.model, opts.freeze)
        self.engine = self.runtime.setup(factory, lambda params: torch.optim.AdamW(params, lr=opts.lr))
        module = self.engine.module
        self.data_rank, self.data_ranks = eng.data_parallel(self.engine)
        self.vocab_size = getattr(module, "vocab_size", 256)
        self.seq_len = getattr(module, "seq_len", 32)

    def client_state(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "epoch": self.epoch, "data_position": self.data_position,
                "rng": rng_state(), "args": _plain(asdict(self.opts)), "user": self.opts.user_state}

    def restore(self, client: Any) -> Position:
        """Take the training position from any client state (see ``client_state.interpret``)."""
        pos = interpret(client)
        if pos.global_step is not None:
            self.global_step = pos.global_step
            self.engine.global_steps = pos.global_step  # tags and schedules continue the count
        if pos.data_position is not None:
            self.data_position = pos.data_position
        self.epoch = pos.epoch if pos.epoch is not None else self.data_position // STEPS_PER_EPOCH
        if pos.seed is not None:  # the data stream is (seed, position): a position means nothing under another seed
            self.opts.seed = pos.seed
        if pos.user is not None:
            self.opts.user_state = pos.user  # carried into the next save
        if pos.rng is not None:
            set_rng_state(pos.rng)
        return pos

    def step(self) -> float:
        tokens = synthetic_batch(self.data_position * self.data_ranks + self.data_rank, seed=self.opts.seed,
                                 batch_size=self.opts.batch_size, seq_len=self.seq_len, vocab_size=self.vocab_size)
        loss = self.engine(tokens.to(self.engine.device))
        self.engine.backward(loss)
        self.engine.step()
        self.global_step += 1
        self.data_position += 1
        if self.data_position % STEPS_PER_EPOCH == 0:
            self.epoch += 1
        self.last_loss = float(loss.detach().float())
        return self.last_loss

    def save(self, tag: str | None = None) -> str:
        if self.opts.save_dir is None:
            raise ConfigError("no --save-dir to save into")
        return self.runtime.save_checkpoint(self.opts.save_dir, self.client_state(), tag=tag or f"step{self.global_step}")

    def fit(self, steps: int, progress: bool = True) -> list[float]:
        from tqdm import tqdm

        losses = []
        import sys

        # a bar only on a terminal: piped to a log, its \r frames are noise (the result line says it all)
        bar = tqdm(range(steps), desc="train", disable=not progress or eng.rank() != 0 or not sys.stderr.isatty(),
                   leave=False)
        for _ in bar:
            losses.append(self.step())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if self.opts.save_dir and self.opts.save_every and self.global_step % self.opts.save_every == 0:
                self.save()
        if self.opts.save_dir and (not self.opts.save_every or self.global_step % self.opts.save_every):
            self.save()
        self.runtime.wait_for_saves()  # saves during the run overlap training; after fit() every one is on disk
        return losses


def states_equal(a: Any, b: Any) -> bool:
    """Exact equality of nested client states: containers by type and content, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _plain(value: Any) -> Any:
    """Options as JSON-able builtins (the client state must not need custom classes)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
