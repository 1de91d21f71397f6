"""The decoder's linear layers and the output layer through oneDNN, each weight packed once at load
(`model.packed_linears`).

On the CPU, `nn.Linear` (MKL sgemm, fp32) grows with each row of a decoding step, while oneDNN with the weight
packed into its blocked layout costs about the same for 1 to 6 rows: plain decoding gets faster and a verification
of several drafts costs about one plain step (docs/results.md). These are the ops torch.compile's CPU weight
prepacking emits (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`), called without compiling; for
float32 torch.compile picks MKL's packed sgemm, which is no faster than `nn.Linear`. Each output row is computed the
same whatever the number of rows, as for the output layer (output_layer.py).

oneDNN builds and keeps a kernel for each row count it meets (about 0.5 MiB for each weight shape of SmolLM2): a
server that meets every prompt length and batch width would grow by megabytes a minute for hours. Past 16 rows a
product runs on rows padded to three significant bits (`padded_rows`: at most 25% more rows, four row counts an
octave), so the kernels kept stay few.

The output layer's weight is packed beside the dense one (`pack_output_layer`; it is often the input embedding,
which must stay dense): a tree's verification or a batch's forward scores many rows, where the packed product is
cheaper; the price is a second copy of the weight.

Packed only where it pays: a float32 model wholly on the CPU (bfloat16 takes a slow path) with oneDNN available;
inference only (the op has no backward). `unpacked_copy` gives back the stock model, the baseline a user without
selfspec has (strategy hf_generate_stock).
"""

import copy

import torch
from torch import nn

from selfspec.models.grouped_attention import GROUPED_SDPA, use_sdpa_attention
from selfspec.models.layouts import decoder_layers

ROWS_HINT = 4  # the row count oneDNN blocks the weight for; 1 would slow every multi-row forward
EXACT_ROWS = 16  # products of up to this many rows (a decoding step, a verification) run unpadded


class PackedLinear(nn.Module):
    """`nn.Linear`'s y = x W^T + b with W held in oneDNN's packed layout. Its state dict holds the dense weight, as
    the replaced layer's did (a Kangaroo adapter starts as a copy of a decoder layer)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed_weight(linear.weight)  # (out, in)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out)."""
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("packed linears have no backward: run the model under torch.inference_mode() or "
                               "torch.no_grad(), or load it with model.packed_linears=false to train through it")
        return packed_product(x, self.packed, self.bias)

    def to_linear(self) -> nn.Linear:
        """The `nn.Linear` this layer replaced: the weight unpacked into a new dense tensor, the bias shared."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        linear.weight, linear.bias = nn.Parameter(self.packed.to_dense()), self.bias
        return linear

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.packed.to_dense()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """A dense (out, in) weight packed once into oneDNN's blocked layout, for `packed_product`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(..., in) x a packed (out, in) weight -> (..., out): x W^T + b, on `padded_rows` rows."""
    rows = x.numel() // x.shape[-1]
    padded = padded_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = torch.cat([x.reshape(rows, -1), x.new_zeros(padded - rows, x.shape[-1])])  # (padded, in)
    product = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")  # (padded, out)
    return product[:rows].reshape(*x.shape[:-1], -1)


def padded_rows(rows: int) -> int:
    """`rows` up to EXACT_ROWS, else `rows` rounded up to three significant bits (17 -> 20, 33 -> 40, 129 -> 160)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def can_pack(model) -> bool:
    """Whether packing applies: oneDNN here, every weight float32 on the CPU, no accelerate device map."""
    return (torch.backends.mkldnn.is_available() and getattr(model, "hf_device_map", None) is None
            and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters()))


def pack_linears(model) -> int:
    """Replace every `nn.Linear` inside the decoder layers by a PackedLinear over the same weight, if `can_pack`;
    the dense weights are freed. Returns how many were replaced. The output layer stays as it is (output_layer.py;
    it is often tied to the embedding, which must stay dense)."""
    if not can_pack(model):
        return 0
    return sum(_pack(layer) for layer in decoder_layers(model))


def pack_output_layer(model) -> bool:
    """Give the output layer a packed copy of its weight (`packed_weight`, read by output_layer.model_logits), if
    `can_pack`; the dense weight stays. Returns whether it did."""
    if not can_pack(model):
        return False
    head = model.get_output_embeddings()
    head.packed_weight = packed_weight(head.weight)  # (vocab, hidden)
    return True


def pack_module(module, model) -> int:
    """Pack the linears of `module` (a trained draft part running beside `model`) if `model`'s are packed."""
    packed = any(isinstance(m, PackedLinear) for m in model.modules())
    return _pack(module) if packed and can_pack(module) else 0


def _pack(module) -> int:
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced


def unpacked_copy(model):
    """The stock model a user would otherwise have: a second model object with `nn.Linear` where `model` has a
    PackedLinear, no packed output layer and transformers' own attention (models/grouped_attention.py), sharing every
    other parameter and buffer with `model`, which stays as it is; `model` itself where it is stock already. It costs
    one dense copy of the packed weights."""
    packed = [module for module in model.modules() if isinstance(module, PackedLinear)]
    if not packed and model.config._attn_implementation != GROUPED_SDPA:
        return model
    memo = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}  # shared, never copied
    memo |= {id(module): module.to_linear() for module in packed}  # deepcopy puts each where its packed layer was
    head = model.get_output_embeddings()
    if hasattr(head, "packed_weight"):
        memo[id(head.packed_weight)] = None  # the copy's output layer computes with its dense weight
    stock = copy.deepcopy(model, memo)
    use_sdpa_attention(stock)
    return stock
