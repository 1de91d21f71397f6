"""The output layer as one matrix product we choose, shared by verification, plain steps and draft heads.

`nn.Linear` computes hidden @ W.T; on this CPU (MKL, fp32) that path is several times slower than W @ hidden.T
for 2-8 rows, and MKL's one-row GEMV is slower than its two-row GEMM (Gemma-3-270M, a (262144, 640) weight:
43 ms for one row through nn.Linear, 20 ms for two rows as W @ hidden.T). So rows are computed as W @ hidden.T
and a single row is computed twice. Same math as the model's head; the summation order may differ. A model loaded
with `model.packed_linears` on the CPU computes its own output layer through oneDNN instead (packed_linear.py), which
is flat from 1 to 16 rows where `W @ hidden.T` grows 3-4x, and computes each row the same whatever the number of rows.
"""

from dataclasses import dataclass

import torch

from selfspec.models.devices import loaded_weights
from selfspec.models.packed_linear import packed_product


@dataclass(frozen=True)
class LogitsFinish:
    """What a model's HF head does to its logits after the product: Gemma-2/3's soft-capping, Granite's division."""
    softcap: float | None = None  # final_logit_softcapping
    divisor: float | None = None  # logits_scaling

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.divisor is not None and self.divisor != 1:
            logits = logits / self.divisor
        return logits


def output_logits(weight: torch.Tensor, hidden: torch.Tensor, finish: LogitsFinish = LogitsFinish()) -> torch.Tensor:
    """(rows, hidden) final normed hidden states, (vocab, hidden) weight -> (rows, vocab) fp32 logits.
    The product runs in the weight's dtype (bfloat16 stays bfloat16); only the result is upcast, for softmax and
    sampling in float32."""
    rows = hidden.shape[0]
    if rows == 1:
        hidden = hidden.repeat(2, 1)  # a real copy: a stride-0 expand takes a slow path (66 ms, not 16)
    logits = (weight @ hidden.T).T[:rows]  # (rows, vocab)
    return finish(logits).float()


def logits_finish(model) -> LogitsFinish:
    config = model.config.get_text_config()
    return LogitsFinish(getattr(config, "final_logit_softcapping", None), getattr(config, "logits_scaling", None))


def model_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's own output layer: (rows, hidden) final normed hidden states -> (rows, vocab) fp32 logits, on the
    output layer's device (with a device map it may sit on another device than the last layer, or be offloaded).
    Through the packed weight where the model has one (packed_linear.pack_output_layer), except to train through."""
    with loaded_weights(model.get_output_embeddings()) as head:
        packed = getattr(head, "packed_weight", None)
        if packed is not None and not (hidden.requires_grad and torch.is_grad_enabled()):
            return logits_finish(model)(packed_product(hidden.contiguous(), packed)).float()  # (rows, vocab)
        return output_logits(head.weight, hidden.to(head.weight.device), logits_finish(model))
