"""Models nobody here wrote, trained at budgets where a few blocks replayed whole cost less than
many cheap layers (planner/trim.py: every block replayed, the least useful then not replayed at
all): torchvision mnasnet1_0 and regnet_y_400mf, timm mobilevitv2_050, HF Qwen3ForCausalLM from
a small config, with dropout. 3 AdamW steps under "superneurons" and "recompute" at 50% and 75%
of the way from the policy's floor to the liveness peak, compared with plain PyTorch bit for bit
(tests/matrix.py), on the CPU; the record keeps how many of the chosen plan's replays hold a
convolution, matrix product or attention (blocks replayed whole) and how many segments it has.

    python benchmarks/newcomers_trimmed_blocks.py OUT_DIR  (writes newcomers_trimmed_blocks.json)
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOWARD = (0.5, 0.75)


def main():
    sys.path.insert(0, HERE)
    import timm
    import torchvision
    from common import write
    from newcomers_blocks_policies import under_recomputing_policies
    from newcomers_split import _image_model as _image
    from newcomers_decoder_blocks import _hf
    from superneurons.planner.policy import CHECKPOINT_KINDS

    def whole_replays(plan) -> int:
        return sum(any(plan.graph.layers[l].kind in CHECKPOINT_KINDS for l in s.layers)
                   for s in plan.segments)
    cases = {
        "torchvision mnasnet1_0": _image(lambda: torchvision.models.mnasnet1_0(num_classes=10)),
        "torchvision regnet_y_400mf": _image(
            lambda: torchvision.models.regnet_y_400mf(num_classes=10)),
        "timm mobilevitv2_050": _image(
            lambda: timm.create_model("mobilevitv2_050", num_classes=10)),
        "HF Qwen3ForCausalLM": _hf("Qwen3Config", "Qwen3ForCausalLM", hidden_size=48,
                                   intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                   max_position_embeddings=128, attention_dropout=0.1),
    }
    rows = under_recomputing_policies(cases, TOWARD, lambda plan: {
        "segments": len(plan.segments), "replays_with_checkpoint_kinds": whole_replays(plan)})
    write(os.path.join(sys.argv[1], "newcomers_trimmed_blocks.json"), {"rows": rows})


if __name__ == "__main__":
    main()
