"""The command line on models of today: torchvision:NAME, timm:NAME and hf:MODEL."""

import json

import pytest
import torch

from superneurons.cli.main import main
from superneurons.cli.today import _images, build, settings

# GPT-2's graph at a size a CPU test trains in a second
TINY_GPT2 = ["--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2",
             "--set", "vocab_size=128", "--set", "n_positions=64"]


def test_plan_of_a_torchvision_model_names_it_and_writes_its_inputs(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "torchvision:resnet18", "--batch", "2", "--image", "32",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "torchvision:resnet18, input (2, 3, 32, 32)" in printed
    record = json.loads(out.read_text())
    assert record["inputs"] == "input (2, 3, 32, 32)" and "input_shape" not in record
    peaks = {p: record["policies"][p]["peak_bytes"] for p in record["policies"]}
    assert peaks["superneurons"] < peaks["baseline"]


def test_plan_of_an_hf_decoder_takes_its_config_fields_and_sequence(capsys, recwarn):
    assert main(["plan", "hf:gpt2", "--batch", "2", "--seq", "16", *TINY_GPT2]) == 0
    printed = capsys.readouterr().out
    assert "hf:gpt2, 2 x 16 tokens" in printed
    # the planner's warning that offload acts as liveness without convolutions: a note, once
    assert printed.count("note: policy 'offload'") == 1 and not recwarn.list


def test_plan_of_a_timm_model_under_bf16(capsys):
    assert main(["plan", "timm:resnet18", "--batch", "2", "--image", "32", "--bf16"]) == 0
    assert "timm:resnet18, input (2, 3, 32, 32), bf16 autocast" in capsys.readouterr().out


def test_an_hf_budget_too_small_names_the_smallest_that_works(capsys):
    assert main(["plan", "hf:gpt2", "--batch", "2", "--seq", "16", *TINY_GPT2,
                 "--budget", "1KiB"]) == 2
    assert "needs at least" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["hf:no_such_type"], "no model type 'no_such_type'"),
    (["timm:no_such_model"], "timm has no model 'no_such_model'"),
    (["torchvision:no_such_model"], "torchvision:no_such_model is not one of torchvision's"),
    (["resnet50", "--seq", "8"], "--seq and --set apply to"),
    (["torchvision:resnet18", "--set", "3=4"], "--set takes KEY=VALUE"),
    (["hf:vit"], "no causal, masked or sequence-to-sequence language-model head"),
    (["hf:gpt2", "--set", "n_layers=2"], "has no field n_layers"),
    (["hf:gpt2", "--set", "to_dict=3"], "--set to_dict: not fields"),
    (["torchvision:fcn_resnet50"], "not one of torchvision's classification models"),
    (["torchvision:resnet18", "--depth", "50"], "--depth applies to the paper's networks"),
    (["hf:gpt2", "--set", "vocab_size=0"], "--set a vocab_size of 1 or more"),
    (["torchvision:resnet18", "--batch", "1", "--image", "32"], "a batch of 2 or more"),
    (["hf:gemma3", "--set", "num_hidden_layers=2"], "--set text_config="),
    (["hf:gpt2", "--set", "n_layer='two'"], "refuses --set n_layer"),
    (["hf:./no_such_directory"], "no configuration could be read"),
    (["hf:gpt2", "--seq", "2048"], "at most 1024 tokens a sequence"),
    (["torchvision:resnet18", "--seq", "16"], "--seq does not apply to torchvision:resnet18"),
    (["hf:phi3", "--set", "vocab_size=100"], "building hf:phi3 failed (AssertionError"),
    (["torchvision:resnet18", "--set", "colour=1"], "building torchvision:resnet18 failed"),
])
def test_a_model_it_cannot_build_is_said_before_any_work(argv, said, capsys):
    assert main(["plan", *argv, *([] if "--batch" in argv else ["--batch", "2"])]) == 2
    assert said in capsys.readouterr().err


def test_a_name_of_no_source_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "vit_b_16", "--batch", "2"])
    assert "torchvision:NAME, timm:NAME or hf:MODEL" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--seq", "0"), ("--image", "-32"), ("--batch", "0")])
def test_a_count_below_one_is_refused_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit):
        main(["plan", "hf:gpt2" if flag == "--seq" else "torchvision:resnet18", "--batch", "2",
              flag, value])
    assert "must be a whole number, 1 or more" in capsys.readouterr().err


def test_the_library_refuses_a_count_below_one_too():
    with pytest.raises(ValueError, match="--seq must be at least 1"):
        build("hf:gpt2", 2, "meta", seq=0, options=settings(TINY_GPT2[1::2]))


def test_settings_read_literals_and_keep_strings():
    assert settings(["a=4", "b=0.5", "c=True", "d=None", "e=gelu_new"]) == \
        {"a": 4, "b": 0.5, "c": True, "d": None, "e": "gelu_new"}


def test_inputs_are_each_ranks_own_and_the_weights_the_same():
    def made(rank):
        torch.manual_seed(0)
        return build("hf:gpt2", 2, "cpu", seq=8, options=settings(TINY_GPT2[1::2]),
                     inputs_seed=1 + rank)
    first, second = made(0), made(1)
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(),
                                                 second.model.parameters()))
    assert not torch.equal(first.kwargs["input_ids"], second.kwargs["input_ids"])
    assert first.kwargs["use_cache"] is False and first.items == 16


def test_train_of_an_hf_decoder_reports_tokens_a_second(capsys):
    assert main(["train", "hf:gpt2", "--batch", "2", "--seq", "16", *TINY_GPT2,
                 "--steps", "2", "--device", "cpu", "--policy", "recompute"]) == 0
    printed = capsys.readouterr().out
    assert "tokens per second" in printed and "hf:gpt2, 2 x 16 tokens" in printed
    loss = float(printed.split("final loss")[1].split("│")[1])
    assert loss == loss and 0 < loss < 20


def test_the_loss_of_a_model_with_auxiliary_heads_reads_its_main_logits():
    # googlenet and inception_v3 return their auxiliary logits beside the main ones in training
    named = _images(torch.nn.Identity(), 2, (10,), 10, torch.device("cpu"))
    logits, auxiliary = torch.randn(2, 10), torch.randn(2, 10)
    assert torch.equal(named.loss((logits, auxiliary)), named.loss(logits))


def test_train_with_the_models_state_on_the_host(capsys):
    assert main(["train", "hf:gpt2", "--batch", "2", "--seq", "16", *TINY_GPT2,
                 "--steps", "2", "--device", "cpu", "--state", "host",
                 "--optimizer", "adamw"]) == 0
    printed = capsys.readouterr().out
    assert "│ host, " in printed and "AdamW" in printed


def test_a_builder_that_computes_while_it_builds_is_planned_from_the_cpu(capsys):
    # torchvision's RegNets size their stages with tensor arithmetic, which the meta device
    # cannot run
    assert main(["plan", "torchvision:regnet_x_400mf", "--batch", "2", "--image", "32"]) == 0
    assert "torchvision:regnet_x_400mf" in capsys.readouterr().out


def test_an_encoder_decoder_plans_with_its_labels_shifted_in(capsys):
    assert main(["plan", "hf:t5", "--batch", "2", "--seq", "16", "--set", "num_layers=1",
                 "--set", "d_model=32", "--set", "d_ff=64", "--set", "num_heads=2",
                 "--set", "d_kv=16", "--set", "vocab_size=128"]) == 0
    assert "hf:t5, 2 x 16 tokens" in capsys.readouterr().out


def test_plan_with_the_state_on_the_host_needs_less_device_memory(tmp_path, capsys):
    peaks = {}
    for state in ("device", "host"):
        out = tmp_path / f"{state}.json"
        assert main(["plan", "hf:gpt2", "--batch", "2", "--seq", "16", *TINY_GPT2,
                     "--state", state, "--json", str(out)]) == 0
        peaks[state] = json.loads(out.read_text())["policies"]["superneurons"]["peak_bytes"]
    assert "state on the host" in capsys.readouterr().out
    assert peaks["host"] < peaks["device"]


def test_a_legacy_hf_field_is_read_into_its_new_one():
    # Llama's configuration reads rope_theta into rope_parameters: not refused as unknown
    named = build("hf:llama", 1, "meta", seq=8, options=settings(
        ["num_hidden_layers=1", "hidden_size=32", "intermediate_size=64",
         "num_attention_heads=2", "num_key_value_heads=2", "vocab_size=64", "rope_theta=5e5"]))
    assert named.model.config.rope_parameters["rope_theta"] == 5e5
    # so is a property with a setter (torch_dtype sets dtype)
    assert build("hf:llama", 1, "meta", seq=8, options=settings(
        ["num_hidden_layers=1", "hidden_size=32", "intermediate_size=64",
         "num_attention_heads=2", "num_key_value_heads=2", "vocab_size=64",
         "torch_dtype='float32'"])).model.config.dtype == torch.float32


def test_a_masked_lm_from_a_configurations_directory(tmp_path, capsys):
    from transformers import BertConfig
    BertConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
               num_attention_heads=2, vocab_size=64).save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["plan", f"hf:{tmp_path}", "--batch", "2", "--seq", "8", "--state", "host",
                 "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["inputs"] == "2 x 8 tokens" and record["state"] == "host"
    named = build(f"hf:{tmp_path}", 2, "meta", seq=8, options={"num_hidden_layers": 2})
    assert type(named.model).__name__ == "BertForMaskedLM"
    assert named.model.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="has no field num_layers"):  # a typo, not dropped
        build(f"hf:{tmp_path}", 2, "meta", seq=8, options={"num_layers": 2})


def test_a_timm_image_size_given_to_its_builder_sizes_the_inputs():
    named = build("timm:vit_tiny_patch16_224", 1, "meta", options={"img_size": 32})
    assert named.inputs == "input (1, 3, 32, 32)"
