"""The Hugging Face export (``consolidate --hf``): a folder ``from_pretrained`` loads, and the HF files it carries.

An HF Trainer's ``checkpoint-N`` folder is also the DeepSpeed checkpoint root: ``global_stepN/`` and
``latest`` beside ``config.json``, ``generation_config.json``, the tokenizer's files and
``trainer_state.json``.  ``consolidate --hf`` writes the weights as sharded safetensors and copies the
companions found there (or ``--config PATH``), with the config's dtype set to what the weights hold.
"""
from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UnsafeCheckpointError
from ..formats.json_file import read_json_object
from ..plan.names import duplicate_aliases
from ..zero.layout import TRUST_HINT, inside
from ..io.context import WriteContext
from .registry import Format, Listing, Prepared, Request, by_name, register
from ..formats.safetensors_file import INDEX_NAME
from .sharded import read_sharded, replaced_shards

CONFIG = "config.json"  # required: from_pretrained builds the model from it
GENERATION_CONFIG = "generation_config.json"
# Tokenizer files any tokenizer class may save (fast and slow tokenizers, chat templates).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json")
DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # config.json's spelling
DTYPE_KEYS = ("dtype", "torch_dtype")  # transformers >= 4.56 writes "dtype"; older ones "torch_dtype"


@dataclass(frozen=True)
class Companions:
    config: Path
    others: tuple[Path, ...]  # generation config and tokenizer files, copied as they are


def find_companions(root: Path, config: Path | None = None, trust: bool = False) -> Companions:
    """The config (``config`` if given, else ``root/config.json``) and the other files beside it.

    A companion that is a symlink out of ``root`` is refused unless ``trust``: a checkpoint whose
    ``tokenizer.json -> /etc/passwd`` would otherwise put that file in an export made to be published.
    """
    root = Path(root)
    chosen = Path(config) if config else root / CONFIG
    if not chosen.is_file():
        where = f"--config {config}: no such file" if config else f"{root}: holds no {CONFIG}"
        raise ConfigError(f"{where}; a Hugging Face folder needs the model's config",
                          hint="pass --config PATH/config.json (the one the model was built from)")
    others = tuple(root / n for n in (GENERATION_CONFIG, *TOKENIZER_FILES) if (root / n).is_file())
    if not trust:
        for path in (() if config else (chosen,)) + others:
            if path.is_symlink() and not inside(path.resolve(), root):
                raise UnsafeCheckpointError(f"a symlink to {path.resolve()}, outside the checkpoint; "
                                            "not copied into the export", hint=TRUST_HINT, at=path)
    read_json(chosen)  # a broken config fails now, before any weight is written
    return Companions(chosen, others)


def read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, "JSON file")


def ties_embeddings(companions: Companions) -> bool:
    """Whether transformers will tie the output head to the embedding itself (its default: yes)."""
    return read_json(companions.config).get("tie_word_embeddings", True) is not False


def write_companions(companions: Companions, folder: Path, weights_dtype: str) -> list[str]:
    """Copy the companions into ``folder``; the config's dtype fields say ``weights_dtype``."""
    config = read_json(companions.config)
    name = DTYPE_NAMES.get(weights_dtype)
    if name:
        for key in DTYPE_KEYS:
            if key in config or key == DTYPE_KEYS[0]:
                config[key] = name
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in companions.others:
        shutil.copyfile(path, folder / path.name)
    return [CONFIG] + [p.name for p in companions.others]


def check_config_fits(config_path: Path, names_shapes: dict[str, tuple[int, ...]], aliases: dict[str, str]) -> None:
    """Refuse a config whose model does not match the weights (another architecture's ``config.json``):
    ``from_pretrained`` would build it and report missing keys, or fail on shapes.

    With transformers importable (it is wherever the export gets loaded), the model the config describes is
    built on the meta device and its state dict compared name for name and shape for shape; tied names
    may be absent.  Without it, the config's layer count and vocabulary are checked against the names.
    """
    config = read_json(config_path)
    try:
        expected, tied = _meta_state(config)
    except ImportError:
        expected, tied = None, set()
    where = f"{config_path} ({', '.join(config.get('architectures') or [str(config.get('model_type'))])})"
    if expected is None:
        _check_counts(config, names_shapes, where)
        return
    present = set(names_shapes) | set(aliases)
    missing = sorted(n for n in expected if n not in present and n not in tied)
    unexpected = sorted(n for n in names_shapes if n not in expected)
    shapes = sorted(n for n in names_shapes if n in expected and tuple(expected[n]) != tuple(names_shapes[n]))
    if missing or unexpected or shapes:
        parts = [f"{len(v)} {k}, e.g. {v[0]!r}" for k, v in (("missing", missing), ("unexpected", unexpected),
                                                            ("of another shape", shapes)) if v]
        raise ConfigError(f"does not describe these weights ({'; '.join(parts)})",
                          hint="pass the config.json the model was built from (--strip-prefix for a wrapper's prefix)", at=where)


def _meta_state(config: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]] | None, set[str]]:
    """Names and shapes of the model ``config`` describes, built on the meta device (no memory), and the
    names that are tied to another; None when transformers does not know the architecture."""
    import torch
    import transformers

    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        return None, set()
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its advice about building a model is not the user's concern here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = transformers.AutoConfig.for_model(**kwargs)
            with torch.device("meta"):
                model = cls(cfg)
    except Exception:  # an unusual config this transformers cannot build: fall back to the counts
        return None, set()
    finally:
        transformers.logging.set_verbosity(verbosity)
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.setdefault(id(param), name)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, tied


def _check_counts(config: dict[str, Any], names_shapes: dict[str, tuple[int, ...]], where: str) -> None:
    import re

    layers = {int(m.group(1)) for n in names_shapes for m in [re.search(r"\.(?:layers|h|layer|blocks)\.(\d+)\.", n)] if m}
    want = config.get("num_hidden_layers", config.get("n_layer"))
    if isinstance(want, int) and layers and len(layers) != want:
        raise ConfigError(f"says {want} layers, the weights hold {len(layers)}",
                          hint="pass the config.json the model was built from", at=where)
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and not any(vocab in shape for shape in names_shapes.values()):
        raise ConfigError(f"says a vocabulary of {vocab}, and no tensor of the weights has that size",
                          hint="pass the config.json the model was built from", at=where)


def _refuse_adapter_only(plan: Any, root: Path) -> None:
    """A PEFT run's checkpoint holds the adapter and no base weights (the Trainer saved the trainable ones only):
    a full model cannot come out of it, whatever config is given."""
    from .adapters import ADAPTER_TENSOR

    adapter = [t.name for t in plan.tensors if ADAPTER_TENSOR.search(t.name)]
    if adapter and all(ADAPTER_TENSOR.search(t.name) or t.kind == "buffer" for t in plan.tensors):
        raise ConfigError(f"this checkpoint holds only the adapter: {len(adapter)} LoRA tensors and no base "
                          "weights; a merged model needs the base model's weights, which it does not hold",
                          hint="export the adapter (`dsckpt consolidate CKPT OUT --hf`, no --config), then merge in "
                               "PEFT: PeftModel.from_pretrained(base, OUT).merge_and_unload().save_pretrained(...)",
                          at=root)


class HuggingFaceFormat(Format):
    name = "hf"
    directory = True
    selectable = False  # chosen by --hf
    reties_aliases = True  # transformers ties them from the config
    takes_config = True
    streams_tensors = True
    summary = "a folder from_pretrained loads: sharded safetensors + config, generation config, tokenizer"

    def resolve(self, root: Path, request: Request) -> Format:
        peft = by_name("peft")
        if request.base is not None:  # a PEFT run merged into the base model it started from
            return by_name("merged")
        if request.config is None and peft.claims(root):  # a PEFT run: its adapter is the model to export
            return peft
        return self

    def prepare(self, ckpt, plan, request: Request) -> Prepared:
        companions = find_companions(ckpt.layout.root, request.config, request.trust)  # no config: refused now
        _refuse_adapter_only(plan, ckpt.layout.root)
        check_config_fits(companions.config, {t.name: t.shape for t in plan.tensors}, plan.aliases)
        if plan.aliases and not ties_embeddings(companions):
            plan = duplicate_aliases(plan)  # the config unties the head: transformers wants both names stored
        return Prepared(self, plan, request, companions)

    def write(self, prepared: Prepared, folder: Path, context: WriteContext) -> list[str]:
        from ..io.safetensors_writer import write_sharded

        plan = prepared.plan
        dtypes = {t.dtype for t in plan.tensors if t.kind != "buffer"} or {"F32"}
        names = write_sharded(plan, folder, prepared.request.max_shard_bytes, context)
        return names + [INDEX_NAME] + write_companions(prepared.companions, folder,
                                                       dtypes.pop() if len(dtypes) == 1 else "F32")

    def read(self, path: Path) -> Listing:
        return read_sharded(path)

    def reads(self, path: Path) -> bool:
        return False  # an HF folder reads as sharded

    def replaced_files(self, out: Path) -> tuple[str, ...]:
        return replaced_shards(out)


register(HuggingFaceFormat())
