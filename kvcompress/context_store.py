"""A store of compressed contexts, shared by processes and machines: compress a document once, answer from it anywhere.

``ContextStore(root)`` keeps one context file per entry (``context_file``) under ``root``, a folder or any fsspec URL
(``file://``, ``memory://``, ``s3://`` where s3fs is installed). An entry's key is a hash of what determines the
compressed cache: the model's identity (``fingerprint``), its dtype, the compression recipe, the chunk size and the
context's token ids; ``get_or_compress`` compresses only when the key is missing. Entries appear whole or not at all
(a file is written aside and renamed, or sent in one request), so processes that add the same key at once leave one
readable entry, and a reader never sees a part. Each entry has a small ``<key>.used`` note of when it was last
used, so that ``max_bytes`` removes the least recently used entries first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import warnings
from typing import Any

import torch
from torch import nn

from .compressor import compress
from .context_file import ContextFileError, load_context, read_metadata
from .fingerprint import model_identity
from .session import CompressionSession

ENTRY_SUFFIX = ".safetensors"
USED_SUFFIX = ".used"
PARTIAL_SUFFIX = ".partial"  # a file being written aside (context_file.write_atomically)
STALE_PARTIAL_SECONDS = 3600.0


@dataclasses.dataclass(frozen=True)
class StoredContext:
    """One entry of a store, as ``ContextStore.list`` describes it."""

    key: str
    file_bytes: int
    last_used: float  # seconds since the epoch
    tokens: int
    kv_bytes: int
    method: str
    model: str


class ContextStore:
    """Compressed contexts under ``root`` (a folder or an fsspec URL), at most ``max_bytes`` of files in all (None:
    no limit; the least recently used entries go first, never the one just added)."""

    def __init__(self, root: str, max_bytes: int | None = None):
        import fsspec

        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive integer or None, got {max_bytes!r}")
        self.url = str(root)
        self.filesystem, self.root = fsspec.core.url_to_fs(self.url)
        self.filesystem.makedirs(self.root, exist_ok=True)
        self.max_bytes = max_bytes

    def __repr__(self) -> str:
        return f"ContextStore({self.url!r}, max_bytes={self.max_bytes})"

    # ------------------------------------------------------------------ keys and entries
    def key_for(self, model: nn.Module, context_ids: torch.Tensor, method: str = "kvzip",
                budget: int | float | str = 0.2, chunk_size: int | None = None, document: bool = False,
                **overrides: Any) -> str:
        """The key of ``context_ids`` (B, T) compressed by ``method`` at ``budget`` with ``overrides`` for
        ``model`` (``document``: given as text, so that ``ask`` works on it)."""
        from .budget import parse_budget

        described = {"model": model_identity(model), "dtype": str(next(model.parameters()).dtype),
                     "method": method, "budget": parse_budget(budget), "overrides": overrides,
                     "chunk_size": chunk_size, "document": document, "ids": context_ids.tolist()}
        return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]

    def path(self, key: str) -> str:
        """Where the entry ``key`` is (or would be), as a URL ``kvcompress.load`` reads."""
        return self._url(self._entry(key))

    def __contains__(self, key: str) -> bool:
        return self.filesystem.exists(self._entry(key))

    def get_or_compress(self, model: nn.Module, context: torch.Tensor | str, method: str = "kvzip",
                        budget: int | float | str = 0.2, tokenizer: Any = None, chunk_size: int | None = None,
                        **overrides: Any) -> CompressionSession:
        """A session holding ``context`` (token ids (B, T), or a document as text, rendered in the chat template
        by ``tokenizer`` so that ``session.ask`` works) compressed by ``method`` at ``budget``, loaded from the
        store: compressed and added to it first where it is missing (or damaged), so that every caller gets what
        any later process will. Enter it to ask (``with session: session.ask(...)``)."""
        ids, document = self._context_ids(context, tokenizer, model)
        key = self.key_for(model, ids, method, budget, chunk_size, document is not None, **overrides)
        if key in self:
            try:
                return self.load(model, key, tokenizer)
            except ContextFileError as error:  # a damaged entry is a miss: compressed again and replaced
                warnings.warn(f"kvcompress: {error}; compressing again", RuntimeWarning, stacklevel=2)
        session = compress(model, method, budget, tokenizer, **overrides)
        with session:
            if document is None:
                session.prefill(ids, chunk_size=chunk_size)
            else:
                session.prefill_text(document, chunk_size=chunk_size)
        session.save(self.path(key))
        self._keep_within_limit(key)
        return self.load(model, key, tokenizer)

    def load(self, model: nn.Module, key: str, tokenizer: Any = None, device: str | torch.device | None = None,
             dtype: torch.dtype | None = None) -> CompressionSession:
        """The session of entry ``key`` (``kvcompress.load`` of its file), marked as used now."""
        if key not in self:
            raise KeyError(f"no context {key!r} in {self.url}")
        session = load_context(model, self.path(key), tokenizer, device, dtype)
        self._mark_used(key)
        return session

    def list(self) -> list[StoredContext]:
        """Every entry, the most recently used first."""
        entries = []
        for info in self.filesystem.ls(self.root, detail=True):
            name = info["name"].rsplit("/", 1)[-1]
            if name.endswith(PARTIAL_SUFFIX) and _age(info) > STALE_PARTIAL_SECONDS:  # a writer killed mid-write
                self.filesystem.rm(info["name"])
            if not name.endswith(ENTRY_SUFFIX) or name.startswith("."):
                continue
            key = name[: -len(ENTRY_SUFFIX)]
            try:
                metadata = read_metadata(self._url(info["name"]))
                summary, model = json.loads(metadata["summary"]), json.loads(metadata["model"])["name_or_path"]
            except (ContextFileError, KeyError, ValueError):
                continue
            entries.append(StoredContext(key, int(info["size"]), self._last_used(key), summary["tokens"],
                                         summary["kv_bytes"], summary["method"], model))
        return sorted(entries, key=lambda entry: entry.last_used, reverse=True)

    def delete(self, key: str) -> None:
        """Remove entry ``key`` (KeyError if absent)."""
        if key not in self:
            raise KeyError(f"no context {key!r} in {self.url}")
        self.filesystem.rm(self._entry(key))
        if self.filesystem.exists(self._used(key)):
            self.filesystem.rm(self._used(key))

    # ------------------------------------------------------------------ helpers
    def _context_ids(self, context: torch.Tensor | str, tokenizer: Any, model: nn.Module):
        if isinstance(context, str):
            if tokenizer is None:
                raise ValueError("tokenizer: a context given as text needs the model's tokenizer")
            from .chat import document_prompt

            ids = document_prompt(tokenizer, context).head_ids(tokenizer)
            return torch.tensor([ids], device=model.device), context
        if not isinstance(context, torch.Tensor) or context.dim() != 2:
            raise ValueError("context must be token ids (batch, tokens) or a document as text, got "
                             f"{type(context).__name__}")
        return context, None

    def _entry(self, key: str) -> str:
        if not key or any(character not in "0123456789abcdef" for character in key):
            raise ValueError(f"key must be a context key (hexadecimal, from ContextStore.key_for), got {key!r}")
        return f"{self.root.rstrip('/')}/{key}{ENTRY_SUFFIX}"

    def _used(self, key: str) -> str:
        return f"{self.root.rstrip('/')}/{key}{USED_SUFFIX}"

    def _url(self, path: str) -> str:
        protocol = self.filesystem.protocol
        protocol = protocol[0] if isinstance(protocol, tuple) else protocol
        return path if protocol in ("file", "local") else f"{protocol}://{path.removeprefix(protocol + '://')}"

    def _mark_used(self, key: str) -> None:
        self.filesystem.pipe_file(self._used(key), repr(time.time()).encode())

    def _last_used(self, key: str) -> float:
        try:
            return float(self.filesystem.cat_file(self._used(key)))
        except (OSError, ValueError):
            return 0.0

    def _keep_within_limit(self, newest: str) -> None:
        """Remove the least recently used entries but ``newest`` until the files fit ``max_bytes``."""
        if self.max_bytes is None:
            return
        entries = self.list()
        total = sum(entry.file_bytes for entry in entries)
        for entry in sorted(entries, key=lambda entry: entry.last_used):
            if total <= self.max_bytes:
                break
            if entry.key != newest:
                self.delete(entry.key)
                total -= entry.file_bytes


def _age(info: dict[str, Any]) -> float:
    """Seconds since a listed file was last modified (0 where the filesystem does not say)."""
    modified = info.get("mtime", info.get("LastModified", info.get("created")))
    if hasattr(modified, "timestamp"):
        modified = modified.timestamp()
    return time.time() - float(modified) if modified is not None else 0.0
