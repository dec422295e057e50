"""Build a small random Llama-family model as a Hugging Face directory.

Used by the test-suite (and by anyone who wants a model without a download):
fixed seed, a byte-level BPE tokenizer trained on a built-in text, a ChatML
chat template, saved with transformers' own save_pretrained so that the
reference implementation can load the very same weights.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """The quick brown fox jumps over the lazy dog. A model server must stay correct under load.
Streams end with a finish reason or an error. Logprobs are identical whatever shares the batch.
Überall façade naïve café — 日本語のテキスト, emoji 🙂🚀, numbers 0123456789, symbols {}[]()<>!?.
steadyserve serves language models over HTTP and gRPC with bounded queues and honest streams.
"""

SIZES = {
    # name: (hidden, intermediate, layers, heads, kv_heads, vocab)
    "tiny": (64, 128, 2, 4, 2, 384),
    # SmolLM2-135M widths (where plain F.linear varies with the row count) but 2 layers.
    "smolwidth": (576, 1536, 2, 9, 3, 384),
    # The grouped-query ratios of the models deployed at 7-8B, head_dim 16: Llama 3.1 8B's 4:1, Qwen2.5 7B's 7:1,
    # and 8:1 (Llama 3.1 70B's).
    "gqa4": (128, 256, 2, 8, 2, 384),
    "gqa7": (224, 448, 2, 14, 2, 384),
    "gqa8": (128, 256, 2, 8, 1, 384),
}


def _tokenizer(vocab_size: int, chat_template: str | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_template or CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0,
                     max_position_embeddings: int = 512, chat_template: str | None = None,
                     special_tokens: tuple[str, ...] = (), added_tokens: tuple[str, ...] = ()) -> Path:
    """Write a random model to out_dir and return it. arch: llama | qwen2 | mistral | llama3 | qwen3 | qwen3-hd48
    | gemma3 | phi3 | phi3-longrope | olmo2 | smollm3 | granite | gemma2 | gemma3-linear | qwen3moe | qwen3moe-mixed
    | gptoss.
    `chat_template`: another template than the ChatML default (tests of templates that know tools);
    `special_tokens`, `added_tokens`: more tokens in the vocabulary (gpt-oss's harmony markers and channel names)."""
    import torch
    from transformers import (GptOssConfig, GptOssForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GraniteConfig, GraniteForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config, Olmo2ForCausalLM,
                              Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, SmolLM3Config,
                              SmolLM3ForCausalLM)

    out = Path(out_dir)
    hidden, inter, layers, heads, kv_heads, vocab = SIZES[size]
    tokenizer = _tokenizer(vocab, chat_template)
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    if arch.startswith("gemma"):  # transformers' GemmaTokenizer adds a <mask> token where a vocabulary lacks one
        tokenizer.add_special_tokens({"mask_token": "<mask>"})
    vocab = max(vocab, len(tokenizer))
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if arch == "llama":
        cfg, cls = LlamaConfig(tie_word_embeddings=True, **common), LlamaForCausalLM
    elif arch == "llama3":  # untied, Llama 3 RoPE scaling
        cfg = LlamaConfig(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128}, **common)
        cls = LlamaForCausalLM
    elif arch == "qwen2":  # q/k/v bias, untied
        cfg, cls = Qwen2Config(tie_word_embeddings=False, **common), Qwen2ForCausalLM
    elif arch == "mistral":
        cfg, cls = MistralConfig(tie_word_embeddings=False, sliding_window=None, **common), MistralForCausalLM
    elif arch == "qwen3":  # q/k norm; head_dim 128, the Qwen3Config default a GGUF falls back on
        cfg = Qwen3Config(tie_word_embeddings=False, head_dim=128, **{**common, "num_attention_heads": 2,
                                                                        "num_key_value_heads": 1})
        cls = Qwen3ForCausalLM
    elif arch == "qwen3-hd48":  # head_dim 48: neither hidden / heads (16) nor the 128 transformers' GGUF map assumes
        cfg, cls = Qwen3Config(tie_word_embeddings=False, head_dim=48, **common), Qwen3ForCausalLM
    elif arch == "gemma3":  # six layers: five sliding (window 16) and one global, as sliding_window_pattern=6 says
        cfg = Gemma3TextConfig(tie_word_embeddings=True, head_dim=hidden // heads, sliding_window=16,
                               query_pre_attn_scalar=24, **{**common, "num_hidden_layers": 6})
        cls = Gemma3ForCausalLM
    elif arch == "phi3":  # fused q|k|v and gate|up, a sliding window on every layer
        cfg, cls = Phi3Config(tie_word_embeddings=False, sliding_window=24, **common), Phi3ForCausalLM
    elif arch == "phi3-longrope":  # LongRoPE; served up to original_max_position_embeddings (models/phi3.py)
        half = hidden // heads // 2
        cfg = Phi3Config(tie_word_embeddings=False, original_max_position_embeddings=128, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)]}, **common)
        cls = Phi3ForCausalLM
    elif arch == "gemma3-linear":  # Gemma 3 4B and up: linear RoPE scaling (factor 8) on the global layers only
        cfg = Gemma3TextConfig(tie_word_embeddings=True, head_dim=hidden // heads, sliding_window=16,
                               query_pre_attn_scalar=24, rope_scaling={"rope_type": "linear", "factor": 8.0},
                               **{**common, "num_hidden_layers": 6})
        cls = Gemma3ForCausalLM
    elif arch == "gemma2":  # four layers, local and global alternating; caps small enough to bite here
        cfg = Gemma2Config(tie_word_embeddings=True, head_dim=hidden // heads, sliding_window=16,
                           query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                           **{**common, "num_hidden_layers": 4})
        cls = Gemma2ForCausalLM
    elif arch == "olmo2":  # norms after attention and MLP only; q/k norm over all heads
        cfg, cls = Olmo2Config(tie_word_embeddings=False, **common), Olmo2ForCausalLM
    elif arch == "smollm3":  # four layers: the fourth skips RoPE (no_rope_layer_interval=4)
        cfg = SmolLM3Config(tie_word_embeddings=True, **{**common, "num_hidden_layers": 4})
        cls = SmolLM3ForCausalLM
    elif arch == "granite":  # the four multipliers, none of them 1
        cfg = GraniteConfig(tie_word_embeddings=True, embedding_multiplier=4.0, residual_multiplier=0.5,
                            attention_multiplier=0.2, logits_scaling=2.5, **common)
        cls = GraniteForCausalLM
    elif arch == "qwen3moe":  # 8 experts of width 32, top-2 renormalized (Qwen3-30B-A3B's routing), every layer sparse
        cfg = Qwen3MoeConfig(tie_word_embeddings=False, head_dim=hidden // heads, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True, **common)
        cls = Qwen3MoeForCausalLM
    elif arch == "qwen3moe-mixed":  # a dense first layer (mlp_only_layers), top-3 of 4 without renormalization
        cfg = Qwen3MoeConfig(tie_word_embeddings=False, head_dim=hidden // heads, num_experts=4, num_experts_per_tok=3,
                             moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[0], **common)
        cls = Qwen3MoeForCausalLM
    elif arch == "gptoss":  # 8 experts of width 32, top-2 then softmax; sliding (window 16) and full layers
        # alternating; YaRN; a SwiGLU limit low enough to clamp these activations; sinks (below) that take weight
        cfg = GptOssConfig(tie_word_embeddings=False, head_dim=hidden // heads, num_local_experts=8,
                           num_experts_per_tok=2, sliding_window=16, swiglu_limit=0.6,
                           rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False, "original_max_position_embeddings": 128,
                                            "rope_theta": 150000.0},
                           **{**common, "intermediate_size": 32})
        cls = GptOssForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # random init is tiny; make activations and logits lively
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if size == "tiny" else 0.04)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            elif name.endswith("sinks"):  # gpt-oss: logits of the order of the scores, so the sinks take weight
                p.normal_(0.0, 1.0)
            elif arch in ("qwen3", "qwen3-hd48", "qwen3moe", "qwen3moe-mixed", "gptoss", "gemma2", "gemma3", "gemma3-linear", "olmo2"):  # norm weights too: Gemma's (1 + w) must show
                p.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
