"""The built-in formats: safetensors, sharded safetensors (Hugging Face layout) and torch .pt/.bin."""
from __future__ import annotations

from pathlib import Path

from ..errors import CorruptFileError
from ..formats.safetensors_file import check_shard_names, read_header, read_index
from .formats import Format, Listing, Stored, register

INDEX_NAME = "model.safetensors.index.json"


def _write_safetensors(plan, path: Path, options: dict, progress) -> list[str]:
    from .writer import write_safetensors

    write_safetensors(list(plan.tensors), path, plan.metadata, progress)
    return [path.name]


def _read_safetensors(path: Path) -> Listing:
    header, start = read_header(path)
    tensors = [Stored(name, info["dtype"], tuple(info["shape"]), path, start + info["data_offsets"][0])
               for name, info in header.items() if name != "__metadata__"]
    return Listing(tensors, dict(header.get("__metadata__", {})), [path])


def _write_sharded(plan, folder: Path, options: dict, progress) -> list[str]:
    from .writer import write_sharded

    return write_sharded(plan, folder, options["max_shard_bytes"], progress) + [INDEX_NAME]


def _write_hf(plan, folder: Path, options: dict, progress) -> list[str]:
    """A folder ``from_pretrained`` loads: sharded safetensors + config, generation config, tokenizer."""
    from ..formats.hf import write_companions
    from .writer import write_sharded

    dtypes = {t.dtype for t in plan.tensors if t.kind != "buffer"} or {"F32"}
    names = write_sharded(plan, folder, options["max_shard_bytes"], progress)
    return names + [INDEX_NAME] + write_companions(options["hf_companions"], folder,
                                                   dtypes.pop() if len(dtypes) == 1 else "F32")


def _write_peft(plan, folder: Path, options: dict, progress) -> list[str]:
    """A folder ``PeftModel.from_pretrained`` loads: adapter_model.safetensors + adapter_config.json (+ tokenizer)."""
    import shutil

    from ..formats.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from .writer import write_safetensors

    write_safetensors(list(plan.tensors), folder / ADAPTER_WEIGHTS, plan.metadata, progress)
    shutil.copyfile(options["adapter_config"], folder / ADAPTER_CONFIG)
    for path in options["hf_companions"].others:
        shutil.copyfile(path, folder / path.name)
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG] + [p.name for p in options["hf_companions"].others]


def _read_peft(path: Path) -> Listing:
    from ..formats.peft import ADAPTER_WEIGHTS

    return _read_safetensors(path / ADAPTER_WEIGHTS if path.is_dir() else path)


def _read_sharded(path: Path) -> Listing:
    index = path if path.is_file() else next(path.glob("*.index.json"), None)
    if index is None:
        raise CorruptFileError(f"{path}: folder holds no *.index.json")
    metadata, weight_map = read_index(index)
    tensors, files = [], []
    for shard in sorted(set(weight_map.values())):
        listing = _read_safetensors(index.parent / shard)
        check_shard_names(index, weight_map, shard, [t.name for t in listing.tensors])
        tensors += listing.tensors
        files.append(index.parent / shard)
        metadata = {**listing.metadata, **{k: str(v) for k, v in metadata.items()}}
    return Listing(tensors, metadata, files)


def _write_torch(plan, path: Path, options: dict, progress) -> list[str]:
    from .torch_writer import write_torch

    write_torch(plan, path, progress)
    return [path.name]


def _write_lightning(plan, path: Path, options: dict, progress) -> list[str]:
    """One .ckpt: Lightning's checkpoint dict from the client state, plus ``state_dict``."""
    from collections import OrderedDict

    from ..formats.lightning import checkpoint_tree
    from ..formats.pickle_policy import TensorRef
    from ..formats.pickle_writer import NewTensor
    from .torch_writer import write_archive
    from .writer import SourceFiles, iter_tensor_chunks

    tensors = {t.name: NewTensor(t.dtype, t.shape, t) for t in plan.tensors}
    state = OrderedDict(tensors)
    for alias, src in plan.aliases.items():
        state[alias] = tensors[src]
    tree, _ = checkpoint_tree(state, options.get("client_state") or {})

    def chunks(storage):
        if isinstance(storage.source, TensorRef):  # a client-state tensor, copied as stored
            loc = storage.source.file.locate(storage.source.storage)
            yield src.pread(storage.source.file.path, loc.nbytes, loc.offset)
        else:
            yield from iter_tensor_chunks(src, storage.source.source)

    with SourceFiles() as src:
        write_archive(path, tree, chunks, progress)
    return [path.name]


def _read_torch(path: Path) -> Listing:
    """A state dict, or a training checkpoint's ``state_dict`` entry (Lightning), via dsckpt's reader."""
    from ..formats.pickle_policy import TensorRef
    from ..formats.torchzip import TorchFile

    tf = TorchFile(path)
    obj, extra = tf.obj, {}
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        extra = {k: v for k, v in obj.items() if k != "state_dict"}
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise CorruptFileError(f"{path}: not a state dict")
    tensors = []
    for name, ref in obj.items():
        if isinstance(ref, TensorRef):
            loc = tf.locate(ref.storage)
            tensors.append(Stored(str(name), ref.dtype, ref.shape, path, loc.offset + ref.offset * ref.storage.itemsize,
                                  None if ref.is_contiguous() else ref.stride))
    return Listing(tensors, {}, [path], extra)


register(Format("safetensors", (".safetensors",), False, _write_safetensors, _read_safetensors))
register(Format("torch", (".pt", ".pth", ".bin"), False, _write_torch, _read_torch))
register(Format("sharded", ("",), True, _write_sharded, _read_sharded))
register(Format("hf", (), True, _write_hf, _read_sharded))  # chosen by name (consolidate --hf), never by suffix
register(Format("peft", (), True, _write_peft, _read_peft))  # --hf when adapter_config.json is beside the checkpoint
register(Format("lightning", (".ckpt",), False, _write_lightning, _read_torch, accepts=(".pt", ".pth")))
