"""KVzap: KVzip's scores predicted from each token's hidden states, in prefill and decoding (arXiv 2601.07891).

KVzip scores a token by the most attention it receives while the model repeats the context, which costs
reconstruction passes after every prompt and cannot score decoded tokens. KVzap replaces the passes with a
learned surrogate per compressed layer (``kvcompress.surrogate``): a linear map from the layer's input hidden
states to one predicted log-score per KV head. A token is scored once, when it enters the cache (``combine =
"once"``), by one small matrix product, so prompts cost about an uncompressed prefill and decoded tokens are
scored like prompt tokens: continuous eviction during long generations keeps what KVzip would have kept.

Trained weights ship for the embedded models and are found by the model's fingerprint; for other models train
them with ``kvcompress-train-scorer`` and pass ``scorer_options={"weights": path}``. A slot's score is the
exponential of its predicted log-score, a predicted KVzip score: the layers share one budget by it, and a layer's
KV heads add up as KVzip's scores do where they share a selection. The preset keeps the layers' heads together
(``global``) where KVzip's lets every head compete (``global_adaptive``): head-wise counts are set at a prompt
and evict nothing while decoding, and scoring decoded tokens is what KVzap is for; for prompt-only compression
at a small budget ``budget_allocation="global_adaptive"`` keeps more of what the prompts need.
"""

from __future__ import annotations

import torch

from .. import surrogate
from .base import AttentionCall, Scorer


class KVzap(Scorer):
    name = "kvzap"
    combine = "once"
    reads_hidden_states = True
    scores_folded_layers = True  # each new token's scores, whatever the layer's layout
    allocation = "global"
    options = {"weights": ""}

    @classmethod
    def weights_checksum(cls, model, scorer_options) -> str:
        return surrogate.for_model(model, {**cls.options, **scorer_options}["weights"]).checksum

    def bind(self, model, tokenizer) -> None:
        self.surrogate = surrogate.for_model(model, self.settings["weights"])

    def attend(self, call: AttentionCall, layer) -> tuple[torch.Tensor | None, None]:
        if call.hidden_states is None:
            raise RuntimeError(f"kvcompress: layer {call.module.layer_idx}'s attention call came without its hidden "
                               "states (method='kvzap' reads them through a pre-hook on the attention module)")
        # summed over heads, log-scores would let the others' low predictions outvote the one head that needs a token
        return self.surrogate.scores(call.module.layer_idx, call.hidden_states).exp(), None
