"""The output layer as one matrix product we choose, shared by verification, plain steps and draft vocabularies.

`nn.Linear` computes hidden @ W.T, which on the CPU (MKL, fp32) can be several times slower than W @ hidden.T for a
few rows, and MKL's one-row GEMV can be slower than its two-row GEMM. So rows are computed as W @ hidden.T, and a
single row twice, so that a row's logits never depend on how many rows came with it. A draft's single row is
computed whichever way is faster on this machine (the winner differs between machines), timed once per weight shape
(`one_row_product`). Same math as the model's head; the summation order may differ. A model loaded with
`model.packed_linears` on the CPU computes its own output layer through oneDNN instead (packed_linear.py), which
costs about the same for any number of rows and computes each row the same whatever the number of rows.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from selfspec.models.devices import loaded_weights
from selfspec.models.packed_linear import packed_product
from selfspec.timing import timed_ms_each


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


def output_logits(weight: torch.Tensor, hidden: torch.Tensor, finish: LogitsFinish = LogitsFinish(),
                  fastest_row: bool = False) -> torch.Tensor:
    """(rows, hidden) final normed hidden states, (vocab, hidden) weight -> (rows, vocab) fp32 logits.
    The product runs in the weight's dtype (bfloat16 stays bfloat16); only the result is upcast, for softmax and
    sampling in float32. `fastest_row`: a single row by the faster product here (`one_row_product`), for drafts."""
    if hidden.shape[0] == 1:
        product = one_row_product(weight) if fastest_row else two_row_gemm
        return finish(product(weight, hidden)).float()
    return finish((weight @ hidden.T).T).float()  # (rows, vocab)


def gemv(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(hidden, weight)  # (1, vocab)


def two_row_gemm(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The row computed twice: a real copy, since a stride-0 expand takes a slow path."""
    return (weight @ hidden.repeat(2, 1).T).T[:1]  # (1, vocab)


_ONE_ROW: dict[tuple, Callable] = {}  # (weight shape, dtype, device) -> the faster of gemv and two_row_gemm here


def one_row_product(weight: torch.Tensor, repeats: int = 5) -> Callable:
    """`gemv` or `two_row_gemm`, whichever took less time (the median of `repeats`, in turns) for one row on this
    machine with a weight like `weight`, timed on first use."""
    key = (tuple(weight.shape), weight.dtype, str(weight.device))
    if key not in _ONE_ROW:
        row = torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device)
        products = (gemv, two_row_gemm)
        with torch.inference_mode():
            taken = timed_ms_each([lambda product=product: product(weight, row) for product in products],
                                  weight.device, repeats)
        _ONE_ROW[key] = products[taken.index(min(taken))]
    return _ONE_ROW[key]


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
