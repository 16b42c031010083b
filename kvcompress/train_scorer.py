"""Training KVzap's surrogates (``kvcompress.surrogate``) for a model, on an ordinary CPU, from text every Python has.

For each context of the training corpus the model runs under KVzip: the prompt's forward records each compressed
layer's input hidden states, the reconstruction passes give each token its KVzip score per KV head, and the target
is the log of that score. Per layer a ridge regression (closed form, on standardised features) maps hidden states
to targets; its sums are accumulated context by context, so memory does not grow with the corpus. The MLP option
(``hidden_size``) keeps the training tokens' hidden states instead (in bfloat16) and fits each layer's two-layer
MLP with AdamW on mean squared error, with KVzap's own batch size, learning rate and epochs. A held-out part of the
corpus picks the ridge strength and reports the fit: the rank correlation (Spearman) between predicted and KVzip
scores, per layer, averaged over heads and contexts.

Each head's predictions are then stretched about their mean to the spread of KVzip's log-scores over the training
tokens (``_matched_spread``). A least-squares fit shrinks its predictions toward the mean by the share of the
variance it explains, so a head fitted less well predicts a narrower range: where heads and layers compete for one
budget (KVzap's shared and head-wise allocations) it would lose slots to better-fitted heads for that reason alone.
The stretch keeps every head's ranking, so the held-out correlation does not change.

The corpus is the Python language reference shipped with every CPython (``pydoc_data.topics``): offline wherever
Python runs, English prose with code, numbers and identifiers, and unrelated to the evaluation texts (RULER's
haystacks, LongBench), so no evaluation record leaks into the weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapters import inspect_model
from .compressor import KVCacheCompressor
from .parameters import KVCacheCompressionParameters
from .scoring.kvzip import KVzip
from .surrogate import Surrogate, model_fingerprint

SINKS = 4  # leading tokens left out of the fit: the start window always keeps them
SCORE_FLOOR = 1e-6  # KVzip scores below it are one target value (log of 0 is not a target)
RIDGE_STRENGTHS = (1e-3, 1e-2, 1e-1, 1.0)  # on standardised features; the held-out part picks one
CORPUS = "pydoc_data.topics (the Python language reference shipped with CPython)"
MLP_EPOCHS, MLP_BATCH, MLP_LEARNING_RATE = 15, 512, 5e-3  # KVzap's training script's defaults
MLP_WEIGHT_DECAY = 1e-2  # AdamW's default: the corpus is small for a network of this size


def corpus_texts() -> list[str]:
    """The training corpus: the language reference's topics, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def corpus_contexts(tokenizer: Any, context_tokens: int) -> list[list[int]]:
    """The corpus as consecutive contexts of ``context_tokens`` tokens (the last, shorter one dropped)."""
    ids: list[int] = []
    for text in corpus_texts():
        ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
    return [ids[start : start + context_tokens] for start in range(0, len(ids) - context_tokens + 1, context_tokens)]


class _RecordedKVzip(KVzip):
    """KVzip that keeps, per compressed layer, the prompt's input hidden states and the tokens' final scores."""

    reads_hidden_states = True

    def __init__(self, parameters):
        super().__init__(parameters)
        self.hidden: dict[int, torch.Tensor] = {}  # layer -> (T, D) float32
        self.scores: dict[int, torch.Tensor] = {}  # layer -> (H_kv, T) float32
        self._layer_of: dict[int, int] = {}  # id(layer state) -> layer

    def attend(self, call, state):
        if not call.replay:
            self.hidden[call.module.layer_idx] = call.hidden_states[0].float()
            self._layer_of[id(state)] = call.module.layer_idx
        return super().attend(call, state)

    def eviction_scores(self, state, keys, values, slot_valid):
        scores = super().eviction_scores(state, keys, values, slot_valid)
        self.scores[self._layer_of[id(state)]] = scores[0].float().clone()
        return scores


@torch.no_grad()
def kvzip_observations(model: nn.Module, tokenizer: Any,
                       ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per compressed layer: the context's input hidden states (T, D) and log KVzip scores (T, H_kv)."""
    parameters = KVCacheCompressionParameters(method="kvzip", start_size=SINKS, intermediate_size=8, recent_size=4)
    session = KVCacheCompressor(parameters, tokenizer=tokenizer)(model)
    recorder = session.scorer = _RecordedKVzip(parameters)  # the session's scorer, with the recording added
    with session:
        model(torch.tensor([ids], device=model.device), use_cache=True)
    return {layer: (recorder.hidden[layer], recorder.scores[layer].clamp(min=SCORE_FLOOR).log().t())
            for layer in recorder.scores}


class _RidgeSums:
    """The sums a ridge regression of targets (N, H) on features (N, D) needs, accumulated in float64."""

    def __init__(self, features: int, targets: int):
        self.count = 0
        self.x = torch.zeros(features, dtype=torch.float64)
        self.y = torch.zeros(targets, dtype=torch.float64)
        self.yy = torch.zeros(targets, dtype=torch.float64)
        self.xx = torch.zeros(features, features, dtype=torch.float64)
        self.xy = torch.zeros(features, targets, dtype=torch.float64)

    def add(self, features: torch.Tensor, targets: torch.Tensor) -> None:
        features, targets = features.double(), targets.double()
        self.count += features.shape[0]
        self.x += features.sum(0)
        self.y += targets.sum(0)
        self.yy += targets.square().sum(0)
        self.xx += features.t() @ features
        self.xy += features.t() @ targets

    def solve(self, strength: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights (H, D) and bias (H,) minimising squared error + ``strength`` · |standardised weights|², then
        stretched about the targets' mean to their spread (``_matched_spread``)."""
        mean_x, mean_y = self.x / self.count, self.y / self.count
        covariance = self.xx / self.count - torch.outer(mean_x, mean_x)
        cross = self.xy / self.count - torch.outer(mean_x, mean_y)
        scale = covariance.diagonal().clamp(min=1e-12).sqrt()
        standardised = covariance / torch.outer(scale, scale)
        identity = torch.eye(standardised.shape[0], dtype=torch.float64)
        weights = torch.linalg.solve(standardised + strength * identity, cross / scale[:, None]) / scale[:, None]
        predicted_spread = (weights * (covariance @ weights)).sum(0).sqrt()  # of the predictions, per target
        target_spread = (self.yy / self.count - mean_y.square()).clamp(min=0).sqrt()
        weights = weights * _matched_spread(predicted_spread, target_spread)
        bias = mean_y - mean_x @ weights
        return weights.t().float(), bias.float()


def _matched_spread(predicted_spread: torch.Tensor, target_spread: torch.Tensor) -> torch.Tensor:
    """Per head, the factor that stretches predictions about their mean to the targets' standard deviation (1 for a
    head whose predictions are constant)."""
    return torch.where(predicted_spread > 0, target_spread / predicted_spread.clamp(min=1e-12),
                       torch.ones_like(target_spread))


def spearman(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rank correlation per column of (N, H) tensors (ties ranked by order: scores are continuous)."""
    def ranks(values: torch.Tensor) -> torch.Tensor:
        ranked = values.argsort(0).argsort(0).double()
        return ranked - ranked.mean(0)

    first, second = ranks(predicted), ranks(target)
    return (first * second).sum(0) / (first.square().sum(0) * second.square().sum(0)).sqrt()


def _fit_mlp(features: torch.Tensor, targets: torch.Tensor, hidden_size: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A two-layer MLP (D -> ``hidden_size`` -> GELU -> H) fitted to targets (N, H) from features (N, D), trained
    on standardised features whose scaling is then folded into the first layer, its output stretched to the
    targets' spread (``_matched_spread``): (W1, b1, W2, b2), float32."""
    generator = torch.Generator().manual_seed(seed)
    mean = features.float().mean(0)
    scale = features.float().std(0).clamp(min=1e-6)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        first, second = nn.Linear(features.shape[1], hidden_size), nn.Linear(hidden_size, targets.shape[1])
    with torch.no_grad():
        second.bias.copy_(targets.mean(0))
    parameters = [*first.parameters(), *second.parameters()]
    optimiser = torch.optim.AdamW(parameters, lr=MLP_LEARNING_RATE, weight_decay=MLP_WEIGHT_DECAY)
    steps = MLP_EPOCHS * -(-features.shape[0] // MLP_BATCH)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, steps)
    for _ in range(MLP_EPOCHS):
        for rows in torch.randperm(features.shape[0], generator=generator).split(MLP_BATCH):
            predicted = second(nn.functional.gelu(first((features[rows].float() - mean) / scale)))
            loss = nn.functional.mse_loss(predicted, targets[rows])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            schedule.step()
    with torch.no_grad():
        weight = first.weight / scale
        first_bias = first.bias - weight @ mean
        inner = torch.cat([nn.functional.gelu(torch.addmm(first_bias, rows.float(), weight.t()))
                           for rows in features.split(MLP_BATCH * 16)])
        predicted = torch.addmm(second.bias, inner, second.weight.t())
        stretch = _matched_spread(predicted.double().std(0, correction=0), targets.double().std(0, correction=0))
        mean_predicted = predicted.mean(0)
        second_weight = second.weight * stretch.float()[:, None]
        second_bias = mean_predicted + (second.bias - mean_predicted) * stretch.float()
        return weight, first_bias, second_weight, second_bias


class _LinearFit:
    """Linear surrogates: ridge sums per layer, accumulated context by context; one candidate per ridge strength
    (the held-out contexts pick one)."""

    def __init__(self):
        self.sums: dict[int, _RidgeSums] = {}

    def add(self, layer: int, hidden: torch.Tensor, target: torch.Tensor) -> None:
        self.sums.setdefault(layer, _RidgeSums(hidden.shape[1], target.shape[1])).add(hidden, target)

    def candidates(self, model_name: str, fingerprint: str, log) -> dict[Any, Surrogate]:
        candidates = {}
        for strength in RIDGE_STRENGTHS:
            solved = {layer: sums.solve(strength) for layer, sums in self.sums.items()}
            candidates[strength] = Surrogate(model_name, fingerprint, weights={k: v[0] for k, v in solved.items()},
                                             biases={k: v[1] for k, v in solved.items()})
        return candidates

    @staticmethod
    def settings(chosen: Any) -> dict:
        return {"ridge_strength": chosen}


class _MLPFit:
    """MLP surrogates ``hidden_size`` wide: the training tokens' hidden states are kept (bfloat16) and each layer's
    MLP is fitted once all are in; a single candidate."""

    def __init__(self, hidden_size: int):
        self.hidden_size = hidden_size
        self.kept: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def add(self, layer: int, hidden: torch.Tensor, target: torch.Tensor) -> None:
        features, targets = self.kept.setdefault(layer, ([], []))
        features.append(hidden.bfloat16())
        targets.append(target)

    def candidates(self, model_name: str, fingerprint: str, log) -> dict[Any, Surrogate]:
        fitted = {}
        started = time.perf_counter()
        for layer in list(self.kept):
            features, targets = self.kept.pop(layer)
            fitted[layer] = _fit_mlp(torch.cat(features), torch.cat(targets), self.hidden_size, seed=layer)
            log(f"layer {layer}'s MLP fitted ({time.perf_counter() - started:.0f} s of fitting)")
        return {None: Surrogate(
            model_name, fingerprint, hidden_weights={k: v[0] for k, v in fitted.items()},
            hidden_biases={k: v[1] for k, v in fitted.items()}, weights={k: v[2] for k, v in fitted.items()},
            biases={k: v[3] for k, v in fitted.items()})}

    def settings(self, chosen: Any) -> dict:
        return {"hidden_size": self.hidden_size, "epochs": MLP_EPOCHS, "batch": MLP_BATCH,
                "learning_rate": MLP_LEARNING_RATE, "weight_decay": MLP_WEIGHT_DECAY}


def train_surrogate(model: nn.Module, tokenizer: Any, model_name: str, context_tokens: int = 2048,
                    max_contexts: int | None = None, held_out: float = 0.2, hidden_size: int | None = None,
                    log=print) -> Surrogate:
    """Fit KVzap's surrogates for ``model`` on the corpus: linear ones, or with ``hidden_size`` two-layer MLPs;
    ``held_out`` of its contexts (every k-th) pick the ridge strength and measure the fit, recorded in
    ``Surrogate.fit``."""
    if hidden_size is not None and hidden_size < 1:
        raise ValueError(f"hidden_size must be a positive integer (the MLP's width) or None, got {hidden_size}")
    started = time.perf_counter()
    contexts = corpus_contexts(tokenizer, context_tokens)[:max_contexts]
    every = max(2, round(1 / held_out)) if held_out > 0 else None
    evaluation = [ids for number, ids in enumerate(contexts) if every and number % every == every - 1]
    training = [ids for number, ids in enumerate(contexts) if not (every and number % every == every - 1)]
    if not training or not evaluation:
        raise ValueError(f"the corpus gives {len(contexts)} contexts of {context_tokens} tokens: too few to train "
                         f"and hold out {held_out:.0%}; lower context_tokens")
    layers = inspect_model(model).compressed_layers
    fit = _LinearFit() if hidden_size is None else _MLPFit(hidden_size)
    for number, ids in enumerate(training, 1):
        for layer, (hidden, target) in kvzip_observations(model, tokenizer, ids).items():
            fit.add(layer, hidden[SINKS:], target[SINKS:])
        log(f"training context {number}/{len(training)} ({time.perf_counter() - started:.0f} s)")
    candidates = fit.candidates(model_name, model_fingerprint(model), log)
    correlation = {key: {layer: 0.0 for layer in layers} for key in candidates}
    for number, ids in enumerate(evaluation, 1):
        for layer, (hidden, target) in kvzip_observations(model, tokenizer, ids).items():
            for key, candidate in candidates.items():
                predicted = candidate.scores(layer, hidden[None, SINKS:])[0].t()
                correlation[key][layer] += spearman(predicted, target[SINKS:]).mean().item() / len(evaluation)
        log(f"held-out context {number}/{len(evaluation)} ({time.perf_counter() - started:.0f} s)")
    best = max(candidates, key=lambda key: sum(correlation[key].values()))
    surrogate = candidates[best]
    surrogate.fit = {
        "corpus": CORPUS, "context_tokens": context_tokens, "training_contexts": len(training),
        "held_out_contexts": len(evaluation), "seconds": round(time.perf_counter() - started),
        "spearman": {str(layer): round(correlation[best][layer], 4) for layer in layers},
        "torch": torch.__version__, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "spread_matched": True,  # files trained before the stretch lack it: their reports must not claim it
        **fit.settings(best),
    }
    return surrogate


def fit_report(surrogate: Surrogate) -> str:
    """The fit as a markdown table: held-out Spearman per compressed layer."""
    fit = surrogate.fit
    lines = [f"# KVzap surrogate for {surrogate.model_name}", "",
             f"Corpus: {fit['corpus']}; {fit['training_contexts']} training and {fit['held_out_contexts']} held-out "
             f"contexts of {fit['context_tokens']} tokens; {_model_description(fit)}; "
             f"{fit['seconds']} s; model in {fit['dtype']}, torch {fit['torch']}."
             + (" Each head's predictions are stretched to the spread of KVzip's log-scores over the training tokens."
                if fit.get("spread_matched") else ""), "",
             "| layer | held-out Spearman (predicted vs KVzip scores, mean over KV heads) |", "|---|---|"]
    by_layer = sorted(fit["spearman"].items(), key=lambda item: int(item[0]))  # a loaded file's keys sort as text
    lines += [f"| {layer} | {value:.3f} |" for layer, value in by_layer]
    values = list(fit["spearman"].values())
    lines.append(f"| mean | {sum(values) / len(values):.3f} |")
    return "\n".join(lines) + "\n"


def _model_description(fit: dict) -> str:
    if "hidden_size" in fit:
        return (f"MLP {fit['hidden_size']} wide (GELU), {fit['epochs']} epochs of AdamW (batch {fit['batch']}, "
                f"learning rate {fit['learning_rate']}, weight decay {fit['weight_decay']}, cosine schedule)")
    return f"linear, ridge strength {fit['ridge_strength']}"


def build_parser() -> argparse.ArgumentParser:
    from .models import DEFAULT_ALIAS, model_names

    parser = argparse.ArgumentParser(
        prog="kvcompress-train-scorer",
        description="Train KVzap's surrogates (method='kvzap') for an embedded model from KVzip's scores.")
    parser.add_argument("--model", default=DEFAULT_ALIAS, choices=[DEFAULT_ALIAS, *model_names()])
    parser.add_argument("--out", required=True, type=Path,
                        help="a .safetensors file, or a folder that gets <model>.safetensors")
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--max-contexts", type=int, default=None, help="use only the corpus's first N contexts")
    parser.add_argument("--held-out", type=float, default=0.2, help="the fraction of contexts held out (0-0.5)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="fit two-layer MLPs this wide instead of linear maps (the file gets a -mlp suffix)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from .models import embedded_model, load_model

    args = build_parser().parse_args(argv)
    if not 0 < args.held_out <= 0.5:
        build_parser().error(f"--held-out must be in (0, 0.5], got {args.held_out}")
    if args.context_tokens < 64:
        build_parser().error(f"--context-tokens must be at least 64, got {args.context_tokens}")
    if args.hidden_size is not None and args.hidden_size < 1:
        build_parser().error(f"--hidden-size must be a positive integer, got {args.hidden_size}")
    name = embedded_model(args.model).name
    model, tokenizer = load_model(name, dtype=getattr(torch, args.dtype))
    surrogate = train_surrogate(model, tokenizer, name, args.context_tokens, args.max_contexts, args.held_out,
                                args.hidden_size, log=lambda line: print(line, file=sys.stderr, flush=True))
    suffix = "" if args.hidden_size is None else "-mlp"
    out = args.out if args.out.suffix == ".safetensors" else args.out / f"{name}{suffix}.safetensors"
    surrogate.save(out)
    report = fit_report(surrogate)
    out.with_suffix(".md").write_text(report)
    print(report + f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
