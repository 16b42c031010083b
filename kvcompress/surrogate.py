"""KVzap's learned surrogates: per compressed layer, a linear map (or a two-layer MLP with a GELU between, as in
KVzap's paper) from the layer's input hidden states to one log-score per KV head, predicting what KVzip's
reconstruction would give each token (arXiv 2601.07891).

A ``Surrogate`` is small next to its model (a linear map per layer, or an MLP a few dozen units wide), so trained
ones ship inside the package (``kvcompress/data/kvzap/``: ``<model>``, the default, and variants such as
``<model>-mlp``) and others are files the user trains
(``kvcompress-train-scorer``). Weights only make sense for the model they were fitted to: each file records the
model's fingerprint (its architecture's dimensions and the output projections of its first and last compressed
layers, rounded to bfloat16 so that the same model loaded in float32 or bfloat16 matches) and a checksum of its own
tensors; a file whose checksum fails, or whose fingerprint is not the model's, is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .adapters import inspect_model, text_config, value_projection_weight

SHIPPED = Path(__file__).parent / "data" / "kvzap"  # the embedded models' trained surrogates: <model>.safetensors
FORMAT = "kvcompress-kvzap-1"


class SurrogateMismatchError(ValueError):
    """Surrogate weights that do not belong to the model (or a damaged file)."""


@dataclasses.dataclass
class Surrogate:
    """Per compressed layer: ``weights[layer]`` (H_kv, D) and ``biases[layer]`` (H_kv,), float32; an MLP has
    ``hidden_weights[layer]`` (M, D) and ``hidden_biases[layer]`` (M,) before them, and then ``weights`` is
    (H_kv, M)."""

    model_name: str
    fingerprint: str
    weights: dict[int, torch.Tensor]
    biases: dict[int, torch.Tensor]
    fit: dict[str, object] = dataclasses.field(default_factory=dict)  # how it was trained (corpus, correlation)
    hidden_weights: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # empty for a linear map
    hidden_biases: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    checksum: str = ""  # of the tensors as read from a file: what names a set of weights in a results record

    @property
    def kind(self) -> str:
        return "mlp" if self.hidden_weights else "linear"

    def scores(self, layer: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """Predicted log-scores (B, H_kv, q) of the tokens whose layer-input hidden states are (B, q, D)."""
        if self.weights[layer].device != hidden_states.device:  # moved once per device, then kept
            for name in ("weights", "biases", "hidden_weights", "hidden_biases"):
                setattr(self, name, {index: tensor.to(hidden_states.device)
                                     for index, tensor in getattr(self, name).items()})
        features = hidden_states.reshape(-1, hidden_states.shape[-1]).float()
        if self.hidden_weights:
            features = nn.functional.gelu(torch.addmm(self.hidden_biases[layer], features,
                                                      self.hidden_weights[layer].t()))
        return torch.addmm(self.biases[layer], features, self.weights[layer].t()).view(
            hidden_states.shape[0], hidden_states.shape[1], -1).transpose(1, 2)

    def save(self, path: str | Path) -> Path:
        """Write the weights with the model's name and fingerprint and a checksum of the tensors."""
        tensors = {}
        for layer in sorted(self.weights):
            tensors[f"{layer}.weight"] = self.weights[layer].detach().float().cpu().contiguous()
            tensors[f"{layer}.bias"] = self.biases[layer].detach().float().cpu().contiguous()
            if self.hidden_weights:
                tensors[f"{layer}.hidden.weight"] = self.hidden_weights[layer].detach().float().cpu().contiguous()
                tensors[f"{layer}.hidden.bias"] = self.hidden_biases[layer].detach().float().cpu().contiguous()
        metadata = {"format": FORMAT, "model_name": self.model_name, "fingerprint": self.fingerprint,
                    "checksum": _checksum(tensors), "fit": json.dumps(self.fit, sort_keys=True)}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=metadata)
        return path

    def check_model(self, model: nn.Module) -> None:
        """Refuse weights fitted to another model."""
        found = model_fingerprint(model)
        if found != self.fingerprint:
            raise SurrogateMismatchError(
                f"the KVzap weights were trained for {self.model_name!r} (fingerprint {self.fingerprint[:12]}), "
                f"not for this {type(model).__name__} (fingerprint {found[:12]}); train weights for it with "
                "kvcompress-train-scorer and pass scorer_options={'weights': path}"
            )


def load(path: str | Path) -> Surrogate:
    """Read a surrogate file, refusing one that is not a surrogate or whose tensors fail their checksum."""
    path = Path(path)
    return _load(str(path.resolve()), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(path: str, modified: int) -> Surrogate:  # keyed by modification time: a retrained file is read again
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise SurrogateMismatchError(
                f"{path} is not a kvcompress KVzap surrogate (format {metadata.get('format')!r})")
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    if _checksum(tensors) != metadata["checksum"]:
        raise SurrogateMismatchError(f"{path}: the tensors do not match their recorded checksum (damaged file)")
    layers = sorted({int(name.split(".")[0]) for name in tensors})
    return Surrogate(
        model_name=metadata["model_name"], fingerprint=metadata["fingerprint"],
        weights={layer: tensors[f"{layer}.weight"] for layer in layers},
        biases={layer: tensors[f"{layer}.bias"] for layer in layers}, fit=json.loads(metadata.get("fit", "{}")),
        hidden_weights={layer: tensors[f"{layer}.hidden.weight"] for layer in layers
                        if f"{layer}.hidden.weight" in tensors},
        hidden_biases={layer: tensors[f"{layer}.hidden.bias"] for layer in layers if f"{layer}.hidden.bias" in tensors},
        checksum=metadata["checksum"],
    )


def for_model(model: nn.Module, weights: str = "") -> Surrogate:
    """The surrogate ``weights`` names for ``model``: a file path, the name of a shipped file (``<model>`` or a
    variant such as ``<model>-mlp``), or ``""``: the shipped file named after the model whose fingerprint is this
    model's."""
    if weights:
        candidate = Path(weights)
        is_file = candidate.suffix == ".safetensors" or candidate.exists()
        path = candidate if is_file else SHIPPED / f"{weights}.safetensors"
        if not path.exists():
            raise ValueError(
                f"scorer_options['weights'] must be a surrogate file or one of the shipped ones "
                f"({', '.join(shipped_names()) or 'none'}), got {weights!r}"
            )
        surrogate = load(path)
        surrogate.check_model(model)
        return surrogate
    found = model_fingerprint(model)
    for path in sorted(SHIPPED.glob("*.safetensors")):
        surrogate = load(path)
        if surrogate.fingerprint == found and path.stem == surrogate.model_name:
            return surrogate
    raise ValueError(
        f"method='kvzap' has no shipped weights for this {type(model).__name__} (shipped: "
        f"{', '.join(shipped_names()) or 'none'}); train them with `kvcompress-train-scorer --out DIR` (or "
        "kvcompress.train_scorer.train_surrogate) and pass scorer_options={'weights': path}"
    )


def random_surrogate(model: nn.Module, seed: int = 0, name: str = "random",
                     hidden_size: int | None = None) -> Surrogate:
    """Weights with ``model``'s fingerprint and random values, linear or an MLP ``hidden_size`` wide: what speed
    measurements (the cost does not depend on the values) and mechanics tests use for models nobody trained a
    surrogate for."""
    config = text_config(model)
    generator = torch.Generator().manual_seed(seed)
    layers = inspect_model(model).compressed_layers
    kv_heads, width = config.num_key_value_heads, config.hidden_size
    hidden_weights, hidden_biases = {}, {}
    if hidden_size is not None:
        hidden_weights = {layer: torch.randn(hidden_size, width, generator=generator) / width**0.5 for layer in layers}
        hidden_biases = {layer: torch.randn(hidden_size, generator=generator) for layer in layers}
        width = hidden_size
    return Surrogate(
        model_name=name, fingerprint=model_fingerprint(model),
        weights={layer: torch.randn(kv_heads, width, generator=generator) / width**0.5 for layer in layers},
        biases={layer: torch.randn(kv_heads, generator=generator) for layer in layers},
        hidden_weights=hidden_weights, hidden_biases=hidden_biases,
    )


def shipped_names() -> list[str]:
    return sorted(path.stem for path in SHIPPED.glob("*.safetensors"))


# model -> (the hashed tensors' storage and in-place version counters, the fingerprint)
_FINGERPRINTS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


def model_fingerprint(model: nn.Module) -> str:
    """What identifies a model's weights cheaply: its dimensions and the output projections of its first and last
    compressed layers, in bfloat16 (the same for a float32 and a bfloat16 load of one checkpoint).

    Kept per model until those tensors are replaced or written in place (``load_state_dict`` bumps their version):
    a session binds its scorer again for every prompt whose budget follows its length, and hashing an 8B model's
    projections (copied off a GPU) would cost each of them a noticeable share of its prefill."""
    layout = inspect_model(model)
    weights = [value_projection_weight(layout.attention_modules[index]).detach()
               for index in sorted({*layout.compressed_layers[:1], *layout.compressed_layers[-1:]})]
    key = tuple((weight.data_ptr(), weight._version) for weight in weights)
    cached = _FINGERPRINTS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    config = text_config(model)
    digest = hashlib.sha256()
    dimensions = [getattr(config, name, None) for name in
                  ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")]
    digest.update(json.dumps(dimensions).encode())
    for weight in weights:
        digest.update(weight.to(device="cpu", dtype=torch.bfloat16).view(torch.int16).numpy().tobytes())
    fingerprint = digest.hexdigest()
    _FINGERPRINTS[model] = key, fingerprint
    return fingerprint


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].float().contiguous().view(torch.int32).numpy().tobytes())
    return digest.hexdigest()
