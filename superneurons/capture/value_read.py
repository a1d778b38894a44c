"""What a user is told when export fails on a forward that reads tensor values (not sizes) as
Python numbers or branches on them: where it read, which of the model's modules holds that
code, and which parts of the model could be wrapped instead (the parts that do not hold it)."""

import os
import re

import torch
from torch import nn

from .hf import mask_read_refusal


def is_value_read(error: Exception) -> bool:
    # a value read as a size reaches export as a fake tensor where ints are due (a
    # PackedSequence's batch sizes, in a recurrent layer)
    text = str(error)
    return "data-dependent" in text or "data dependent" in text or "but got FakeTensor" in text


def value_read_refusal(model: nn.Module, error: Exception, message: str,
                       kwargs: dict) -> ValueError:
    sized = "but got FakeTensor" in str(error)
    cumulative = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None
                     for m in model.modules())
    recurrent = sized and any(isinstance(m, nn.RNNBase) for m in model.modules())
    where = where_read(error)
    said = mask_read_refusal(model, where)
    if said:
        return ValueError(said)
    readers = reading_modules(model, where)
    held = f", in {type(model.get_submodule(readers[0])).__name__} ({readers[0]}" + (
        f" and {len(readers) - 1} more)" if len(readers) > 1 else ")") if readers else ""
    return ValueError(
        f"superneurons could not capture {type(model).__name__}: {message}"
        + (f" (read at {where}{held})" if where else "") + ". Code that "
        "reads tensor values (not sizes) as Python numbers or branches on them cannot "
        "be captured" + (" (its BatchNorm with momentum=None reads its step counter "
        "so: give it a momentum)" if cumulative else "") + (" (a PackedSequence "
        "sizes its recurrent layers' steps by the lengths' values: give them padded "
        "batches, and mask the padding)" if recurrent else "") + "; move it out of the "
        "forward, or wrap the parts of the model that do not read them in their place"
        + children_of(model, holding=readers) + "." + (" Given labels=, a model may read them "
        "in the loss it computes (HF's heads): call it without labels and compute the loss "
        "from its logits outside." if "labels" in kwargs and not readers else ""))


def children_of(model: nn.Module, holding: list = ()) -> str:
    """The model's direct children, named as a user would wrap one in its place; where
    ``holding`` names submodules (the code that made the refusal), only the children holding
    none of them."""
    names = [name for name, _ in model.named_children()]
    free = [name for name in names
            if not any(h == name or h.startswith(name + ".") for h in holding)]
    if not free:
        return f" (each of its children holds {_class_of(model, holding[0])})" \
            if names and holding else ""
    first = f"model[{free[0]}]" if free[0].isdigit() else f"model.{free[0]}"
    which = "its children" if len(free) == len(names) else \
        f"its children that hold no {_class_of(model, holding[0])}"
    return (f" ({which}: {', '.join(free[:8])}{' and more' if len(free) > 8 else ''}; "
            f"{first} = sn.wrap({first}, ...) wraps one)")


def _class_of(model: nn.Module, name: str) -> str:
    return type(model.get_submodule(name)).__name__


def where_read(error: Exception) -> str | None:
    """Where export's data-dependent error says the model read a value: the frame it names,
    unless that is torch's own, else the innermost frame of the traceback outside torch and
    superneurons (the model's own code)."""
    ours = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    caused = re.search(r"Caused by: \(([^)\n]+)\)", str(error))
    if caused and not os.path.exists(os.path.join(ours[0], caused.group(1).split("/")[0])):
        return caused.group(1)
    where, frames = None, error.__traceback__
    while frames is not None:
        code = frames.tb_frame.f_code
        if not code.co_filename.startswith(ours) and "/contextlib.py" not in code.co_filename:
            where = f"{code.co_filename}:{frames.tb_lineno} in {code.co_name}"
        frames = frames.tb_next
    return where


def reading_modules(model: nn.Module, where: str | None) -> list:
    """The submodules whose class defines the function ``where`` names, at that line."""
    found = re.fullmatch(r"(.+):(\d+) in (\w+)", where or "")
    if not found:
        return []
    path, line, function = found.group(1), int(found.group(2)), found.group(3)
    readers, classes = [], {}
    for name, module in model.named_modules():
        kind = type(module)
        if kind not in classes:
            classes[kind] = any(_covers(value, path, line, function)
                                for cls in kind.__mro__ if cls not in (nn.Module, object)
                                for value in vars(cls).values())
        if classes[kind] and name:
            readers.append(name)
    return readers


def _covers(value, path: str, line: int, function: str) -> bool:
    code = getattr(getattr(value, "__func__", value), "__code__", None)
    if code is None or code.co_name != function or not code.co_filename.endswith(path):
        return False
    lines = [number for _, _, number in code.co_lines() if number is not None]
    return bool(lines) and code.co_firstlineno <= line <= max(lines)
