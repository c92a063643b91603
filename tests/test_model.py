"""Model loading, layer-by-layer NVFP4 quantization and LoRA on tiny random Qwen2/Llama models."""

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear

from qerl.model import LoraSettings, enable_activation_checkpointing, load_base_model, load_policy
from qerl.nvfp4 import NVFP4WeightTensor
from qerl.quantize import DECODER_LINEARS, base_weight_bytes, count_parameters, quantize_decoder_linears

ARCHS = ["tiny-qwen2", "tiny-llama"]


def _ids(seed=0, shape=(4, 24)):
    return torch.randint(4, 100, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_decoder_linear_quantized_and_wrapped(arch):
    model, _ = load_policy(arch, "nvfp4", LoraSettings(rank=4, alpha=8), dtype="bf16")
    wrapped = {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}
    n_layers = model.config.num_hidden_layers
    assert len(wrapped) == n_layers * len(DECODER_LINEARS)
    for name, mod in wrapped.items():
        assert isinstance(mod.base_layer.weight, NVFP4WeightTensor), name
        assert not mod.base_layer.weight.requires_grad
    # lm_head, embeddings and norms stay 16-bit
    assert model.get_output_embeddings().weight.dtype == torch.bfloat16
    assert not isinstance(model.get_output_embeddings().weight, NVFP4WeightTensor)


@pytest.mark.parametrize("arch", ARCHS)
def test_only_lora_params_get_gradients(arch):
    model, _ = load_policy(arch, "nvfp4", LoraSettings(rank=4, alpha=8), dtype="fp32")
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad and not isinstance(p, NVFP4WeightTensor)}
    out = model(_ids(), labels=_ids())
    out.loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)
    assert with_grad == {n for n, p in model.named_parameters() if p.requires_grad}
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    for n, p in model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n


def test_activation_checkpointing_recomputes_layers_and_keeps_the_lora_gradients():
    """``enable_activation_checkpointing`` on the peft model: each decoder layer's MLP runs again in
    backward, the LoRA gradients are those of the plain backward, and transformers' deprecated
    ``gradient_checkpointing_enable`` is not what turned it on (no FutureWarning)."""
    model, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, alpha=8), dtype="fp32")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)  # (peft starts B at 0: A's gradient would be 0 either way)
    model.train()
    calls = []
    for layer in model.base_model.model.model.layers:  # (a pre-hook: the recompute stops early, once it
        layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # has what backward needs)

    def grads_and_mlp_calls():
        calls.clear()
        model.zero_grad(set_to_none=True)
        model(_ids(), labels=_ids()).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, len(calls)

    plain, plain_calls = grads_and_mlp_calls()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_activation_checkpointing(model)
    checkpointed, checkpointed_calls = grads_and_mlp_calls()
    assert checkpointed_calls == 2 * plain_calls > 0  # forward + the recompute in backward
    assert plain.keys() == checkpointed.keys() and all(g is not None for g in checkpointed.values())
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=1e-5, atol=1e-7, msg=n)

def test_trainable_norms_option():
    model, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, trainable_norms=True), dtype="fp32")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    norms = [n for n in trainable if "layernorm" in n]
    assert len(norms) == 2 * model.config.num_hidden_layers
    assert all("lora_" in n or "layernorm" in n for n in trainable)


def test_trainable_norms_learn_in_a_bf16_model_and_the_base_stays_reachable():
    """bf16 spacing near 1 is 2^-7: AdamW steps at lr 1e-5 on bf16 norm weights round away, every
    one. The norms train as fp32 master weights, the model still runs in bf16, and
    ``base_model_only`` (the KL reference, adapter-off evaluation) gives the untrained base back."""
    from qerl.norms import base_model_only

    model, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, trainable_norms=True), dtype="bf16", seed=3)
    base, _ = load_policy("tiny-qwen2", "nvfp4", None, dtype="bf16", seed=3)
    ids = _ids(1)
    with torch.no_grad():
        base_logits = base(ids).logits
    norms = {n: p for n, p in model.named_parameters() if p.requires_grad and "layernorm" in n}
    before = {n: p.detach().clone() for n, p in norms.items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0)
    for _ in range(5):
        out = model(ids, labels=ids)
        assert out.logits.dtype == torch.bfloat16  # the fp32 norms do not promote the activations
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(p.dtype == torch.float32 for p in norms.values())
    assert all(not torch.equal(p, before[n]) for n, p in norms.items())
    with torch.no_grad():
        for p in norms.values():  # (a few such steps move the bf16 forward; make it visible now)
            p.add_(0.05)
        with model.disable_adapter():  # LoRA off alone: the trained norms still act
            lora_off = model(ids).logits
        with base_model_only(model):
            assert torch.equal(model(ids).logits, base_logits)
        assert not torch.equal(lora_off, base_logits)
        assert all(not torch.equal(p, before[n]) for n, p in norms.items())  # restored after


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_save_reload_reproduces_logits(arch, tmp_path):
    model, _ = load_policy(arch, "nvfp4", LoraSettings(rank=4, alpha=8), dtype="fp32", seed=3)
    with torch.no_grad():  # a non-zero adapter (B starts at 0, which would make the test vacuous)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
    ids = _ids(1)
    with torch.no_grad():
        logits = model(ids).logits
        with model.disable_adapter():
            base_logits = model(ids).logits
    assert not torch.allclose(logits, base_logits)
    model.save_pretrained(tmp_path)
    fresh, _ = load_policy(arch, "nvfp4", None, dtype="fp32", seed=3)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_linear_bytes_at_most_03x_bf16(arch):
    bf16, _ = load_base_model(arch, dtype="bf16")
    q, _ = load_base_model(arch, dtype="bf16")
    quantize_decoder_linears(q)
    ratio = base_weight_bytes(q)["decoder_linears"] / base_weight_bytes(bf16)["decoder_linears"]
    assert ratio <= 0.3, ratio  # 4.5/16 = 0.281 plus one fp32 per-tensor scale per linear
    assert count_parameters(q)["total"] == count_parameters(bf16)["total"]


def test_lora_on_lm_head_keeps_it_out_of_the_decoder_linear_bytes():
    """peft's ``lm_head.base_layer`` is still the 16-bit head, not a decoder linear."""
    plain, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4), dtype="bf16")
    with_head, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, target_modules=[*DECODER_LINEARS, "lm_head"]),
                               dtype="bf16")
    assert base_weight_bytes(with_head) == base_weight_bytes(plain)


@pytest.mark.parametrize("lora", [None, LoraSettings(rank=4, alpha=8)], ids=["base", "lora"])
def test_nf4_parameter_count_is_logical(lora):
    """bitsandbytes packs an NF4 weight into N*K/2 uint8 elements; it still counts as N*K."""
    pytest.importorskip("bitsandbytes")
    nf4, _ = load_policy("tiny-qwen2", "nf4", lora, dtype="bf16")
    bf16, _ = load_policy("tiny-qwen2", "bf16", lora, dtype="bf16")
    packed = [p for p in nf4.parameters() if type(p).__name__ == "Params4bit"]
    assert len(packed) == 7 * nf4.config.num_hidden_layers  # every decoder linear, nothing else
    # QLoRA's format: NF4 codes, and double quantization (the absmax scales quantized again)
    assert all(p.quant_state.quant_type == "nf4" and p.quant_state.nested for p in packed)
    assert count_parameters(nf4)["total"] == count_parameters(bf16)["total"]
    if lora is not None:
        assert count_parameters(nf4) == count_parameters(bf16)


def test_nf4_trains_after_a_no_grad_eval_forward():
    """A rollout (eval mode, no grad) before the update, as in every RL step: bitsandbytes >= 0.50
    on AVX512-BF16 CPUs would repack the weights for a no-autograd gemv there and the training
    forward after it fail. Every LoRA tensor, also of the first layer, must get a gradient."""
    pytest.importorskip("bitsandbytes")
    model, _ = load_policy("tiny-qwen2", "nf4", LoraSettings(rank=4, alpha=8), dtype="bf16")
    model.eval()
    with torch.no_grad():
        model(_ids())
    model.train()
    model(_ids(), labels=_ids()).loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in model.named_parameters() if p.grad is not None}
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n and "layers.0." in n)


def test_params4bit_counted_by_quant_state_shape():
    """The same without bitsandbytes: a stand-in ``Params4bit`` (matched by class name, as
    ``qerl.quantize`` does) with packed storage counts its ``quant_state.shape``."""

    class Params4bit(torch.nn.Parameter):
        pass

    module = torch.nn.Module()
    module.weight = Params4bit(torch.zeros(6 * 32 // 2, 1, dtype=torch.uint8), requires_grad=False)
    module.weight.quant_state = SimpleNamespace(shape=torch.Size([6, 32]))
    module.bias = torch.nn.Parameter(torch.zeros(6))
    assert count_parameters(module) == {"trainable": 6, "total": 6 * 32 + 6}


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_next_token_distribution_close_to_bf16(arch):
    """KL(bf16 || nvfp4) of the next-token distribution, averaged over positions.

    Measured on these tiny models (3 seeds each): 0.024-0.032 nats. The bound 0.06 (about 2x the
    measurement) is justified against a control: Gaussian noise with the same relative weight error
    (9.5%) on the same linears gives a KL of the same order, so NVFP4 costs no more than its weight
    error implies, and a broken quantizer (wrong nibble order, missing scale) gives KL > 0.5.
    """
    ref, _ = load_base_model(arch, dtype="bf16", seed=0)
    q, _ = load_base_model(arch, dtype="bf16", seed=0)
    quantize_decoder_linears(q)
    noisy, _ = load_base_model(arch, dtype="bf16", seed=0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in noisy.named_parameters():
            if name.rsplit(".", 2)[-2] in DECODER_LINEARS:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.095 * p.float().norm() / p.numel() ** 0.5)
    ids = _ids(0, (8, 32))

    def kl(a, b):
        with torch.no_grad():
            lp, lq = F.log_softmax(a(ids).logits.float(), -1), F.log_softmax(b(ids).logits.float(), -1)
        return (lp.exp() * (lp - lq)).sum(-1).mean().item()

    kl_q, kl_noise = kl(ref, q), kl(ref, noisy)
    assert kl_q < 0.06, (kl_q, kl_noise)
    assert kl_q < 2.0 * kl_noise, (kl_q, kl_noise)


def test_unknown_model_path_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load model"):
        load_base_model(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_base_model(str(tmp_path / "missing.gguf"))
    # a folder that is no model: said at once, not through a tokenizer error cut off mid-sentence
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the folder has no config.json: not a Hugging Face model folder"):
        load_base_model(str(tmp_path / "empty"))
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="a peft adapter folder .give it as model.adapter_path"):
        load_base_model(str(tmp_path / "adapter"))
    # a file of a model folder (config.json, model.safetensors): named as such, not as a malformed hub id
    with pytest.raises(ValueError, match="a file that is not a .gguf; give the model's folder"):
        load_base_model(str(tmp_path / "adapter" / "adapter_config.json"))


def test_misspelled_lora_target_beside_a_matching_one_is_refused():
    """peft drops a target that matches nothing when another one matches: q_proj alone would train."""
    with pytest.raises(ValueError, match=r"^model.lora.target_modules: no module named 'donw_proj' in the model "
                                         r"\(adapted: q_proj\)$"):
        load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, target_modules=["q_proj", "donw_proj"]))
    # suffixes with a path and lm_head (not a decoder linear) are names peft matches: accepted
    load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, target_modules=["model.layers.0.mlp.down_proj", "lm_head"]))


def test_unknown_quantization_rejected():
    with pytest.raises(ValueError, match="unknown quantization"):
        load_policy("tiny-qwen2", "int3")


def test_bitsandbytes_kernels_hub_warning_is_filtered():
    """bitsandbytes' import-time search for Hugging Face's `kernels` meets this repository's kernels/
    and warns on every run; the path it wanted is off in qerl, so the line is dropped (others pass)."""
    import logging

    import qerl  # noqa: F401  (installs the filter)

    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    make = lambda msg: logging.LogRecord(bnb.name, logging.WARNING, __file__, 1, msg, None, None)  # noqa: E731
    assert not bnb.filter(make("Failed to load CPU gemm_4bit_forward from kernels-community: cannot import"))
    assert bnb.filter(make("some other bitsandbytes warning"))


def test_models_qerl_cannot_quantize_whole_and_folders_without_a_tokenizer_fail_clearly(tmp_path):
    """A decoder with fused projections (Phi-3's qkv_proj / gate_up_proj) would be quantized and
    adapted in part, silently; a folder written by save_pretrained without tokenizer files gave an
    empty tokenizer and a reshape error deep in the first forward."""
    from transformers import Phi3Config, Phi3ForCausalLM

    from qerl.model import load_tokenizer
    from qerl.quantize import check_decoder_linears

    phi3 = Phi3ForCausalLM(Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, pad_token_id=0))
    with pytest.raises(ValueError, match="layer 0 has no q_proj, k_proj, v_proj, gate_proj, up_proj"):
        check_decoder_linears(phi3)
    phi3.save_pretrained(tmp_path / "phi3")  # config + weights, no tokenizer files
    with pytest.raises(ValueError, match="cannot load model"):
        load_tokenizer(str(tmp_path / "phi3"))
    with pytest.raises(ValueError, match="cannot load model"):
        load_policy(str(tmp_path / "phi3"), "nvfp4", None)


def test_a_local_folder_with_truncated_weights_says_so(tmp_path):
    """It was told it was 'not a tiny model name, a local model directory, ...', which it is."""
    from qerl.export import export_bf16

    out = export_bf16(*load_policy("tiny-qwen2", "bf16", None, dtype="bf16"), tmp_path / "m")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"^cannot load model '.*': the folder's config, weights or tokenizer could "
                                         r"not be read \(.*\)$"):
        load_policy(str(out), "nvfp4", None)


def test_mixture_of_experts_is_refused_and_only_the_decoder_linears_are_quantized():
    """Qwen2-MoE's shared expert has gate/up/down_proj: a search by short name took it for the MLP,
    and the router and the routed experts' fused 3-D weights stayed 16-bit without LoRA, silently."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from qerl.quantize import check_decoder_linears, quantize_decoder_linears_nf4

    moe = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32))
    with pytest.raises(ValueError, match=r"layer 0 has no gate_proj, up_proj, down_proj linear\(s\) and weights "
                                         r"qerl would leave 16-bit without LoRA \(mlp\.gate\.weight, mlp\.experts\."
                                         r".*mixture-of-experts"):
        check_decoder_linears(moe)
    for quantize, kind in [(quantize_decoder_linears, NVFP4WeightTensor), (quantize_decoder_linears_nf4, None)]:
        model, _ = load_base_model("tiny-qwen2", dtype="fp32")
        mlp = model.model.layers[1].mlp
        extra = {n: torch.nn.Linear(64, 64) for n in ("gate_proj", "up_proj", "down_proj")}
        mlp.shared_expert = torch.nn.ModuleDict(extra)
        mlp.shared_expert_gate = torch.nn.Linear(64, 1, bias=False)  # as in Qwen2-MoE
        with pytest.raises(ValueError, match=r"layer 1 has weights qerl would leave 16-bit without LoRA "
                                             r"\(mlp\.shared_expert\.gate_proj\.weight, .* and 1 more\)"):
            check_decoder_linears(model)
        assert quantize(model) == model.config.num_hidden_layers * len(DECODER_LINEARS)
        for name in ("gate_proj", "up_proj", "down_proj"):  # the MLP's own linears, the extra ones left alone
            assert type(extra[name]) is torch.nn.Linear and type(extra[name].weight) is torch.nn.Parameter
            quantized = getattr(mlp, name)
            assert isinstance(quantized.weight, kind) if kind else type(quantized).__name__ == "Linear4bit", name


@pytest.mark.parametrize("arm", ["nvfp4", "nf4"])
def test_non_finite_weight_is_an_error_naming_the_linear(arm):
    """One inf would be the per-tensor scale of all of q/k/v: every logit NaN, without a word. In nf4
    it is its block's absmax and, double-quantized, the offset of every block: the linear all NaN
    (while the logits of the tiny model still came out finite)."""
    from qerl.quantize import quantize_decoder_linears_nf4

    quantize = quantize_decoder_linears if arm == "nvfp4" else quantize_decoder_linears_nf4
    for where, value, counts in [("0.self_attn.q_proj", "inf", "1 inf, 0 nan"), ("1.mlp.up_proj", "nan", "0 inf, 1 nan")]:
        model, _ = load_base_model("tiny-qwen2", dtype="bf16")
        with torch.no_grad():
            model.get_submodule(f"model.layers.{where}").weight[2, 3] = float(value)
        message = rf"^model\.layers\.{where}: weight has non-finite values \({counts}\): cannot quantize$"
        with pytest.raises(ValueError, match=message):
            quantize(model)


def test_nf4_without_bitsandbytes_is_a_module_not_found_error(monkeypatch):
    """train.py prints ModuleNotFoundError as one line (a plain ImportError was a traceback)."""
    import sys

    from qerl.quantize import quantize_decoder_linears_nf4

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ModuleNotFoundError, match="nf4 needs bitsandbytes"):
        quantize_decoder_linears_nf4(torch.nn.Module())


def test_a_prequantized_checkpoint_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    """qerl.export's own NVFP4 output (compressed-tensors) as the base crashed deep in quantization
    (``'Linear' object has no attribute 'weight'``): any checkpoint with a ``quantization_config``
    is one ValueError naming its method, a local folder's before any weight loads, a hub id's
    (whose config is seen only by from_pretrained) right after."""
    import json
    import re

    from transformers import AutoModelForCausalLM

    import qerl.model
    from qerl.export import export_nvfp4

    out = export_nvfp4(*load_policy("tiny-qwen2", "nvfp4", None, dtype="bf16"), tmp_path / "nvfp4")
    message = (rf"^cannot load model '{re.escape(str(out))}': it is a {{}} \(pre-quantized\) checkpoint, which "
               r"cannot be the trained base; use the original model, or a bf16 export of it .*--format bf16\)$")
    original = (out / "config.json").read_text()
    with monkeypatch.context() as m:
        m.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded the weights"))
        for method in ("compressed-tensors", "gptq"):
            config = json.loads(original)
            config["quantization_config"]["quant_method"] = method
            (out / "config.json").write_text(json.dumps(config))
            for quantization in ("nvfp4", "bf16"):
                with pytest.raises(ValueError, match=message.format(re.escape(method))):
                    load_policy(str(out), quantization, None)
    (out / "config.json").write_text(original)
    monkeypatch.setattr(qerl.model, "_local_quantization_config", lambda source: None)  # as for a hub id
    with pytest.raises(ValueError, match=message.format("compressed-tensors")):
        load_base_model(str(out))


def test_misspelled_and_impossible_model_names_fail_without_a_hub_lookup(tmp_path, monkeypatch):
    """A misspelled tiny model, a path that does not exist or a name that is no hub id went to the
    hub, which retries for most of a minute offline: they fail at once; hub ids (``owner/name``, and
    legacy single-segment ones such as ``gpt2``) still go there, and ``~`` is expanded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.model import load_tokenizer

    class HubLookup(Exception):
        pass

    def from_pretrained(source, **kwargs):
        raise HubLookup(source)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    cases = {
        "tiny-qwen": r"^unknown built-in model 'tiny-qwen': did you mean 'tiny-qwen2'\? "
                     r"\(built-in: tiny-qwen2, tiny-llama\)$",
        "tiny-lama": r"did you mean 'tiny-llama'\?",
        "tiny-gpt": r"^unknown built-in model 'tiny-gpt' \(built-in: tiny-qwen2, tiny-llama\)$",
        "qwen2.5-7b": r"^cannot load model 'qwen2.5-7b': no such local file or directory, and not a Hugging Face "
                      r"id \(owner/name",
        "Qwen2.5-7B-Instruct": "and not a Hugging Face id",
        "models/qwen/7b": "and not a Hugging Face id",
        str(tmp_path / "no-such-model"): "no such file or directory$",
        "./no-such-model": "^cannot load model './no-such-model': no such file or directory$",
        "~/no-such-model": "no such file or directory$",
    }
    for name, message in cases.items():
        for load in (load_tokenizer, load_base_model):
            with pytest.raises(ValueError, match=message):
                load(name)
    for hub_id in ("Qwen/Qwen2.5-7B-Instruct", "gpt2", "bert-base-uncased"):
        for load in (load_tokenizer, load_base_model):
            with pytest.raises(HubLookup):
                load(hub_id)
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")  # a model folder (an empty one is refused)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(HubLookup) as found:
        load_tokenizer("~/models/m")
    assert found.value.args[0] == str(tmp_path / "models" / "m")
