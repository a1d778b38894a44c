"""A wrapped model's call: the key its plan is made for, and where its tensors go."""

import torch
from torch.utils import _pytree as pytree


def call_key(args: tuple, kwargs: dict) -> tuple:
    """(the call's tensors, a key that differs wherever a plan could): tensors by shape, dtype,
    device and requires_grad, anything else by value (a graph specializes on it)."""
    leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
    tensors, key = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            key.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
                key.append((type(leaf), leaf))
            except TypeError:
                key.append((type(leaf), repr(leaf)))
    return tensors, (spec, tuple(key))


def compute_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must name a device such as 'cuda' or 'cuda:1', not "
                         f"{device!r}") from error
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def on_meta(tree):
    """The call as capture sees it with state on the host: tensors on the meta device, which
    capture takes for the model's own (host) device (module Rule 6)."""
    def meta(t):
        return t.detach().to("meta").requires_grad_(t.requires_grad)
    return pytree.tree_map_only(torch.Tensor, meta, tree)


def moved_to(tree, device: torch.device):
    def move(t):
        return t if t.device == device else t.to(device, non_blocking=True)
    return pytree.tree_map_only(torch.Tensor, move, tree)
