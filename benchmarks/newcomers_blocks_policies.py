"""Models nobody here wrote, under both recomputing policies the planner's whole-block plans
serve ("superneurons", "recompute"), at budgets 5% and 30% of the way from each policy's floor
to the liveness peak: 3 AdamW steps each against plain PyTorch, bit for bit (tests/matrix.py),
on the CPU; what moved, and how many FC, attention and convolution layers the plan replays.

    python benchmarks/newcomers_blocks_policies.py OUT_DIR

writes OUT_DIR/newcomers_blocks_policies.json.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def under_recomputing_policies(cases: dict, towards: tuple, described) -> list:
    """Each of ``cases`` (name -> build, tests/today_models.py's shape) under "superneurons"
    and "recompute", at each of ``towards`` of the way from the policy's floor to the liveness
    peak: 3 AdamW steps against plain PyTorch (matrix.compare). A row per run, with what
    ``described(plan)`` says of the plan the wrapper ran."""
    sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
    import superneurons as sn
    import matrix
    made = []
    wrap = matrix.sn.wrap
    matrix.sn.wrap = lambda *a, **k: made.append(wrap(*a, **k)) or made[-1]
    rows = []
    try:
        for name, build in cases.items():
            build.__qualname__ = name
            model, args, kwargs, _ = build()
            liveness = sn.plan(model, args, policy="liveness", kwargs=kwargs,
                               device_type="cpu").peak_bytes
            for policy in ("superneurons", "recompute"):
                floor = sn.plan(model, args, policy=policy, kwargs=kwargs,
                                device_type="cpu").peak_bytes
                for toward in towards:
                    budget = floor + int(toward * (liveness - floor))
                    outcome = matrix.compare(build, policy, steps=3, optimizer="adamw",
                                             budget=budget)
                    plan, _ = made[-1].plan_for(*args, **kwargs)
                    rows.append({"model": name, "policy": policy, "toward": toward,
                                 "budget_bytes": budget, "status": outcome.status,
                                 "replayed_layers": outcome.stats["recomputed_layers"],
                                 "offloaded_bytes": outcome.stats["offloaded_bytes"],
                                 **described(plan)})
                    print(rows[-1], flush=True)
    finally:
        matrix.sn.wrap = wrap
    return rows


def main():
    sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
    import torch
    import timm
    from common import write
    from newcomers_decoder_blocks import _hf
    from superneurons.planner.policy import CHECKPOINT_KINDS

    def deit():
        torch.manual_seed(0)
        model = timm.create_model("deit_tiny_patch16_224", img_size=64, patch_size=8,
                                  num_classes=10, drop_path_rate=0.1).train()
        x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
        return model, (x,), {}, lambda out: torch.nn.functional.cross_entropy(out, y)
    cases = {
        "HF OPTForCausalLM": _hf("OPTConfig", "OPTForCausalLM", hidden_size=48, ffn_dim=128,
                                num_hidden_layers=4, num_attention_heads=4,
                                max_position_embeddings=128, word_embed_proj_dim=48,
                                dropout=0.1),
        "HF Phi3ForCausalLM": _hf("Phi3Config", "Phi3ForCausalLM", hidden_size=48,
                                 intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128, pad_token_id=0),
        "timm deit_tiny_patch16_224": deit}
    rows = under_recomputing_policies(cases, (0.05, 0.3), lambda plan: {
        "replayed_checkpoint_kinds": sum(plan.graph.layers[l].kind in CHECKPOINT_KINDS
                                         for l in plan.segment_of())})
    write(os.path.join(sys.argv[1], "newcomers_blocks_policies.json"), {"rows": rows})


if __name__ == "__main__":
    main()
