"""KVzap: KVzip's scores predicted from each token's hidden states, in prefill and decoding (arXiv 2601.07891).

KVzip scores a token by the most attention it receives while the model repeats the context, which costs
reconstruction passes after every prompt and cannot score decoded tokens. KVzap replaces the passes with a
learned surrogate per compressed layer (``kvcompress.surrogate``): a linear map from the layer's input hidden
states to one predicted log-score per KV head. A token is scored once, when it enters the cache (``combine =
"once"``), by one small matrix product, so prompts cost about an uncompressed prefill and decoded tokens are
scored like prompt tokens: continuous eviction during long generations keeps what KVzip would have kept.

Trained weights ship for the embedded models and are found by the model's fingerprint; for other models train
them with ``kvcompress-train-scorer`` and pass ``scorer_options={"weights": path}``. The layers share one budget
by score, as KVzip's presets do: the predicted log-scores are on KVzip's scale in every layer.
"""

from __future__ import annotations

import torch

from .. import surrogate
from .base import AttentionCall, Scorer


class KVzap(Scorer):
    name = "kvzap"
    combine = "once"
    reads_hidden_states = True
    allocation = "global"
    options = {"weights": ""}

    def bind(self, model, tokenizer) -> None:
        self.surrogate = surrogate.for_model(model, self.settings["weights"])

    def attend(self, call: AttentionCall, state) -> tuple[torch.Tensor | None, None]:
        if call.hidden_states is None:
            raise RuntimeError(f"kvcompress: layer {call.module.layer_idx}'s attention call came without its hidden "
                               "states (method='kvzap' reads them through a pre-hook on the attention module)")
        # on KVzip's own scale (attention in [0, 1]): a layer's KV heads add up as KVzip's scores do, so a token one
        # head needs is not outvoted by the others' low log-scores
        return self.surrogate.scores(call.module.layer_idx, call.hidden_states).exp(), None
