"""The ``.gguf`` path of ``load_base_model`` / ``load_tokenizer`` / ``load_policy``, offline.

CI has no network and no real model files, so each test writes a tiny GGUF with ``gguf.GGUFWriter``
the way llama.cpp's ``convert_hf_to_gguf.py`` does: F32 tensors under llama.cpp's names, taken from a
seeded tiny model, plus a byte-level BPE tokenizer (the 256 GPT-2 byte symbols, a few merges and
Qwen's ChatML specials) stored as ``tokenizer.ggml.*`` metadata with a chat template.

llama.cpp permutes the q/k rows of ``llama`` checkpoints (its rotary layout) and transformers undoes
that on load; ``qwen2`` files are written unpermuted and loaded as is. Both are checked.
"""

import gguf
import numpy as np
import pytest
import torch
from peft.tuners.lora import Linear as LoraLinear
from transformers.convert_slow_tokenizer import bytes_to_unicode

from qerl.model import LoraSettings, load_base_model, load_policy, load_tokenizer
from qerl.nvfp4 import NVFP4WeightTensor
from qerl.quantize import DECODER_LINEARS, quantize_decoder_linears
from qerl.tiny import CHATML_TEMPLATE, build_tiny_model

MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_TOKENS = list(bytes_to_unicode().values())
TOKENS = BYTE_TOKENS + [m.replace(" ", "") for m in MERGES] + SPECIALS
VOCAB = len(TOKENS)  # 264
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # gguf.TokenType

HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if module in HF_TO_GGUF:
        return f"{HF_TO_GGUF[module]}.{suffix}"
    _, _, index, rest = module.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{index}.{HF_TO_GGUF_LAYER[rest]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` for q (n_head) and k (n_kv_head) rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, model, arch: str, pad_token: bool = True) -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([TOKEN_NORMAL] * (VOCAB - len(SPECIALS)) + [TOKEN_CONTROL] * len(SPECIALS))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(TOKENS.index("<|endoftext|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    if pad_token:
        writer.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    for name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj.weight" in name:
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj.weight" in name:
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def qwen2_gguf(tmp_path_factory):
    source = build_tiny_model("qwen2", seed=3, vocab_size=VOCAB)
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2-f32.gguf"
    write_tiny_gguf(path, source, "qwen2")
    return path, source


def _ids(seed=0, shape=(2, 12)):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_gguf_qwen2_logits_match_source(qwen2_gguf):
    path, source = qwen2_gguf
    model, tokenizer = load_base_model(str(path), dtype="fp32")
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (64, 2, 4, 2, 128, VOCAB)
    assert cfg.tie_word_embeddings is False  # output.weight is in the file
    assert model.dtype == torch.float32 and not model.training
    # Quirk: transformers leaves a GgufConfig on the dequantized model (blocks save_pretrained).
    assert getattr(cfg, "quantization_config", None) is not None
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, source(_ids()).logits, atol=1e-5, rtol=0)
    assert tokenizer.padding_side == "left"


def test_gguf_suffix_in_any_case(qwen2_gguf, tmp_path):
    """``Model.GGUF`` is a GGUF file too (file names' case varies with the tool that wrote them), and its
    folder is the base peft records for it."""
    from qerl.adapter import same_model

    path, source = qwen2_gguf
    upper = tmp_path / "TINY-QWEN2-F32.GGUF"
    upper.write_bytes(path.read_bytes())
    model, _ = load_base_model(str(upper), dtype="fp32")
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, source(_ids()).logits, atol=1e-5, rtol=0)
    assert same_model(str(upper), str(tmp_path))


def test_gguf_llama_qk_permutation_is_undone(tmp_path):
    source = build_tiny_model("llama", seed=4, vocab_size=VOCAB)
    path = tmp_path / "tiny-llama-f32.gguf"
    write_tiny_gguf(path, source, "llama")
    model, _ = load_base_model(str(path), dtype="fp32")
    assert model.config.model_type == "llama"
    with torch.no_grad():
        torch.testing.assert_close(model(_ids(1)).logits, source(_ids(1)).logits, atol=1e-5, rtol=0)


def test_gguf_tokenizer(qwen2_gguf):
    path, _ = qwen2_gguf
    tok = load_tokenizer(str(path))
    assert len(tok) == VOCAB
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.padding_side == "left"
    text = "the cat<|im_end|> in héllo wörld, 42!\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: any UTF-8 round-trips
    assert TOKENS.index("<|im_end|>") in ids  # specials stay whole
    assert ids[0] != tok.bos_token_id  # add_bos_token is False, as in Qwen GGUFs
    assert tok.tokenize(" the") == ["Ġthe"]  # the file's merges are applied
    batch = tok(["a", "the cat"], padding=True)["input_ids"]
    assert batch[0][0] == tok.pad_token_id and batch[0][-1] != tok.pad_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_tokenizer_without_pad_uses_eos(tmp_path):
    path = tmp_path / "no-pad.gguf"
    write_tiny_gguf(path, build_tiny_model("qwen2", vocab_size=VOCAB), "qwen2", pad_token=False)
    tok = load_tokenizer(str(path))
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    assert tok.padding_side == "left"


def test_gguf_load_policy_nvfp4_lora(qwen2_gguf):
    import copy

    path, source = qwen2_gguf
    policy, tok = load_policy(str(path), "nvfp4", LoraSettings(rank=4), dtype="fp32")
    wrapped = {n: m for n, m in policy.named_modules() if isinstance(m, LoraLinear)}
    assert len(wrapped) == source.config.num_hidden_layers * len(DECODER_LINEARS)
    for name, mod in wrapped.items():
        assert isinstance(mod.base_layer.weight, NVFP4WeightTensor), name
        assert not mod.base_layer.weight.requires_grad
    assert not isinstance(policy.get_output_embeddings().weight, NVFP4WeightTensor)

    # LoRA B starts at zero, so the policy equals the source model quantized the same way.
    reference = copy.deepcopy(source)
    quantize_decoder_linears(reference)
    ids = tok(["the cat", "héllo"], padding=True, return_tensors="pt")
    out = policy(**ids, labels=ids["input_ids"])
    with torch.no_grad():
        expected = reference(**ids).logits
    torch.testing.assert_close(out.logits.detach(), expected, atol=1e-5, rtol=0)
    out.loss.backward()
    with_grad = {n for n, p in policy.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)


@pytest.mark.parametrize("keep", [4000, 0.5])
def test_truncated_gguf_is_one_clear_error(qwen2_gguf, tmp_path, keep):
    """A download cut short: in the header (struct.error inside the reader) or in the tensors."""
    path, _ = qwen2_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ValueError, match="cannot load model"):
        load_policy(str(cut), "nvfp4", None)
