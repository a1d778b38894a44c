"""What a user is told when export fails on a forward that reads tensor values (not sizes) as
Python numbers or branches on them: where it read, which of the model's modules holds that
code, and which parts of the model could be wrapped instead (the parts that do not hold it)."""

import inspect
import os
import re

import torch
from torch import nn

from .hf import mask_read_refusal

# HF heads given labels= compute their loss in the forward, some reading the labels' values
# (DeBERTa-v2's classifier, Wav2Vec2's CTC) or indexing by them (ELECTRA's pre-training head)
LABELS_HINT = (" Given labels=, the model computes its own loss from them: call it without "
               "labels and compute the loss from its logits outside.")


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
    readers = reading_modules(model, error, where)
    kind = type(readers[0][1]).__name__ if readers else None
    held = f", in {kind} ({readers[0][0]}" + (
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
        + children_of(model, [name for name, _ in readers], kind) + "."
        + (LABELS_HINT if "labels" in kwargs and not readers else ""))


def children_of(model: nn.Module, holding: list = (), kind: str | None = None) -> str:
    """The model's direct children, named as a user would wrap one in its place; where
    ``holding`` names submodules (of class ``kind``, holding the code that made the refusal),
    only the children holding none of them."""
    names = [name for name, _ in model.named_children()]
    free = [name for name in names
            if not any(h == name or h.startswith(name + ".") for h in holding)]
    if not free:
        return f" (each of its children holds {kind})" if names and holding else ""
    first = f"model[{free[0]}]" if free[0].isdigit() else f"model.{free[0]}"
    which = "its children" if len(free) == len(names) else f"its children that hold no {kind}"
    return (f" ({which}: {', '.join(free[:8])}{' and more' if len(free) > 8 else ''}; "
            f"{first} = sn.wrap({first}, ...) wraps one)")


def where_read(error: Exception) -> str | None:
    """Where export's data-dependent error says the model read a value: the place it names,
    unless that is torch's own, else the innermost frame of the traceback outside torch and
    superneurons (the model's own code)."""
    torch_dir = os.path.join(os.path.dirname(torch.__file__), "")
    caused = re.search(r"Caused by: (.*)", str(error))
    places = re.findall(r"\(([^()\n]+?:\d+ in [\w<>.]+)\)", caused.group(1)) if caused else []
    if places and not os.path.exists(os.path.join(torch_dir, places[-1].split("/")[0])):
        return places[-1]
    where, frames = None, error.__traceback__
    while frames is not None:
        code = frames.tb_frame.f_code
        if not _ours(code.co_filename):
            where = f"{code.co_filename}:{frames.tb_lineno} in {code.co_name}"
        frames = frames.tb_next
    return where


def _ours(filename: str) -> bool:
    """torch's, superneurons' or contextlib's code, not the model's."""
    return filename.startswith(tuple(os.path.join(d, "") for d in (
        os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__))))) or \
        filename.endswith(os.sep + "contextlib.py")


def reading_modules(model: nn.Module, error: Exception, where: str | None) -> list:
    """(name, module) of each submodule of the class whose code read the value: the innermost
    frame of the error's traceback, outside torch, whose ``self`` is one of the model's
    submodules (through decorators and helper functions); else the classes defining the
    function ``where`` names at that line. None where it is the model's own forward, or
    where nothing can be told: this only adds to a refusal, which it must never replace."""
    try:
        modules = dict(model.named_modules())
        reader = _reading_frame(modules, error) or _reading_class(modules, where)
        if reader is None or reader is model:
            return []
        return [(name, module) for name, module in modules.items()
                if name and type(module) is type(reader)]
    except Exception:  # noqa: BLE001 -- a model's odd attributes: no reader named
        return []


def _reading_frame(modules: dict, error: Exception):
    ids = {id(module): module for module in modules.values()}
    reader, frames = None, error.__traceback__
    while frames is not None:
        frame = frames.tb_frame
        owner = frame.f_locals.get("self")
        if id(owner) in ids and not _ours(frame.f_code.co_filename):
            reader = owner                        # the innermost such frame wins
        frames = frames.tb_next
    return reader


def _reading_class(modules: dict, where: str | None):
    found = re.fullmatch(r"(.+):(\d+) in (\w+)", where or "")
    if not found:
        return None
    path, line, function = found.group(1), int(found.group(2)), found.group(3)
    for module in modules.values():
        if any(_covers(value, path, line, function)
               for cls in type(module).__mro__ if cls not in (nn.Module, object)
               for value in vars(cls).values()):
            return module
    return None


def _covers(value, path: str, line: int, function: str) -> bool:
    function_object = getattr(value, "__func__", value)
    if callable(function_object):
        try:
            function_object = inspect.unwrap(function_object)   # decorators (HF's forwards)
        except ValueError:
            pass
    code = getattr(function_object, "__code__", None)
    if code is None or code.co_name != function or not (
            code.co_filename == path or code.co_filename.endswith(os.sep + path)):
        return False
    lines = [number for _, _, number in code.co_lines() if number is not None]
    return bool(lines) and code.co_firstlineno <= line <= max(lines)
