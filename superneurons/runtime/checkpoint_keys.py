"""Checkpoints of a wrapped model use the model's own keys (no "model." prefix), so they load
into the plain model and back: state-dict hooks of the wrapper (module.py)."""


def own_keys(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:           # the modules' versions, under the model's own names
        for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[(prefix + key[len(inner):]).rstrip(".")] = metadata.pop(key)


def wrapper_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                  errors) -> None:
    # only the model's own keys move under "model.": a model may have a child named "model"
    # itself (HF's LlamaForCausalLM), whose keys already start so
    own = set(module.model.state_dict(keep_vars=True))
    for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix):] in own]:
        state_dict[prefix + "model." + key[len(prefix):]] = state_dict.pop(key)
