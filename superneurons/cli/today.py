"""Models people train today, named on the command line beside the paper's networks:
``torchvision:NAME``, ``timm:NAME`` and ``hf:MODEL`` (HF transformers: a model type such as
``hf:gpt2``, built from that type's default configuration, or a configuration's directory or
hub name, either with a ``/``). Each is built with random weights, with synthetic inputs of the given batch and the loss
its training step would take. ``--set KEY=VALUE`` goes to torchvision's and timm's builders as
an argument, and to an HF configuration as a field (``--set num_hidden_layers=4``)."""

import ast
import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

SOURCES = ("torchvision", "timm", "hf")
# a language model's tokens per sequence unless --seq says: at most GPT-2 small's context, so
# that a default plan is of a sequence people train at, not of a 128k-token context
DEFAULT_SEQUENCE = 1024


@dataclass
class Named:
    """A model with its inputs and how its step's loss is read from its output."""
    model: nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    loss: Callable = None            # (output) -> the loss the step's backward starts from
    inputs: str = ""                 # the inputs, as a summary line says them
    items: int = 0                   # images or tokens a step: the throughput's unit
    unit: str = "img"


def is_named(name: str) -> bool:
    return name.partition(":")[0] in SOURCES and bool(name.partition(":")[2])


def settings(pairs: list) -> dict:
    """``--set`` pairs as keyword arguments; a value is a Python literal where it reads as one
    (4, 0.1, True, None), else a string."""
    out = {}
    for pair in pairs or ():
        key, equals, text = pair.partition("=")
        if not equals or not key.isidentifier():
            raise ValueError(f"--set takes KEY=VALUE with KEY a name, got {pair!r}")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[key] = text
    return out


def build(name: str, batch: int, device, *, image: int | None = None, seq: int | None = None,
          options: dict | None = None, inputs_seed: int | None = None,
          inputs_device=None) -> Named:
    """``name``'s model on ``device`` (meta: planning allocates nothing) and its inputs, on
    ``inputs_device`` where given (the model's state on the host, its step on the GPU), made
    after ``torch.manual_seed(inputs_seed)`` where one is given (each rank its own data)."""
    source, _, model_name = name.partition(":")
    builders = {"torchvision": _torchvision, "timm": _timm, "hf": _hf}
    if source not in builders or not model_name:
        raise ValueError(f"a model today is named torchvision:NAME, timm:NAME or hf:MODEL, "
                         f"not {name!r}")
    for flag, value in (("--batch", batch), ("--image", image), ("--seq", seq)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if (image if source == "hf" else seq) is not None:
        raise ValueError(f"{'--image' if source == 'hf' else '--seq'} does not apply to "
                         f"{name}: drop it (--seq is for hf: models, --image for "
                         "torchvision: and timm: ones)")
    model, inputs = builders[source](model_name, torch.device(device), dict(options or {}))
    if inputs_seed is not None:
        torch.manual_seed(inputs_seed)
    return inputs(model, batch, image, seq, torch.device(inputs_device or device))


def _library(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise ValueError(f"{module} is not installed: pip install {module}") from None


def _images(model: nn.Module, batch: int, size: tuple, classes: int, device) -> Named:
    x = torch.randn((batch, *size), device=device)
    y = torch.randint(0, classes, (batch,), device=device) if device.type != "meta" else None

    def loss(out):
        # a model that trains with auxiliary heads (inception_v3, googlenet) returns a tuple
        logits = out[0] if isinstance(out, tuple) else out
        return F.cross_entropy(logits.float(), y)
    return Named(model, (x,), loss=loss, inputs=f"input {tuple(x.shape)}", items=batch)


def _made(name: str, device, make, options: dict) -> nn.Module:
    """``make()``'s model on ``device``. A builder that computes with tensors while it builds
    (torchvision's RegNets size their stages so) cannot run on the meta device: it is built on
    the CPU, its weights in host memory, and moved there. A builder that refuses the ``--set``
    ``options`` says so as a ValueError."""
    try:
        try:
            with torch.device(device):
                return make()
        except NotImplementedError:
            if device.type != "meta":
                raise
        return make().to(device)
    except (AssertionError, ImportError, TypeError, ValueError) as error:
        if not options:
            raise
        raise ValueError(f"building {name} failed ({type(error).__name__}: {error}); check "
                         f"the --set values ({', '.join(options)})") from error


# A builder makes (the model on a device, inputs(model, batch, image, seq, device) -> Named).

def _torchvision(name, device, options) -> tuple:
    models = _library("torchvision").models
    # classification models: detection and segmentation builders fetch backbone weights, and
    # video, optical-flow and quantized models take other inputs than a batch of images
    if name not in models.list_models(module=models):
        raise ValueError(f"torchvision:{name} is not one of torchvision's classification "
                         "models, which torchvision.models.list_models(module=torchvision."
                         "models) lists; wrap other models in Python (sn.wrap) with their own "
                         "inputs and loss")
    model = _made(f"torchvision:{name}", device,
                  lambda: models.get_model(name, weights=None, **options), options)

    def inputs(model, batch, image, seq, device):
        size = image or options.get("image_size") or (299 if name == "inception_v3" else 224)
        return _images(model, batch, (3, size, size), options.get("num_classes", 1000), device)
    return model, inputs


def _timm(name, device, options) -> tuple:
    timm = _library("timm")
    if not timm.is_model(name):
        raise ValueError(f"timm has no model {name!r}; timm.list_models() lists them")
    model = _made(f"timm:{name}", device,
                  lambda: timm.create_model(name, pretrained=False, **options), options)

    def inputs(model, batch, image, seq, device):
        channels, height, width = model.pretrained_cfg.get("input_size", (3, 224, 224))
        image = image or options.get("img_size")         # a size given to timm's builder
        size = (channels, image, image) if image else (channels, height, width)
        return _images(model, batch, size, model.num_classes, device)
    return model, inputs


def _hf(name, device, options) -> tuple:
    transformers = _library("transformers")
    from transformers.models.auto import modeling_auto as auto
    config = _hf_config(transformers, name, options)
    kind = config.model_type
    if kind in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        head = transformers.AutoModelForMaskedLM
    elif kind in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        head = transformers.AutoModelForCausalLM
    elif kind in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:    # T5: labels shifted in
        head = transformers.AutoModelForSeq2SeqLM
        if getattr(config, "decoder_start_token_id", None) is None:   # as T5's checkpoints say
            config.decoder_start_token_id = config.pad_token_id or 0
    else:
        raise ValueError(f"hf:{name} has no causal, masked or sequence-to-sequence "
                         "language-model head in transformers; wrap such a model in Python "
                         "(sn.wrap) with its own inputs and loss")
    model = _made(f"hf:{name}", device, lambda: head.from_config(config), options)
    text = config.get_text_config()      # a multimodal model's language part holds these
    takes_cache = "use_cache" in inspect.signature(model.forward).parameters

    def inputs(model, batch, image, seq, device):
        if text.vocab_size < 1:
            raise ValueError(f"hf:{name} has a vocabulary of {text.vocab_size}: --set a "
                             "vocab_size of 1 or more")
        positions = getattr(text, "max_position_embeddings", None)
        if seq and positions and seq > positions:
            raise ValueError(f"hf:{name} takes at most {positions} tokens a sequence (its "
                             f"max_position_embeddings), fewer than --seq {seq}: lower --seq, "
                             f"or --set max_position_embeddings={seq} where the model allows")
        length = seq or min(DEFAULT_SEQUENCE, positions or DEFAULT_SEQUENCE)
        ids = torch.randint(0, text.vocab_size, (batch, length), device=device) \
            if device.type != "meta" else torch.empty((batch, length), dtype=torch.long,
                                                      device=device)
        kwargs = {"input_ids": ids, "labels": ids}
        if takes_cache:
            kwargs["use_cache"] = False             # a training step keeps no cache of keys
        return Named(model, (), kwargs, loss=lambda out: out.loss,
                     inputs=f"{batch} x {length} tokens", items=batch * length, unit="tok")
    return model, inputs


def _hf_config(transformers, name: str, options: dict):
    """An HF configuration: a model type's defaults, or a directory's or hub name's
    config.json, with the --set fields, each of which it must know (an unknown one would be
    kept and never read: a typo would plan the default model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    local = "/" in name or name.startswith(".")
    if not local and name not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"transformers has no model type {name!r}; hf:MODEL takes a type such "
                         "as gpt2, llama or bert, or a configuration's directory or hub name "
                         "with a / in it (hf:./my-model, hf:org/name)")

    def read(**fields):
        return transformers.AutoConfig.from_pretrained(name, **fields) if local else \
            transformers.AutoConfig.for_model(name, **fields)
    try:                              # the configurations' own checks, in hub releases with them
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        StrictDataclassError = ValueError
    refusals = (OSError, ValueError, TypeError, AttributeError, StrictDataclassError)
    try:
        config = read()
    except refusals as error:
        raise ValueError(f"hf:{name}: no configuration could be read ({error}); give a model "
                         "type such as gpt2, or a directory holding a config.json") from error
    # a method, or a property with no setter, is not a field (a property with one, such as
    # rope_scaling or torch_dtype, is how a configuration takes a legacy name)
    methods = [key for key in options if callable(getattr(type(config), key, None))
               or getattr(getattr(type(config), key, None), "fset", True) is None]
    if methods:
        raise ValueError(f"--set {', '.join(methods)}: not fields of hf:{name}'s configuration "
                         f"({type(config).__name__}), whose fields its to_dict() lists")
    try:
        if local:    # from_pretrained sets only the fields its config.json has, and says which
            configured, unknown = transformers.AutoConfig.from_pretrained(
                name, return_unused_kwargs=True, **options)
        else:
            configured = read(**options)
    except refusals as error:
        raise ValueError(f"hf:{name}'s configuration refuses --set "
                         f"{', '.join(options)} ({type(error).__name__}: {error})") from error
    if not local:
        # a name the configuration neither has nor reads (a legacy one, such as Llama's
        # rope_theta, is read into another field) is kept as given and never used: a typo
        # would plan the default model
        known = {*config.to_dict(), *getattr(config, "attribute_map", {})}
        kept = configured.to_dict()
        unknown = [key for key in options if key not in known and key in kept]
    if unknown:
        text = config.get_text_config()
        nested = text is not config and all(key in text.to_dict() for key in unknown)
        raise ValueError(
            f"hf:{name}'s configuration ({type(config).__name__}) has no field "
            f"{', '.join(unknown)}; --set takes its fields, as its to_dict() lists them"
            + ("; this one is its text configuration's: --set text_config={...}"
               if nested else ""))
    return configured
