"""A compressed context as one file: everything a session needs to go on after ``prefill``, in safetensors.

The tensors are the context's token ids and 2-D mask (``context.*``), each cache layer's as the layer saves itself
(``layers.<i>.*``: keys, values and, for a compressed layer, every slot's eviction state, ``CompressedLayer.saved``)
and the budget plan's per-sequence areas and windows (``plan.*``). The safetensors header's metadata (strings,
JSON where structured) holds the rest: ``format`` and ``format_version``, the ``kvcompress_version`` that wrote it,
the ``model`` (``fingerprint.model_identity``: architecture, configuration, weights' checksum), the ``dtype`` of the
keys and values, the ``recipe`` the session was made from (a method, budget and overrides, or the parameters),
the ``plan``'s facts (parameters in force, a fraction's last resolution), each layer's ``layers`` facts with its
KV bytes, the ``document`` prompt of a context given as text, the ``encodings`` of compacted state tensors, a
``summary`` (tokens, bytes) for listings, and ``checksum``: SHA-256 over every other metadata entry and every
tensor's name, dtype, shape and bytes, which ``load`` verifies before it builds anything.

Per-slot state is stored compactly and exactly, so the file stays close to the kept KV bytes: a tensor whose
elements are all equal (KVzip's unused counters, an all-live layout) is one value in ``encodings``; RoPE positions
equal to the true positions (no rerotation) are stored once; integers take the narrowest type that holds them.
Loading memory-maps the file: keys and values are read-only-until-written views of it (copy on write), so loading
a context costs about its own size in memory and no copy; the state's buffers are rebuilt with their spare room.

A file is written aside and renamed into place (on a local disk), or written in one request (an fsspec URL, whose
object appears whole), so a reader finds the previous file or the new one, never a part. No pickle: loading an
untrusted file runs no code; a damaged, truncated or foreign file is refused with the file's name and what differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save, save_file
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from .fingerprint import identity_differences, model_identity
from .layer import CompressedLayer

if TYPE_CHECKING:
    from .session import CompressionSession

FORMAT = "kvcompress.context"
FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ContextFileError(ValueError):
    """A stored context that cannot be loaded: damaged, truncated, of another format version, model or dtype."""


# ---------------------------------------------------------------------------------------------------- saving
def save_context(session: CompressionSession, target: str | os.PathLike) -> dict[str, Any]:
    """Write ``session``'s prefilled context to ``target`` (a path or an fsspec URL), whole or not at all;
    returns the file's summary (tokens, bytes)."""
    tensors, metadata = context_contents(session)
    write_atomically(tensors, metadata, str(target))
    return json.loads(metadata["summary"])


def context_contents(session: CompressionSession) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of ``session``'s context file (checksum included)."""
    from . import __version__
    from .cache import full_cache_bytes, kv_cache_bytes, layer_kv_bytes

    cache, mask, ids = session.context
    tensors: dict[str, torch.Tensor] = {"context.ids": ids, "context.mask": mask}
    layers = []
    for index, layer in enumerate(cache.layers):
        layer_tensors, facts = _layer_contents(layer, index)
        tensors.update({f"layers.{index}.{name}": tensor for name, tensor in layer_tensors.items()})
        layers.append({**facts, "kv_bytes": layer_kv_bytes(layer)})
    plan_tensors, plan_facts = session.budget.saved()
    tensors.update({f"plan.{name}": tensor for name, tensor in plan_tensors.items()})
    tensors, encodings = _encoded({name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()})
    document = session.document
    metadata = {
        "format": FORMAT, "format_version": str(FORMAT_VERSION), "kvcompress_version": __version__,
        "model": _json({**model_identity(session.model), "name_or_path": getattr(session.model, "name_or_path", "")}),
        "dtype": str(next(layer.keys.dtype for layer in cache.layers if layer.keys is not None)).removeprefix("torch."),
        "recipe": _json(session.recipe, "the session's compression options"),
        "plan": _json(plan_facts), "layers": _json(layers), "encodings": _json(encodings),
        "document": _json(None if document is None else vars(document)),
        "summary": _json({"tokens": cache.get_seq_length(), "batch": int(ids.shape[0]),
                          "kv_bytes": kv_cache_bytes(cache), "full_kv_bytes": full_cache_bytes(cache, ids.shape[-1]),
                          "method": session.parameters.method}),
    }
    metadata["checksum"] = _checksum(tensors, metadata)
    return tensors, metadata


def _layer_contents(layer: Any, index: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if isinstance(layer, CompressedLayer):
        tensors, facts = layer.saved()
        return tensors, {"kind": "compressed", **facts}
    if isinstance(layer, DynamicSlidingWindowLayer):
        return {"keys": layer.keys, "values": layer.values}, {"kind": "sliding",
                                                                "cumulative_length": layer.cumulative_length}
    raise ValueError(f"kvcompress: cannot store cache layer {index}, a {type(layer).__name__}")


def _json(value: Any, what: str = "") -> str:
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"kvcompress: {what or 'a context field'} cannot be stored as JSON ({error}): "
                         f"{value!r}") from None


def _encoded(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The tensors to write and how to decode the compacted ones: keys and values as they are; a state tensor
    whose elements are all equal as its value, rope positions equal to the true ones as a reference, integers in
    the narrowest type that holds them."""
    stored, encodings = {}, {}
    for name, tensor in tensors.items():
        if name.endswith((".keys", ".values")) or tensor.numel() == 0:
            stored[name] = tensor
            continue
        dtype = str(tensor.dtype).removeprefix("torch.")
        first = tensor.reshape(-1)[0]
        if bool((tensor == first).all()):
            encodings[name] = {"fill": first.item(), "shape": list(tensor.shape), "dtype": dtype}
            continue
        same = name.replace("rope_positions", "true_positions")
        if same != name and torch.equal(tensor, tensors[same]):
            encodings[name] = {"same_as": same}
            continue
        if not tensor.is_floating_point() and tensor.dtype != torch.bool:
            low, high = int(tensor.min()), int(tensor.max())
            narrow = next(kind for kind in (torch.uint8, torch.int16, torch.int32, tensor.dtype)
                          if torch.iinfo(kind).min <= low and high <= torch.iinfo(kind).max)
            if narrow != tensor.dtype:
                encodings[name] = {"dtype": dtype}
                tensor = tensor.to(narrow)
        stored[name] = tensor
    return stored, encodings


def _decoded(tensors: dict[str, torch.Tensor], encodings: dict[str, dict[str, Any]],
             prefix: str) -> dict[str, torch.Tensor]:
    """The tensors named ``prefix``<name> as they were before ``_encoded``, by their short names: decoded one group
    (a layer) at a time, so that a load holds one layer's decoded copies at once beside the mapped file."""
    decoded = {}
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            encoding = encodings.get(name, {})
            decoded[name[len(prefix):]] = tensor.to(getattr(torch, encoding["dtype"])) if encoding else tensor
    for name, encoding in encodings.items():
        if name.startswith(prefix) and "fill" in encoding:
            decoded[name[len(prefix):]] = torch.full(encoding["shape"], encoding["fill"],
                                                     dtype=getattr(torch, encoding["dtype"]))
    for name, encoding in encodings.items():
        if name.startswith(prefix) and "same_as" in encoding:
            decoded[name[len(prefix):]] = decoded[encoding["same_as"][len(prefix):]].clone()
    return decoded


def _checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({key: value for key, value in metadata.items() if key != "checksum"},
                             sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def write_atomically(tensors: dict[str, torch.Tensor], metadata: dict[str, str], target: str) -> None:
    """Write a safetensors file so that ``target`` is the previous file or the whole new one, never a part."""
    filesystem, path = _filesystem(target)
    if filesystem is None:  # a local path: written aside in the same folder, flushed, then renamed over
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
        try:
            save_file(tensors, aside, metadata=metadata)
            os.chmod(aside, 0o666 & ~_umask())  # readable as any new file is: a store is shared
            with open(aside, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(aside, path)
        finally:
            aside.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the rename itself made durable where the platform allows
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        return
    filesystem.makedirs(filesystem._parent(path), exist_ok=True)
    filesystem.pipe_file(path, save(tensors, metadata=metadata))  # one request: the object appears whole


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _filesystem(target: str):
    """(None, path) for a local path or ``file://`` URL, else (the fsspec filesystem, its path)."""
    if "://" not in target:
        return None, target
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    filesystem, path = fsspec.core.url_to_fs(target)
    return (None, path) if isinstance(filesystem, LocalFileSystem) else (filesystem, path)


# ---------------------------------------------------------------------------------------------------- loading
def read_metadata(source: str | os.PathLike) -> dict[str, str]:
    """The header's metadata of a context file, without reading its tensors (listings)."""
    with _local(str(source)) as path, _opened(path, str(source)) as handle:
        return _checked_format(handle.metadata() or {}, str(source))


def read_context(source: str | os.PathLike) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A context file's metadata and tensors (memory-mapped, as stored), its format and checksum verified."""
    name = str(source)
    with _local(name) as path, _opened(path, name) as handle:
        metadata = _checked_format(handle.metadata() or {}, name)
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    if _checksum(tensors, metadata) != metadata.get("checksum"):
        raise ContextFileError(f"{name}: the checksum does not match its contents: the file is damaged (a changed "
                               "or missing byte); compress the context again")
    return metadata, tensors


def load_context(model: nn.Module, source: str | os.PathLike, tokenizer: Any = None,
                 device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> CompressionSession:
    """A session in the state of the one that saved ``source`` (a path or an fsspec URL) for ``model``: enter it
    and ask (``generate``, ``ask``), go on with a plain ``generate`` (``context_ids``, ``context_cache``), or chat
    on. ``device``: where the cache goes (default: the model's); ``dtype``: converts the keys and values to it
    (default: they must be in the model's dtype already). The model is not touched."""
    name = str(source)
    metadata, tensors = read_context(name)
    try:
        saved_model, layers, plan, recipe = (json.loads(metadata[key]) for key in ("model", "layers", "plan", "recipe"))
        encodings, document = json.loads(metadata["encodings"]), json.loads(metadata["document"])
        saved_dtype = DTYPES[metadata["dtype"]]
    except (KeyError, ValueError) as error:
        raise ContextFileError(f"{name}: a metadata entry is missing or unreadable ({error})") from None
    differences = identity_differences(saved_model, model_identity(model))
    if differences:
        raise ContextFileError(f"{name} was compressed with another model ({saved_model.get('name_or_path') or '?'}): "
                               + "; ".join(differences))
    model_dtype = next(model.parameters()).dtype
    target_dtype = dtype or model_dtype
    if dtype is None and saved_dtype != model_dtype:
        raise ContextFileError(f"{name} holds {metadata['dtype']} keys and values, the model runs in "
                               f"{str(model_dtype).removeprefix('torch.')}: load the model in "
                               f"{metadata['dtype']}, or pass dtype={model_dtype} to convert them")
    if target_dtype != model_dtype:
        raise ContextFileError(f"dtype={target_dtype} differs from the model's {model_dtype}: the cache must be in "
                               "the model's dtype")
    device = torch.device(device) if device is not None else model.device
    cache = DynamicCache(config=model.config)
    if len(cache.layers) != len(layers):
        raise ContextFileError(f"{name} holds {len(layers)} layers, the model's cache {len(cache.layers)}")
    for index, facts in enumerate(layers):
        layer_tensors = {key: _placed(tensor, device, target_dtype, key)
                         for key, tensor in _decoded(tensors, encodings, f"layers.{index}.").items()}
        cache.layers[index] = _restored_layer(cache.layers[index], layer_tensors, facts)
    from .compressor import session_from_recipe

    session = session_from_recipe(model, recipe, tokenizer)
    session.budget.restore({key: tensor.to(device) for key, tensor in _decoded(tensors, encodings, "plan.").items()},
                           plan)
    context = {key: tensor.to(device) for key, tensor in _decoded(tensors, encodings, "context.").items()}
    session.adopt_context(cache, context["mask"], context["ids"], document)
    return session


def _placed(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, name: str) -> torch.Tensor:
    if name in ("keys", "values"):
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device)


def _restored_layer(empty: Any, tensors: dict[str, torch.Tensor], facts: dict[str, Any]) -> Any:
    if facts["kind"] == "compressed":
        return CompressedLayer.from_saved(tensors, facts)
    empty.lazy_initialization(tensors["keys"], tensors["values"])
    empty.keys, empty.values = tensors["keys"], tensors["values"]
    empty.cumulative_length = int(facts["cumulative_length"])
    return empty


def _checked_format(metadata: dict[str, str], name: str) -> dict[str, str]:
    if metadata.get("format") != FORMAT:
        raise ContextFileError(f"{name} is not a kvcompress context file (a safetensors file without its metadata)")
    version = metadata.get("format_version", "?")
    if not version.isdigit() or int(version) > FORMAT_VERSION:
        raise ContextFileError(
            f"{name} has context format version {version}, written by kvcompress "
            f"{metadata.get('kvcompress_version', '?')}; this kvcompress reads versions up to {FORMAT_VERSION}: "
            "upgrade kvcompress to load it")
    return metadata


@contextlib.contextmanager
def _opened(path: str, name: str) -> Iterator[Any]:
    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            yield handle
    except FileNotFoundError:
        raise ContextFileError(f"{name}: no such context file") from None
    except (SafetensorError, OSError, ValueError) as error:
        if isinstance(error, ContextFileError):
            raise
        raise ContextFileError(f"{name} is not a readable context file (truncated or damaged): {error}") from None


@contextlib.contextmanager
def _local(source: str) -> Iterator[str]:
    """A local path of ``source``: itself, or a copy of a remote object for as long as it is read (the tensors
    memory-mapped from the copy stay valid after it is removed)."""
    filesystem, path = _filesystem(source)
    if filesystem is None:
        yield path
        return
    if not filesystem.exists(path):
        raise ContextFileError(f"{source}: no such context file")
    with tempfile.TemporaryDirectory(prefix="kvcompress-") as folder:
        local = os.path.join(folder, "context.safetensors")
        filesystem.get_file(path, local)
        yield local
