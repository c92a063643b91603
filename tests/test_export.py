"""Export: the NVFP4A16 compressed-tensors checkpoint (checked against compressed-tensors' own
decompressor and config objects, and transformers' compressed-tensors loader), the dense bf16
checkpoint, the adapter, and the CLI."""

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from qerl.adapter import BASE_FILE, is_dequantized_base
from qerl.export import (
    ADAPTER_SUBDIR,
    TRAINABLE_NORMS_FILE,
    export_adapter,
    export_bf16,
    export_nvfp4,
    hf_name,
    load_adapter,
    load_adapter_into,
)
from qerl.export_cli import main
from qerl.lora_forward import compute_in_activation_dtype
from qerl.model import LoraSettings, load_base_model, load_policy, load_tokenizer
from qerl.nvfp4 import NVFP4WeightTensor, dequantize_nvfp4
from qerl.quantize import DECODER_LINEARS, SHARED_SCALE_GROUPS, decoder_layers, quantize_decoder_linears

ROOT = Path(__file__).resolve().parents[1]
SEED = 1


def _ids(seed=0, shape=(2, 12)):
    return torch.randint(4, 100, shape, generator=torch.Generator().manual_seed(seed))


def _trained_lora_policy(arch="tiny-qwen2", dtype="bf16", quantization="nvfp4"):
    """An NVFP4 (or ``quantization``) policy with a non-zero adapter and moved (trainable) norms, as after training."""
    model, tok = load_policy(arch, quantization, LoraSettings(rank=4, alpha=8, trainable_norms=True), dtype=dtype,
                             seed=SEED)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif p.requires_grad and "lora_" not in n:  # the trainable norms (fp32 master weights)
                moved = p + torch.randn(p.shape, generator=gen) * 0.1
                # at values of the model dtype: the 16-bit exports and the engines hold the rounded
                # scale, so the exact logit comparisons below need representable ones
                p.copy_(moved.to(model.get_input_embeddings().weight.dtype))
    return model, tok


def _nvfp4_weights(model):
    """HF module prefix -> NVFP4WeightTensor."""
    return {hf_name(n.rsplit(".", 1)[0]): p for n, p in model.named_parameters() if isinstance(p, NVFP4WeightTensor)}


@pytest.fixture(scope="module", params=["tiny-qwen2+lora", "tiny-llama"])
def nvfp4_export(request, tmp_path_factory):
    """(model, export dir): a peft-wrapped Qwen2 with trained adapter + norms, and a plain Llama."""
    arch, _, lora = request.param.partition("+")
    model, tok = _trained_lora_policy(arch) if lora else load_policy(arch, "nvfp4", None, dtype="bf16", seed=SEED)
    out = export_nvfp4(model, tok, tmp_path_factory.mktemp("nvfp4"))
    return model, out


def _ulp_distance_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.dtype == b.dtype == torch.bfloat16
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    same_sign = (a.sign() == b.sign()) | (a == 0) | (b == 0)
    assert same_sign.all()
    return int(((ai & 0x7FFF) - (bi & 0x7FFF)).abs().max())


def test_layout_and_compressed_tensors_decoder(nvfp4_export):
    """Tensor names/dtypes/shapes of vllm.md §1.2, and compressed-tensors' NVFP4 decompressor
    decodes them to our dequantize(): bit-exact codes and block scales; the decoded weights agree to
    <= 1 bf16 ulp (exact on these models) and <= 2 fp32 ulp (CT divides by 1/pts, we multiply by pts)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    model, out = nvfp4_export
    sd = load_file(out / "model.safetensors")
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    weights = _nvfp4_weights(model)
    assert len(weights) == model.config.num_hidden_layers * len(DECODER_LINEARS)
    exact = True
    for prefix, w in weights.items():
        n, k = w.shape
        packed, scale, gscale = (sd[f"{prefix}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale"))
        assert f"{prefix}.weight" not in sd
        assert (packed.dtype, tuple(packed.shape)) == (torch.uint8, (n, k // 2))
        assert (scale.dtype, tuple(scale.shape)) == (torch.float8_e4m3fn, (n, k // 16))
        assert (gscale.dtype, tuple(gscale.shape)) == (torch.float32, (1,))
        assert torch.equal(packed, w.qdata) and torch.equal(scale.view(torch.uint8), w.scale.view(torch.uint8))
        assert gscale.item() == pytest.approx(1 / w.per_tensor_scale.item(), rel=1e-7)  # divisor convention
        state = NVFP4PackedCompressor.decompress({"weight_packed": packed, "weight_scale": scale,
                                                  "weight_global_scale": gscale}, scheme)
        ours = w.dequantize(torch.bfloat16)
        assert _ulp_distance_bf16(state["weight"], ours) <= 1, prefix
        exact &= torch.equal(state["weight"], ours)
        ct32 = dequantize(unpack_fp4_from_uint8(packed, n, k, torch.float32), scale.float(), args=scheme.weights,
                          global_scale=gscale, dtype=torch.float32)
        torch.testing.assert_close(ct32, w.dequantize(torch.float32), rtol=2**-22, atol=0)
    assert exact  # bf16-exact on these seeded models (the contract above is <= 1 ulp)


def test_quantization_config_matches_compressed_tensors(nvfp4_export, tmp_path):
    """config.json's quantization_config equals what compressed-tensors itself emits for preset
    NVFP4A16 (ModelCompressor.update_config), field by field, and parses to the same object."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    _, out = nvfp4_export
    config = json.loads((out / "config.json").read_text())
    ours = config["quantization_config"]
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    scheme.format = "nvfp4-pack-quantized"
    ref_cfg = QuantizationConfig(config_groups={"group_0": scheme}, format="nvfp4-pack-quantized",
                                 ignore=["lm_head"], quantization_status="compressed")
    ModelCompressor(quantization_config=ref_cfg).update_config(str(tmp_path))
    emitted = json.loads((tmp_path / "config.json").read_text())["quantization_config"]

    def check(ref, got, path):
        for key, val in ref.items():
            if key in ("version", "moe_sparsity_config") and path == "":  # version-specific extras
                continue
            assert key in got, f"{path}{key}"
            if isinstance(val, dict) and val:
                check(val, got[key], f"{path}{key}.")
            else:
                assert got[key] == val, f"{path}{key}: {got[key]!r} != {val!r}"

    check(emitted, ours, "")
    assert ours["quant_method"] == "compressed-tensors" and ours["version"]
    calibration_only = {"observer", "observer_kwargs"}  # llm-compressor calibration metadata
    parsed = QuantizationConfig.model_validate(ours).model_dump()
    expected = ref_cfg.model_dump()
    for cfg in (parsed, expected):
        for key in calibration_only:
            cfg["config_groups"]["group_0"]["weights"].pop(key, None)
    assert parsed == expected
    assert config["architectures"] and config["dtype"] == "bfloat16"


def test_fused_global_scales_shared_and_2688_over_amax(nvfp4_export):
    """q/k/v (and gate/up) share one global scale per layer, = 2688 / amax of their concatenation."""
    model, out = nvfp4_export
    sd = load_file(out / "model.safetensors")
    arch = "tiny-" + model.config.model_type
    dense, _ = load_base_model(arch, dtype="bf16", seed=SEED)
    for i, layer in enumerate(decoder_layers(dense)):
        for group in SHARED_SCALE_GROUPS:
            prefixes = [f"model.layers.{i}.{'mlp' if g in ('gate_proj', 'up_proj') else 'self_attn'}.{g}" for g in group]
            scales = [sd[f"{p}.weight_global_scale"] for p in prefixes]
            assert all(torch.equal(scales[0], s) for s in scales[1:]), prefixes
            amax = max(layer.get_submodule(p.split(".", 3)[3]).weight.float().abs().max().item() for p in prefixes)
            assert scales[0].item() == pytest.approx(448 * 6 / amax, rel=1e-6)


def test_hf_name_strips_every_peft_wrapper():
    """peft's names -> the transformers model's: the prefix, base_layer, original_module, and the trained
    copy of a modules_to_save module (its adapter name after it)."""
    assert hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert hf_name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"
    assert hf_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert hf_name("model.norm.weight") == "model.norm.weight"


def test_other_tensors_16bit_hf_names_no_lora(nvfp4_export):
    """Embeddings, norms, lm_head, biases in bf16 under HF names; no peft names; adapter written
    next to a peft model's export; trained norms exported as they are in the model."""
    model, out = nvfp4_export
    sd = load_file(out / "model.safetensors")
    assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model") for k in sd)
    quant = {k for k in sd if k.endswith(("weight_packed", "weight_scale", "weight_global_scale"))}
    fresh, _ = load_base_model("tiny-" + model.config.model_type, dtype="bf16", seed=SEED)
    dense_names = {n for n in fresh.state_dict() if n.rsplit(".", 2)[-2] not in DECODER_LINEARS or n.endswith("bias")}
    assert set(sd) - quant == dense_names
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= dense_names
    assert all(sd[k].dtype == torch.bfloat16 for k in dense_names)
    current = {hf_name(n): p for n, p in model.named_parameters() if not isinstance(p, NVFP4WeightTensor)}
    for k in dense_names:
        assert torch.equal(sd[k], current[k].to(torch.bfloat16)), k
    has_adapter = hasattr(model, "peft_config")
    assert (out / ADAPTER_SUBDIR / "adapter_model.safetensors").exists() == has_adapter
    if has_adapter:
        norms = load_file(out / ADAPTER_SUBDIR / TRAINABLE_NORMS_FILE)
        assert len(norms) == 2 * model.config.num_hidden_layers
        assert all(torch.equal(v.to(sd[k].dtype), sd[k]) for k, v in norms.items())  # fp32 masters, rounded
    assert (out / "generation_config.json").exists() and (out / "tokenizer_config.json").exists()


def test_transformers_loads_export_through_compressed_tensors(nvfp4_export):
    """End to end: transformers' compressed-tensors loader finds every tensor (no missing/unexpected
    keys), decompresses to our weights and gives our model's (base) logits exactly."""
    pytest.importorskip("compressed_tensors")
    model, out = nvfp4_export
    loaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = _ids()
    with torch.no_grad():
        got = loaded(ids).logits  # first forward decompresses
        if hasattr(model, "peft_config"):
            with model.disable_adapter():
                want = model(ids).logits
        else:
            want = model(ids).logits
    for prefix, w in _nvfp4_weights(model).items():
        assert _ulp_distance_bf16(loaded.get_submodule(prefix).weight.data, w.dequantize(torch.bfloat16)) <= 1
    assert torch.equal(got, want)


def test_all_zero_weights_export_finite_and_decode_to_zero(tmp_path):
    """An all-zero q/k/v group and an all-zero lone linear get a finite global scale (not the inf
    reciprocal of a denormal per-tensor scale) and decode to exact zeros, in the model and the file."""
    model, tok = load_base_model("tiny-qwen2", dtype="bf16", seed=SEED)
    layer = decoder_layers(model)[0]
    with torch.no_grad():
        for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.down_proj):
            linear.weight.zero_()
    quantize_decoder_linears(model)
    sd = load_file(export_nvfp4(model, tok, tmp_path) / "model.safetensors")
    nonfinite = [k for k, t in sd.items() if not torch.isfinite(t.float()).all()]
    assert not nonfinite, nonfinite
    for short in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
        prefix = f"model.layers.0.{short}"
        assert not layer.get_submodule(short).weight.dequantize(torch.float32).any(), prefix
        packed, scale, gscale = (sd[f"{prefix}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale"))
        assert not dequantize_nvfp4(packed, scale, gscale.reciprocal(), torch.float32).any(), prefix  # as vLLM decodes


def test_bf16_export_reloads_with_dequantized_logits(tmp_path):
    model, tok = load_policy("tiny-qwen2", "nvfp4", None, dtype="bf16", seed=SEED)
    model.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF load leaves behind
    export_bf16(model, tok, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert all(v.dtype == torch.bfloat16 for v in load_file(tmp_path / "model.safetensors").values())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = _ids(1)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    # the folder's tokenizer is the trained one: transformers 5 would rebuild a Qwen2 config's
    # generic tokenizer as Qwen2Tokenizer, which drops the tiny tokenizer's spaces
    text = "What is 6 + 6?  a b"
    for loaded in (load_tokenizer(str(tmp_path)), load_base_model(str(tmp_path))[1]):
        assert loaded(text)["input_ids"] == tok(text)["input_ids"] and loaded.decode(tok(text)["input_ids"]) == text
        assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
            tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_adapter_export_reloads_with_peft(tmp_path):
    model, _ = _trained_lora_policy(dtype="fp32")
    export_adapter(model, tmp_path)
    assert {"adapter_model.safetensors", "adapter_config.json", TRAINABLE_NORMS_FILE} <= set(os.listdir(tmp_path))
    assert not any("lora_" in k for k in load_file(tmp_path / TRAINABLE_NORMS_FILE))
    fresh, _ = load_policy("tiny-qwen2", "nvfp4", None, dtype="fp32", seed=SEED)
    with warnings.catch_warnings(record=True) as caught:  # peft's merge() / deprecation notes are not the user's
        warnings.simplefilter("always")
        reloaded = load_adapter(fresh, tmp_path)
    assert not [str(w.message) for w in caught if "peft" in w.filename or "transformers" in w.filename]
    ids = _ids(2)
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(reloaded(ids).logits, want)
        with model.disable_adapter():  # the adapter and the norms both matter
            assert not torch.allclose(model(ids).logits, want)


def test_adapter_loads_into_a_policy_built_with_the_same_lora(tmp_path):
    """load_adapter_into (evaluation with model.adapter_path) reproduces the trained logits: LoRA + norms."""
    model, _ = _trained_lora_policy(dtype="fp32")
    export_adapter(model, tmp_path)
    fresh, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, alpha=8, trainable_norms=True),
                           dtype="fp32", seed=SEED)
    ids = _ids(4)
    with torch.no_grad():
        assert not torch.allclose(fresh(ids).logits, model(ids).logits)
        assert load_adapter_into(fresh, tmp_path) is fresh
        assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_adapter_on_lm_head_loads_into_a_policy(tmp_path):
    """A LoRA on lm_head (an embedding-like layer for peft) reloads: the export leaves the frozen head out,
    and the check of the file's tensors expects it left out (it once asked for lm_head.base_layer.weight)."""
    settings = LoraSettings(rank=4, alpha=8, target_modules=[*DECODER_LINEARS, "lm_head"])
    model, _ = load_policy("tiny-qwen2", "nvfp4", settings, dtype="fp32", seed=SEED)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    export_adapter(model, tmp_path)
    assert not any("base_layer" in k for k in load_file(tmp_path / "adapter_model.safetensors"))
    fresh, _ = load_policy("tiny-qwen2", "nvfp4", settings, dtype="fp32", seed=SEED)
    ids = _ids(5)
    with torch.no_grad():
        assert not torch.allclose(fresh(ids).logits, model(ids).logits)
        load_adapter_into(fresh, tmp_path)
        assert torch.equal(fresh(ids).logits, model(ids).logits)


@pytest.mark.parametrize("settings, problem", [
    (LoraSettings(rank=4, alpha=16, trainable_norms=True), "trained with lora.alpha=8; the model has alpha=16"),
    (LoraSettings(rank=8, alpha=8, trainable_norms=True), "trained with lora.rank=4; the model has rank=8"),
    (LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], trainable_norms=True),
     "trained with lora.target_modules=['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', "
     "'v_proj']; the model has target_modules=['q_proj', 'v_proj']"),
], ids=["alpha", "rank", "target_modules"])
def test_adapter_with_other_lora_settings_is_refused(tmp_path, settings, problem):
    """An adapter trained with another alpha, rank or set of target modules than the model's LoRA is a
    ValueError naming the settings, not a silent load with wrong logits (the model stays untouched)."""
    model, _ = _trained_lora_policy(dtype="fp32")
    export_adapter(model, tmp_path)
    other, _ = load_policy("tiny-qwen2", "nvfp4", settings, dtype="fp32", seed=SEED)
    before = {k: v.clone() for k, v in other.state_dict().items() if "lora_" in k}
    with pytest.raises(ValueError) as exc:
        load_adapter_into(other, tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg and str(tmp_path) in msg and problem in msg and "set model.lora to match" in msg, msg
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("edit, problem", [("drop", "lacks 1 LoRA tensors of the model"),
                                           ("add", "has 1 LoRA tensors the model has no slot for")])
def test_adapter_tensors_must_match_the_model(tmp_path, edit, problem):
    """With a matching adapter_config.json, a LoRA tensor missing from the file, or one the model has no
    slot for, is a ValueError too (peft would keep the fresh init, or drop the tensor, silently)."""
    from safetensors.torch import save_file

    model, _ = _trained_lora_policy(dtype="fp32")
    export_adapter(model, tmp_path)
    weights = load_file(tmp_path / "adapter_model.safetensors")
    name = next(k for k in weights if "layers.0.self_attn.q_proj.lora_B" in k)
    if edit == "drop":
        del weights[name]
    else:
        weights[name.replace("layers.0.", "layers.99.")] = weights[name].clone()
    save_file(weights, str(tmp_path / "adapter_model.safetensors"))
    fresh, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, alpha=8, trainable_norms=True),
                           dtype="fp32", seed=SEED)
    with pytest.raises(ValueError, match=problem):
        load_adapter_into(fresh, tmp_path)


def test_adapter_of_another_shape_is_refused_by_a_policy(tmp_path):
    """An adapter trained on a narrower base, loaded into a policy of the same LoRA settings (and so the
    same tensor names) was peft's size-mismatch traceback: one ValueError naming the first misfit."""
    from qerl.model import add_lora
    from qerl.tiny import build_tiny_model

    model, _ = _trained_lora_policy(dtype="fp32")
    export_adapter(model, tmp_path)
    wide = add_lora(build_tiny_model("qwen2", hidden_size=96, intermediate_size=192),
                    LoraSettings(rank=4, alpha=8, trainable_norms=True))
    with pytest.raises(ValueError, match=rf"^adapter {re.escape(str(tmp_path))} has LoRA for \S+ with \d+ "
                                         r"(inputs|outputs), the model's linear has \d+: it was trained on another "
                                         r"base model$"):
        load_adapter_into(wide, tmp_path)


def test_tied_embeddings_and_sharding(tmp_path):
    """A tied lm_head (Qwen2.5-0.5B) is written once (as embed_tokens); large exports shard."""
    model, tok = load_base_model("tiny-qwen2", dtype="bf16", seed=SEED)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    quantize_decoder_linears(model)
    out = export_nvfp4(model, tok, tmp_path / "nvfp4", max_shard_bytes=8000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not (out / "model.safetensors").exists() and len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]
    dense = export_bf16(model, tok, tmp_path / "bf16", max_shard_bytes=8000)
    reloaded = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.bfloat16)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(reloaded(_ids()).logits, model(_ids()).logits)


def test_nvfp4_export_needs_nvfp4_weights(tmp_path):
    model, tok = load_policy("tiny-llama", "bf16", None, dtype="bf16")
    with pytest.raises(ValueError, match="no NVFP4 weights"):
        export_nvfp4(model, tok, tmp_path)


def test_nf4_model_exports_dequantized(tmp_path):
    pytest.importorskip("bitsandbytes")
    model, tok = load_policy("tiny-qwen2", "nf4", None, dtype="bf16", seed=SEED)
    export_bf16(model, tok, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_ids()).logits, model(_ids()).logits, rtol=0, atol=2e-2)


def test_cli(tmp_path):
    """``python -m qerl.export`` (subprocess), and the bf16 + adapter path in process."""
    # ROOT first, the caller's PYTHONPATH after it (the GPU machine's packages live there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    run = subprocess.run([sys.executable, "-m", "qerl.export", "--model", "tiny-qwen2", "--format", "nvfp4",
                          "--out", str(tmp_path / "nvfp4")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    # the tiny test tokenizer is not what transformers 5's AutoTokenizer rebuilds for a qwen2 config: said,
    # with the loader that reads it as written (a real Qwen tokenizer passes the same check silently)
    assert "PreTrainedTokenizerFast.from_pretrained" in run.stderr
    from transformers import PreTrainedTokenizerFast

    text = "What is 6 + 6?\nThe answer is \\boxed{12}."
    exported = PreTrainedTokenizerFast.from_pretrained(tmp_path / "nvfp4")
    assert exported.decode(exported(text)["input_ids"]) == load_tokenizer("tiny-qwen2").decode(
        load_tokenizer("tiny-qwen2")(text)["input_ids"])
    config = json.loads((tmp_path / "nvfp4" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert any(k.endswith("weight_packed") for k in load_file(tmp_path / "nvfp4" / "model.safetensors"))

    model, _ = _trained_lora_policy(dtype="bf16")
    export_adapter(model, tmp_path / "adapter")
    out = main(["--model", "tiny-qwen2", "--format", "bf16", "--from-nvfp4", "--seed", str(SEED),
                "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "bf16")])
    assert (out / ADAPTER_SUBDIR / TRAINABLE_NORMS_FILE).exists()
    base = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        with model.disable_adapter():
            assert torch.equal(base(_ids()).logits, model(_ids()).logits)
        served = load_adapter(base, out / ADAPTER_SUBDIR)              # peft's fp32 LoRA arithmetic: close
        # (this adapter is large, |B| ~ 0.3: bf16 vs fp32 LoRA measured up to 0.055 apart on two CPUs)
        torch.testing.assert_close(served(_ids()).logits, model(_ids()).logits, rtol=0, atol=0.2)
        compute_in_activation_dtype(served)                             # the trainer's bf16 one: exact
        assert torch.equal(served(_ids()).logits, model(_ids()).logits)


@pytest.mark.parametrize("quantization", ["nf4", "bf16", "nvfp4"])
def test_cli_exports_the_base_each_arm_trained_on(tmp_path, caplog, quantization):
    """An adapter records its arm (``qerl_base.json``): ``--format bf16 --from-trained-base`` rebuilds that
    base (NF4 / NVFP4 dequantized, bf16 as is) and the export reproduces the trained model; without the
    flag a quantized arm is warned about, and an NVFP4 export of another arm says it differs."""
    model, _ = _trained_lora_policy(dtype="fp32", quantization=quantization)
    base = {"model": "tiny-qwen2", "dtype": "fp32", "seed": SEED, "quantization": quantization}
    export_adapter(model, tmp_path / "adapter", base=base)
    assert json.loads((tmp_path / "adapter" / BASE_FILE).read_text()) == base
    out = main(["--model", "tiny-qwen2", "--format", "bf16", "--from-trained-base", "--dtype", "fp32",
                "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "out")])
    assert json.loads((out / ADAPTER_SUBDIR / BASE_FILE).read_text())["quantization"] == quantization
    assert is_dequantized_base(str(out), base)  # its weights are that base: the trainer does not warn there
    served = load_adapter(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), out / ADAPTER_SUBDIR)
    with torch.no_grad():
        torch.testing.assert_close(served(_ids()).logits, model(_ids()).logits, rtol=0, atol=1e-5)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qerl.export_cli"):
        main(["--model", "tiny-qwen2", "--format", "bf16", "--adapter", str(tmp_path / "adapter"),
              "--out", str(tmp_path / "orig")])
        main(["--model", "tiny-qwen2", "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "nvfp4")])
    original_warned = f"trained on the {quantization.upper()} base; --from-trained-base" in caplog.text
    nvfp4_warned = f"trained on the {quantization} base: in an NVFP4 export" in caplog.text
    assert original_warned == (quantization != "bf16") and nvfp4_warned == (quantization != "nvfp4")
    # an export onto another base still records the base the adapter trained on
    for other in ("orig", "nvfp4"):
        assert json.loads((tmp_path / other / ADAPTER_SUBDIR / BASE_FILE).read_text())["quantization"] == quantization
        assert not is_dequantized_base(str(tmp_path / other), base)
    # the export's own adapter exported again from that folder: no "trained on another model" warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qerl.export_cli"):
        main(["--model", str(out), "--format", "bf16", "--dtype", "fp32", "--adapter", str(out / ADAPTER_SUBDIR),
              "--out", str(tmp_path / "again")])
    assert "was trained on" not in caplog.text  # neither on another model nor on the NVFP4 base
    assert is_dequantized_base(str(tmp_path / "again"), base)
    # ... and its adapter still records the base it trained on: a third export is at home there too
    assert json.loads((tmp_path / "again" / ADAPTER_SUBDIR / BASE_FILE).read_text()) == base
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qerl.export_cli"):
        main(["--model", str(tmp_path / "again"), "--format", "bf16", "--dtype", "fp32", "--from-trained-base",
              "--adapter", str(tmp_path / "again" / ADAPTER_SUBDIR), "--out", str(tmp_path / "third")])
    assert "was trained on" not in caplog.text and is_dequantized_base(str(tmp_path / "third"), base)
    served = load_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "third", dtype=torch.float32),
                          tmp_path / "third" / ADAPTER_SUBDIR)
    with torch.no_grad():
        torch.testing.assert_close(served(_ids()).logits, model(_ids()).logits, rtol=0, atol=1e-5)
    assert not is_dequantized_base(str(tmp_path / "again"), {**base, "dtype": "bf16"})  # NVFP4 codes are the dtype's
    with pytest.raises(SystemExit):
        main(["--model", "tiny-qwen2", "--format", "bf16", "--from-nvfp4", "--from-trained-base",
              "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "both")])


def test_cli_refuses_to_clobber(tmp_path, capsys):
    """An existing export, the model's own directory or a missing adapter stop the CLI before any
    loading, with one line on stderr; --overwrite replaces an export and drops its stale adapter."""
    src = export_bf16(*load_policy("tiny-qwen2", "bf16", None, dtype="bf16"), tmp_path / "src")
    before = (src / "model.safetensors").read_bytes()
    cases = [(["--out", str(src)], "would overwrite the model"),
             (["--out", str(src / "sub")], "would overwrite the model"),
             (["--out", str(tmp_path / "x"), "--adapter", str(tmp_path / "none")], "no adapter_config.json")]
    for extra, message in cases:
        with pytest.raises(SystemExit):
            main(["--model", str(src), *extra])
        assert message in capsys.readouterr().err
    assert (src / "model.safetensors").read_bytes() == before
    (tmp_path / "old" / ADAPTER_SUBDIR).mkdir(parents=True)
    with pytest.raises(SystemExit):
        main(["--model", str(src), "--out", str(tmp_path / "old")])
    assert "--overwrite" in capsys.readouterr().err
    # a model folder (config.json, model.safetensors: names an export writes too) is not an export: refused
    with pytest.raises(SystemExit):
        main(["--model", "tiny-qwen2", "--out", str(src), "--overwrite"])
    assert "has no qerl_export.json: not a folder qerl exported" in capsys.readouterr().err
    assert (src / "model.safetensors").read_bytes() == before
    with pytest.raises(SystemExit):  # (the stale adapter/ alone is no export either)
        main(["--model", str(src), "--out", str(tmp_path / "old"), "--overwrite"])
    assert "has no qerl_export.json" in capsys.readouterr().err
    (tmp_path / "old" / "qerl_export.json").write_text("{}")  # an earlier export, as every export records itself
    main(["--model", str(src), "--out", str(tmp_path / "old"), "--overwrite"])
    assert not (tmp_path / "old" / ADAPTER_SUBDIR).exists() and (tmp_path / "old" / "model.safetensors").exists()
    # --overwrite replaces only an earlier export: a run's log folder (events file, its adapter/) is refused
    run = tmp_path / "run"
    (run / ADAPTER_SUBDIR).mkdir(parents=True)
    (run / "events.out.tfevents.1").write_text("x")
    with pytest.raises(SystemExit):
        main(["--model", str(src), "--out", str(run), "--overwrite"])
    assert "holds files no export writes (events.out.tfevents.1)" in capsys.readouterr().err
    assert (run / ADAPTER_SUBDIR).is_dir()
    # an export over one of another format leaves none of the other's files (a stale top-level
    # adapter would be attached by transformers' from_pretrained)
    for name in ("adapter_config.json", "adapter_model.safetensors", "qerl_base.json"):
        (tmp_path / "old" / name).write_text("{}")
    main(["--model", str(src), "--out", str(tmp_path / "old"), "--overwrite"])
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == sorted([*(p.name for p in src.iterdir()), "qerl_export.json"])
    # an export that fails (an unreadable checkpoint) leaves the earlier one as it was
    (tmp_path / "bad.ckpt").write_text("not a checkpoint")
    with pytest.raises(SystemExit):
        main(["--format", "adapter", "--adapter", str(tmp_path / "bad.ckpt"), "--out", str(tmp_path / "old"), "--overwrite"])
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == sorted([*(p.name for p in src.iterdir()), "qerl_export.json"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".old.")]   # no half-written folder left
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "missing-model"), "--out", str(tmp_path / "y")])
    err = capsys.readouterr().err
    assert "cannot load --model" in err and "usage:" not in err, err  # one line each, no usage block


def test_cli_refuses_an_out_under_a_file_before_loading(tmp_path, capsys):
    """The export is written in a folder beside --out: under a file that failed with a traceback, after
    the model had loaded."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit):
        main(["--model", "tiny-qwen2", "--out", str(tmp_path / "afile" / "sub")])
    assert f"{tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--format", "nvfp4", "--from-nvfp4"], "--from-nvfp4 goes with --format bf16"),
    (["--format", "adapter", "--dtype", "fp16"], "--dtype would do nothing"),
    (["--format", "adapter", "--model", "tiny-qwen2", "--seed", "3"], "--model, --seed would do nothing"),
    (["--format", "adapter", "--seed", "0"], "--seed would do nothing"),
])
def test_cli_refuses_flags_that_would_do_nothing(tmp_path, capsys, argv, message):
    """A flag the chosen format ignores was accepted silently (exit 0, the user's dtype not applied)."""
    (tmp_path / "last.ckpt").write_bytes(b"")  # (the flags are refused before the checkpoint is read)
    model = [] if "--model" in argv or "adapter" in argv else ["--model", "tiny-qwen2"]
    adapter = ["--adapter", str(tmp_path / "last.ckpt")] if "adapter" in argv else []
    with pytest.raises(SystemExit):
        main([*model, *argv, *adapter, "--out", str(tmp_path / "out")])
    assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_unshared_group_scales_are_refused(tmp_path):
    model, tok = load_policy("tiny-qwen2", "nvfp4", None, dtype="bf16")
    k = model.model.layers[0].self_attn.k_proj.weight
    k.per_tensor_scale = k.per_tensor_scale * 2  # q/k/v no longer share one scale: vLLM would misdecode them
    with pytest.raises(ValueError, match=r"q_proj,k_proj,v_proj\} have different per-tensor scales"):
        export_nvfp4(model, tok, tmp_path)


@pytest.mark.parametrize("lora_as", ["dict", "settings"])
def test_training_checkpoint_to_adapter(tmp_path, lora_as):
    """A trainer checkpoint (only trainable tensors + hyper-parameters, as QeRLModule writes it) becomes
    the same peft adapter the end of a run writes, without the base model; it reloads to the trained
    logits, and the CLI takes it alone (--format adapter) or with a base export."""
    from lightning_modules.qerl_module import QeRLModule
    from qerl.export import adapter_from_checkpoint

    settings = LoraSettings(rank=4, alpha=8, trainable_norms=True)
    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32", seed=SEED,
                        lora=settings if lora_as == "settings" else vars(settings))
    trained, _ = _trained_lora_policy(dtype="fp32")
    module.model = trained
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(ckpt)  # keeps the trainable tensors only
    torch.save(ckpt, tmp_path / "last.ckpt")

    got = adapter_from_checkpoint(tmp_path / "last.ckpt", tmp_path / "from_ckpt")
    want = export_adapter(trained, tmp_path / "from_run")
    for name in ("adapter_model.safetensors", TRAINABLE_NORMS_FILE):
        a, b = load_file(got / name), load_file(want / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    cfg_a, cfg_b = (json.loads((d / "adapter_config.json").read_text()) for d in (got, want))
    for key in ("r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "bias"):
        assert (sorted(cfg_a[key]) if key == "target_modules" else cfg_a[key]) == \
               (sorted(cfg_b[key]) if key == "target_modules" else cfg_b[key]), key
    assert cfg_a["base_model_name_or_path"] == "tiny-qwen2"

    fresh, _ = load_policy("tiny-qwen2", "nvfp4", None, dtype="fp32", seed=SEED)
    ids = _ids(3)
    with torch.no_grad():
        assert torch.equal(load_adapter(fresh, got)(ids).logits, trained(ids).logits)

    if lora_as == "dict":  # the CLI, once
        alone = main(["--format", "adapter", "--adapter", str(tmp_path / "last.ckpt"), "--out", str(tmp_path / "a")])
        assert load_file(alone / "adapter_model.safetensors").keys() == load_file(want / "adapter_model.safetensors").keys()
        full = main(["--model", "tiny-qwen2", "--seed", str(SEED), "--adapter", str(tmp_path / "last.ckpt"),
                     "--out", str(tmp_path / "full")])
        assert (full / ADAPTER_SUBDIR / "adapter_model.safetensors").is_file()
        with pytest.raises(SystemExit):
            main(["--format", "adapter", "--adapter", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "b")])
        with pytest.raises(SystemExit):
            main(["--format", "adapter", "--out", str(tmp_path / "c")])
        (tmp_path / "broken.ckpt").write_bytes(b"not a checkpoint")
        with pytest.raises(SystemExit):
            main(["--format", "adapter", "--adapter", str(tmp_path / "broken.ckpt"), "--out", str(tmp_path / "d")])
        torch.save({"state_dict": {}, "hyper_parameters": {}}, tmp_path / "empty.ckpt")
        with pytest.raises(SystemExit):
            main(["--format", "adapter", "--adapter", str(tmp_path / "empty.ckpt"), "--out", str(tmp_path / "e")])
        # non-finite weights (a run that diverged) are never passed on: not from a checkpoint, not from a
        # model, not from an adapter folder written before this check existed
        lora_b = next(k for k in ckpt["state_dict"] if "lora_B" in k)
        ckpt["state_dict"][lora_b] = torch.full_like(ckpt["state_dict"][lora_b], float("nan"))
        torch.save(ckpt, tmp_path / "nan.ckpt")
        with pytest.raises(ValueError, match=r"nan.ckpt holds non-finite weights \(1 of \d+ trainable tensors"):
            adapter_from_checkpoint(tmp_path / "nan.ckpt", tmp_path / "f")
        assert not (tmp_path / "f").exists()
        with pytest.raises(SystemExit):
            main(["--format", "adapter", "--adapter", str(tmp_path / "nan.ckpt"), "--out", str(tmp_path / "g")])
        with torch.no_grad():
            next(p for n, p in trained.named_parameters() if "lora_B" in n).fill_(float("inf"))
        with pytest.raises(ValueError, match="the adapter holds non-finite weights"):
            export_adapter(trained, tmp_path / "h")
        weights = load_file(got / "adapter_model.safetensors")
        weights[next(iter(weights))].fill_(float("nan"))
        save_file(weights, str(got / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=r"holds non-finite weights \(1 of \d+ LoRA tensors, e\.g\. "):
            load_adapter(load_policy("tiny-qwen2", "nvfp4", None, dtype="fp32", seed=SEED)[0], got)


@pytest.mark.parametrize("seed_from", ["module", "seed_everything"])
def test_checkpoint_export_rebuilds_the_trained_tiny_base(tmp_path, capsys, seed_from):
    """A tiny model is a random init: the export must build it in the checkpoint's dtype (the
    quickstart trains in fp32; NVFP4 codes of a bf16 init differ) and seed (the module's, or when
    that is null the run's seed_everything, as the data module's state records it), not --dtype and 0."""
    from lightning_modules.qerl_module import QeRLModule

    seed = 3
    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32", lora=LoraSettings(rank=4, alpha=8),
                        seed=seed if seed_from == "module" else None)
    trained, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, alpha=8), dtype="fp32", seed=seed)
    module.model = trained
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(ckpt)
    if seed_from == "seed_everything":  # what Lightning stores of the data module (its seed null too),
        ckpt.update(datamodule_hyper_parameters={"seed": None}, PromptDataModule={"seed": seed})
        del ckpt["qerl_base"]          # in a file from before the run's base was recorded
    else:  # the run's record wins over what the hyper-parameters and data module say
        assert ckpt["qerl_base"] == {"model": "tiny-qwen2", "dtype": "fp32", "seed": seed, "quantization": "nvfp4"}
        ckpt.update(datamodule_hyper_parameters={"seed": 7}, PromptDataModule={"seed": 7})
        ckpt["hyper_parameters"]["seed"] = None
    torch.save(ckpt, tmp_path / "last.ckpt")

    out = main(["--model", "tiny-qwen2", "--adapter", str(tmp_path / "last.ckpt"), "--out", str(tmp_path / "x")])
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # --dtype: the dense tensors only
    for prefix, w in _nvfp4_weights(trained).items():
        assert torch.equal(tensors[f"{prefix}.weight_packed"], w.qdata), prefix
        assert torch.equal(tensors[f"{prefix}.weight_scale"].view(torch.uint8), w.scale.view(torch.uint8)), prefix
        assert torch.equal(tensors[f"{prefix}.weight_global_scale"], 1 / w.per_tensor_scale.reshape(1)), prefix
    for argv, problem in [(["--seed", "4"], "--seed 4, but"), (["--model", "tiny-llama"], "was trained on tiny-qwen2")]:
        with pytest.raises(SystemExit):
            main(["--model", "tiny-qwen2", "--adapter", str(tmp_path / "last.ckpt"), "--out", str(tmp_path / "y"), *argv])
        assert problem in capsys.readouterr().err
    # the adapter a fit writes at its end records that base too (qerl_base.json; peft's base name,
    # which a model built in code leaves empty): exporting it builds the same fp32 base of that seed
    adapter = export_adapter(trained, tmp_path / "adapter", base={"model": "tiny-qwen2", "dtype": "fp32", "seed": seed})
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-qwen2"
    again = load_file(main(["--model", "tiny-qwen2", "--adapter", str(adapter), "--out", str(tmp_path / "z")])
                      / "model.safetensors")
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)
    # without --model: the base the checkpoint or the adapter folder records
    for source, out in ((tmp_path / "last.ckpt", "no_model_ckpt"), (adapter, "no_model_dir")):
        same = load_file(main(["--adapter", str(source), "--out", str(tmp_path / out)]) / "model.safetensors")
        assert all(torch.equal(same[k], tensors[k]) for k in tensors)
    (adapter / BASE_FILE).unlink()  # a peft adapter qerl did not write: peft's record of the base's name
    main(["--adapter", str(adapter), "--out", str(tmp_path / "peft_record"), "--seed", str(seed)])
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(SystemExit):  # and none at all
        main(["--adapter", str(adapter), "--out", str(tmp_path / "no_record")])
    assert "does not record the base it trained on" in capsys.readouterr().err


@pytest.mark.parametrize("content, problem", [
    (None, "empty or truncated file"),
    ([1, 2], "holds a list, not a checkpoint dict"),
    ({"state_dict": [1], "hyper_parameters": {}}, "its 'state_dict' is a list, not a dict"),
    ({"state_dict": {}, "hyper_parameters": [1]}, "its 'hyper_parameters' is a list, not a dict"),
    ({"state_dict": {"model.q.lora_A.default.weight": torch.zeros(2)}}, "no 'hyper_parameters'"),
    ({"state_dict": {"model.q.lora_A.default.weight": 3}, "hyper_parameters": {}}, "is not a tensor (int)"),
], ids=["empty", "list", "state_dict-list", "hparams-list", "no-hparams", "not-tensor"])
def test_cli_rejects_foreign_checkpoint_in_one_line(tmp_path, capsys, content, problem):
    """An empty file, or a pickle that is not a training checkpoint's dict, stops the CLI with one
    error line naming the file and what is wrong (exit 2, argparse's), never a traceback."""
    ckpt = tmp_path / "odd.ckpt"
    ckpt.write_bytes(b"") if content is None else torch.save(content, ckpt)
    with pytest.raises(SystemExit) as exc:
        main(["--format", "adapter", "--adapter", str(ckpt), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "error: cannot read the adapter" in last and str(ckpt) in last and problem in last, last


@pytest.mark.parametrize("saved_norms", [True, False])
def test_adapter_with_other_trainable_norms_is_refused(tmp_path, saved_norms):
    """Trained norms loaded into a policy without fp32 masters and base values (or a norm-less
    adapter into one that trains norms) would train in bf16 and give a wrong base-model row."""
    trained, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, alpha=8, trainable_norms=saved_norms),
                             dtype="bf16", seed=SEED)
    export_adapter(trained, tmp_path / "adapter")
    target, _ = load_policy("tiny-qwen2", "nvfp4", LoraSettings(rank=4, alpha=8, trainable_norms=not saved_norms),
                            dtype="bf16", seed=SEED)
    with pytest.raises(ValueError, match=f"lora.trainable_norms={saved_norms}; the model has trainable_norms={not saved_norms}"):
        load_adapter_into(target, tmp_path / "adapter")



def test_adapter_trained_on_another_base_warns_or_is_refused(tmp_path, capsys, caplog):
    """--model other than the base the adapter records: another name of the same model (a local copy)
    is a warning naming both, for a checkpoint and a peft adapter directory; LoRA tensors that do
    not fit --model (a wider or deeper base) are one error line, not peft's size-mismatch traceback
    or a silent export without the extra layers' LoRA."""
    from lightning_modules.qerl_module import QeRLModule
    from qerl.export import adapter_from_checkpoint
    from qerl.tiny import build_tiny_model, build_tiny_tokenizer

    lora = LoraSettings(rank=4, alpha=8)
    module = QeRLModule(model="tiny-qwen2", quantization="nvfp4", dtype="fp32", lora=lora, seed=SEED)
    module.model, _ = load_policy("tiny-qwen2", "nvfp4", lora, dtype="fp32", seed=SEED)
    ckpt = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(ckpt)
    torch.save(ckpt, tmp_path / "last.ckpt")
    adapter = adapter_from_checkpoint(tmp_path / "last.ckpt", tmp_path / "adapter")  # records tiny-qwen2
    copy = export_bf16(*load_base_model("tiny-qwen2", dtype="fp32", seed=SEED), tmp_path / "copy")

    for source in (tmp_path / "last.ckpt", adapter):
        for model, warned in [(str(copy), True), ("tiny-qwen2", False)]:
            caplog.clear()
            main(["--model", model, "--adapter", str(source), "--out", str(tmp_path / "out"), "--overwrite"])
            warnings = [r.getMessage() for r in caplog.records
                        if r.levelname == "WARNING" and r.name == "qerl.export_cli"]  # not the tokenizer note
            assert warnings == ([f"--model {copy}, but --adapter {source} was trained on tiny-qwen2: exporting it "
                                 "onto --model (are they the same model?)"] if warned else []), warnings
    capsys.readouterr()
    with pytest.raises(SystemExit):  # qerl's record of the base (qerl_base.json), as a checkpoint's: refused
        main(["--model", "tiny-llama", "--adapter", str(adapter), "--out", str(tmp_path / "out"), "--overwrite"])
    assert "was trained on tiny-qwen2" in capsys.readouterr().err
    (adapter / "qerl_base.json").unlink()
    caplog.clear()
    main(["--model", "tiny-llama", "--adapter", str(adapter), "--out", str(tmp_path / "out"), "--overwrite"])
    assert "was trained on tiny-qwen2" in caplog.text  # only peft's record of the base's name: a warning

    for name, config, problem in [
        ("wide", {"hidden_size": 96, "intermediate_size": 192},
         r"\S+ with \d+ (inputs|outputs), the model's linear has \d+"),
        ("deep", {"num_layers": 1}, r"model\.layers\.1\.\S+, a linear the model lacks"),
    ]:
        other = export_bf16(build_tiny_model("qwen2", **config), build_tiny_tokenizer(), tmp_path / name)
        for source in (tmp_path / "last.ckpt", adapter):
            with pytest.raises(SystemExit) as exc:
                main(["--model", str(other), "--adapter", str(source), "--out", str(tmp_path / "out"), "--overwrite"])
            assert exc.value.code == 2
            last = capsys.readouterr().err.strip().splitlines()[-1]
            where = f"--adapter {re.escape(str(source))} onto --model {re.escape(str(other))}"
            assert re.search(rf"error: cannot load {where}: the adapter has LoRA for {problem}: it was trained on "
                             "another base model$", last), last


def test_same_model_reads_paths_not_strings(tmp_path, monkeypatch):
    """A run's recorded base and this run's model name may be the same folder written two ways."""
    from qerl.adapter import same_model

    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "model.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert same_model("models/m", str(tmp_path / "models" / "m"))
    assert same_model("models/m/model.gguf", "models/m")  # peft records a .gguf's folder
    assert not same_model("models/m", "models/other") and not same_model("tiny-qwen2", "tiny-llama")


def test_auto_tokenizer_check_warns_only_where_it_rebuilds_another_tokenizer(tmp_path, caplog):
    """AutoTokenizer keeps tiny-llama's tokenizer (silent) and rebuilds tiny-qwen2's as a Qwen2Tokenizer
    without its spaces (warned, naming the loader that reads tokenizer.json as written)."""
    from qerl.export import warn_if_auto_tokenizer_differs

    for name, differs in (("tiny-llama", False), ("tiny-qwen2", True)):
        model, tokenizer = load_policy(name, "bf16", None)
        export_bf16(model, tokenizer, tmp_path / name)
        caplog.clear()
        assert warn_if_auto_tokenizer_differs(tokenizer, tmp_path / name) is differs
        assert ("PreTrainedTokenizerFast.from_pretrained" in caplog.text) is differs
