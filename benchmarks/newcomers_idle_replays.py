"""Two models nobody here wrote, under the CPU's bf16 autocast, where a plan may replay a layer
whose output a kept layer views or writes in place (a replay that frees nothing, planner/trim.py):
HF GPTBigCodeForCausalLM (multi-query attention) and timm mobilevitv2_050 (convolutions and
attention over unfolded patches). "superneurons" and "recompute" at 50% and 75% of the way from
each floor to the liveness peak; per run, the segments that free nothing in the plan the step
ran and in every plan its trial may time, and 3 AdamW steps beside plain PyTorch, compared bit
for bit (losses and state). Planner and runtime of whichever tree is on PYTHONPATH. --more
runs two more models instead: HF ConvNextV2ForImageClassification and timm resmlp_12_224
(writes newcomers_idle_replays_more.json).

    PYTHONPATH=TREE:benchmarks python benchmarks/newcomers_idle_replays.py OUT_DIR [--more]
        (writes OUT_DIR/newcomers_idle_replays.json)
"""

import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _bigcode():
    import torch
    import transformers
    config = transformers.GPTBigCodeConfig(vocab_size=1000, n_positions=128, n_embd=64,
                                           n_layer=2, n_head=4, multi_query=True)
    ids = torch.randint(0, 1000, (4, 96), generator=torch.Generator().manual_seed(0))
    return transformers.GPTBigCodeForCausalLM(config).train(), (), \
        dict(input_ids=ids, labels=ids, use_cache=False), lambda out: out.loss


def _mobilevit():
    import timm
    import torch
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))
    return timm.create_model("mobilevitv2_050", num_classes=10).train(), (x,), {}, \
        lambda out: torch.nn.functional.cross_entropy(out, y)


def _convnextv2():
    import torch
    import transformers
    config = transformers.ConvNextV2Config(num_channels=3, hidden_sizes=[16, 32, 48, 64],
                                           depths=[1, 1, 2, 1], num_labels=10)
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))
    return transformers.ConvNextV2ForImageClassification(config).train(), (), \
        dict(pixel_values=x, labels=y), lambda out: out.loss


def _resmlp():
    import timm
    import torch
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(1))
    return timm.create_model("resmlp_12_224", num_classes=10, img_size=64).train(), (x,), {}, \
        lambda out: torch.nn.functional.cross_entropy(out, y)


MODELS = (("HF GPTBigCodeForCausalLM", _bigcode), ("timm mobilevitv2_050", _mobilevit))
MORE = (("HF ConvNextV2ForImageClassification", _convnextv2), ("timm resmlp_12_224", _resmlp))


def idle_segments(plan, saving_inside: bool = False) -> int:
    """Segments none of whose made storages the plan frees (policy Rule 4 keeps them); with
    ``saving_inside``, those of them with a layer that saves tensors of its own (an autocast
    cast), which the replay does free."""
    from superneurons.planner import Action
    graph, count = plan.graph, 0
    for segment in plan.segments:
        inside = set(segment.layers)
        made = {graph.values[v].storage for l in segment.layers for v in graph.layers[l].outputs
                if graph.storages[graph.values[v].storage].creator in inside}
        count += all(plan.actions[s] is not Action.RECOMPUTE for s in made) and (
            not saving_inside or any(graph.layers[l].internal_saved_bytes for l in inside))
    return count


def rows(models) -> list:
    import torch
    import superneurons as sn
    from common import cpu_bf16_steps
    out = []
    for name, build in models:
        torch.manual_seed(0)
        base, args, kwargs, loss_of = build()
        liveness = sn.plan(base, args, policy="liveness", autocast=torch.bfloat16,
                           device_type="cpu", kwargs=kwargs).peak_bytes
        reference = copy.deepcopy(base)
        plain = cpu_bf16_steps(reference, lambda: loss_of(reference(*args, **kwargs)))
        for policy in ("superneurons", "recompute"):
            floor = sn.plan(base, args, policy=policy, autocast=torch.bfloat16,
                            device_type="cpu", kwargs=kwargs).peak_bytes
            for toward in (0.5, 0.75):
                model = copy.deepcopy(base)
                wrapped = sn.wrap(model, policy=policy,
                                  budget=floor + int(toward * (liveness - floor)))
                losses = cpu_bf16_steps(model, lambda: loss_of(wrapped(*args, **kwargs)))
                with torch.autocast("cpu", dtype=torch.bfloat16):      # the step's plan
                    plan, _ = wrapped.plan_for(*args, **kwargs)
                out.append({
                    "model": name, "policy": policy, "toward": toward,
                    "losses_equal": losses == plain,
                    "state_equal": all(torch.equal(a, b) for a, b in zip(
                        model.state_dict().values(), reference.state_dict().values())),
                    "replayed_layers": wrapped.stats.recomputed_layers,
                    "segments": len(plan.segments), "idle_segments": idle_segments(plan),
                    "idle_saving_inside": idle_segments(plan, saving_inside=True),
                    "idle_segments_in_alternatives": [idle_segments(p)
                                                      for p in plan.alternatives]})
                print(out[-1], flush=True)
    return out


def main():
    sys.path.insert(0, HERE)
    from common import write
    more = "--more" in sys.argv[2:]
    write(os.path.join(sys.argv[1], "newcomers_idle_replays_more.json" if more else
                       "newcomers_idle_replays.json"), {"rows": rows(MORE if more else MODELS)})


if __name__ == "__main__":
    main()
