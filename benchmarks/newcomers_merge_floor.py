"""Models nobody here wrote, trained at budgets where whole blocks do not fit with nothing
moved, so that blocks are cut or merged (planner/trim.py split_blocks, a merge held to the
floor): torchvision resnet34 (a stem larger than its basic blocks), timm convnext_nano and HF
Exaone4ForCausalLM from a small config (a decoder whose LM head sets the floor). 3 AdamW steps
under "superneurons" and "recompute", compared with plain PyTorch bit for bit (tests/matrix.py),
on the CPU; the record keeps how many of the chosen plan's replays span merged blocks.

    python benchmarks/newcomers_merge_floor.py OUT_DIR  (writes newcomers_merge_floor.json)

The budget is TOWARD of the way from the policy's floor to the liveness plan's peak.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOWARD = (0.02, 0.1, 0.3)


def _exaone():
    import torch
    import transformers
    config = transformers.Exaone4Config(vocab_size=2048, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.Exaone4ForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (4, 96))
    return model, (), dict(input_ids=ids, labels=ids, use_cache=False), lambda out: out.loss


def merged_replays(plan) -> int:
    """Segments of ``plan`` that replay past one of the route's cuts: blocks merged."""
    from superneurons.planner.policy import route_cuts
    cuts = route_cuts(plan.graph, list(plan.order))
    return sum(any(layer in cuts for layer in s.layers[:-1]) for s in plan.segments)


def main():
    sys.path.insert(0, HERE)
    import timm
    import torchvision
    from common import write
    from newcomers_blocks_policies import under_recomputing_policies
    from newcomers_split import _image_model as _image
    cases = {
        "torchvision resnet34": _image(lambda: torchvision.models.resnet34(num_classes=10)),
        "timm convnext_nano": _image(lambda: timm.create_model("convnext_nano", num_classes=10)),
        "HF Exaone4ForCausalLM": _exaone,
    }
    rows = under_recomputing_policies(cases, TOWARD, lambda plan: {
        "segments": len(plan.segments), "merged_replays": merged_replays(plan)})
    write(os.path.join(sys.argv[1], "newcomers_merge_floor.json"), {"rows": rows})


if __name__ == "__main__":
    main()
