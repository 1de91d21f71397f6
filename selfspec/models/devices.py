"""Where a model's inputs go and where its logits land, with or without a device map (`model.device_map`).

Without a device map the whole model sits on `model.device`. With one, accelerate's hooks move each module's
inputs to that module's execution device at its forward, so a layer that a draft skips (swapped out of the list,
models/skip.py) costs nothing: the next layer's hook moves the hidden states on. Code that builds input tensors or
reads a weight directly asks here instead of `model.device`, which is only the first parameter's device (`meta`
when that parameter is offloaded).
"""

from contextlib import ExitStack, contextmanager

import torch
from accelerate.utils import align_module_device


def execution_device(module) -> torch.device:
    """The device `module` computes on: its accelerate hook's execution device, else its first parameter's."""
    hook = getattr(module, "_hf_hook", None)
    for h in getattr(hook, "hooks", [hook]):  # a SequentialHook holds several
        if getattr(h, "execution_device", None) is not None:
            return torch.device(h.execution_device)
    return next(module.parameters(), torch.empty(0)).device


def input_device(model) -> torch.device:
    """Where input ids (and positions, masks) go: the input embedding's device."""
    return execution_device(model.get_input_embeddings())


def output_device(model) -> torch.device:
    """Where logits land, and so where sampling runs (generators, one-hot draft probabilities)."""
    return execution_device(model.get_output_embeddings())


@contextmanager
def loaded_weights(module):
    """Inside the block, `module`'s weights are real tensors on their execution device, also when accelerate
    offloaded them to CPU or disk (they are `meta` outside a forward then); a no-op for a module in memory."""
    with ExitStack() as stack:
        for part in module.modules():  # accelerate hooks each submodule that holds offloaded weights
            stack.enter_context(align_module_device(part))
        yield module
