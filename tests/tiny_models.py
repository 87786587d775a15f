"""Tiny random-weight GGUF models for tests, loadable by llama.cpp and by edgellm.

`write_tiny_model(path, arch)` writes a small but complete GGUF file (metadata, SPM-style vocab, tensors named as
llama.cpp expects) for arch in {"llama", "qwen2", "qwen3", "gemma3"}. The bytes depend only on the arguments: each
tensor draws from its own generator seeded by (seed, crc32(tensor name)), so golden files made from these models
(tests/golden/tiny_*.json) stay valid as long as the arguments recorded there are passed again.

Per-architecture choices mirror the real model families:
  llama   untied output.weight, rope.dimension_count written, rope "normal" (interleaved pairs) in llama.cpp
  qwen2   q/k/v biases, untied output.weight
  qwen3   q/k RMS norms, key_length 128 != d_model / n_head, tied embeddings (no output.weight)
  gemma3  q/k norms, post-attention and post-FFN norms, key_length 128, tied embeddings, sliding window 8 with
          llama.cpp's default pattern (every 6th layer global, so 6 layers by default: layers 0-4 local, 5 global),
          no rope.freq_base_swa key (llama.cpp then uses 10000 for local layers), no add_space_prefix
  gemma2  gemma3 without q/k norms, every other layer local (sliding window 8), attention / final logit soft-caps
          50 / 30 written, key_length 128, tied embeddings
  qwen3moe qwen3 attention, a mixture of 8 experts (FFN width 128) with top-2 routing, renormalised weights
  smollm3 llama with tied embeddings and 4 layers: every 4th layer (layer 3) has no rotary embedding (NoPE)
  gpt-oss llama.cpp's OPENAI_MOE: q/k/v/o biases, per-head attention sinks (attn_sinks.weight), layer 0 sliding
          (window 8) and layer 1 global (llama.cpp's pattern 2), YaRN rope (factor 32, original context 4096, base
          150000, as the real model), post_attention_norm as the pre-FFN norm, 8 experts (FFN width 128) top-4
          routed by raw logit with router and expert biases, swiglu_oai; expert_qtype stores the 3-D expert tensors
          apart from the rest (MXFP4 as the real files do)
  phi3    fused attn_qkv and ffn_up ([gate; up]), partial rotary (48 of 64 dims), LongRoPE short/long factors
          (rope_factors_short/long.weight, original context 128 < the 256 trained: llama.cpp pads every
          context to a multiple of 256, so the tiny tests run on the long ones), rope.scaling.attn_factor 1.19, untied output
All use the same byte-fallback SentencePiece ("llama") vocab: <unk>=0, <s>=1 (BOS), </s>=2 (EOS), <0x00>..<0xFF>,
then single characters and scored merges.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Arch defaults; any of them can be overridden by keyword in write_tiny_model.
_DEFAULTS: dict[str, dict] = {
    "llama": {"n_layer": 2, "head_dim": 64, "rope_freq_base": 10000.0, "rms_eps": 1e-5, "tie_embeddings": False},
    "qwen2": {"n_layer": 2, "head_dim": 64, "rope_freq_base": 1000000.0, "rms_eps": 1e-6, "tie_embeddings": False},
    "qwen3": {"n_layer": 2, "head_dim": 128, "rope_freq_base": 1000000.0, "rms_eps": 1e-6, "tie_embeddings": True},
    # gemma3 scales embeddings by sqrt(d_model) and ties the output: a small embed_std keeps the token's own
    # embedding from dominating the last hidden state (else every argmax is the input token)
    "gemma3": {"n_layer": 6, "head_dim": 128, "rope_freq_base": 1000000.0, "rms_eps": 1e-6, "tie_embeddings": True,
               "sliding_window": 8, "embed_std": 0.03},
    "gemma2": {"n_layer": 4, "head_dim": 128, "rope_freq_base": 10000.0, "rms_eps": 1e-6, "tie_embeddings": True,
               "sliding_window": 8, "embed_std": 0.03},
    "qwen3moe": {"n_layer": 2, "head_dim": 128, "rope_freq_base": 1000000.0, "rms_eps": 1e-6,
                 "tie_embeddings": True, "n_expert": 8, "n_expert_used": 2, "expert_ff": 128},
    "smollm3": {"n_layer": 4, "head_dim": 64, "rope_freq_base": 5000000.0, "rms_eps": 1e-6, "tie_embeddings": True},
    "gpt-oss": {"n_layer": 2, "head_dim": 64, "rope_freq_base": 150000.0, "rms_eps": 1e-5, "tie_embeddings": False,
                "sliding_window": 8, "n_expert": 8, "n_expert_used": 4, "expert_ff": 128},
    "phi3": {"n_layer": 2, "head_dim": 64, "rope_freq_base": 10000.0, "rms_eps": 1e-5, "tie_embeddings": False},
}
PHI3_ROT, PHI3_ORIG_CTX, PHI3_ATTN_FACTOR = 48, 128, 1.19
GPTOSS_YARN_FACTOR, GPTOSS_YARN_ORIG_CTX = 32.0, 4096
SINK_STD = 1.0  # attention sinks ~ N(0, 1): comparable to the scaled attention scores, so they matter
MOE = ("qwen3moe", "gpt-oss")
ROUTER_STD = 0.5  # router logits ~ N(0, 0.5 * sqrt(d)): clear top-2 choices, a different pair per token
GEMMA = ("gemma2", "gemma3")
ARCHS = tuple(_DEFAULTS)  # the archs a tiny model can be written for (tests/test_architectures.py: all we convert)

WEIGHT_STD = 0.05  # projection matrices: q ~ 0.8 rms after a unit-rms input, attention scores not saturated
EMBED_STD = 0.1  # token_embd / output (default): logits std ~ sqrt(d_model) * 0.1 ~ 1.6
NORM_STD = 0.1  # norm weights are 1 + N(0, 0.1)
BIAS_STD = 0.1

BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
N_SPECIAL = 3
N_BYTE = 256


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines a tiny model's bytes (recorded next to golden outputs)."""

    arch: str
    seed: int
    qtype: str
    n_vocab: int
    d_model: int
    d_ff: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    context_length: int
    rope_freq_base: float
    rms_eps: float
    tie_embeddings: bool
    sliding_window: int | None
    embed_std: float
    llama3_rope: bool = False  # llama: Llama 3.1-style rope_freqs.weight (frequency factors, as convert writes)
    n_expert: int = 0  # qwen3moe: experts per layer, experts per token, one expert's FFN width
    n_expert_used: int = 0
    expert_ff: int = 0
    expert_qtype: str = ""  # storage type of the 3-D expert tensors ("": qtype)


def tiny_spec(arch: str, *, seed: int = 0, qtype: str = "F32", n_vocab: int = 512, d_model: int = 256,
              d_ff: int = 512, n_head: int = 4, n_kv_head: int = 2, context_length: int = 256,
              **overrides) -> TinyModelSpec:
    """The full parameter set for `arch`: arch defaults, then the keyword overrides."""
    if arch not in _DEFAULTS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; expected one of {ARCHS}")
    params = dict(_DEFAULTS[arch])
    params.setdefault("sliding_window", None)
    params.setdefault("embed_std", EMBED_STD)
    for k in ("n_expert", "n_expert_used", "expert_ff"):
        params.setdefault(k, 0)
    params.setdefault("expert_qtype", "")
    params.setdefault("llama3_rope", False)
    unknown = set(overrides) - set(params)
    if unknown:
        raise TypeError(f"unknown tiny-model option(s): {sorted(unknown)}")
    params.update(overrides)
    spec = TinyModelSpec(arch=arch, seed=seed, qtype=qtype.upper(), n_vocab=n_vocab, d_model=d_model, d_ff=d_ff,
                         n_head=n_head, n_kv_head=n_kv_head, context_length=context_length, **params)
    if n_vocab < N_SPECIAL + N_BYTE + 1:
        raise ValueError(f"n_vocab must be > {N_SPECIAL + N_BYTE} (specials + byte tokens)")
    if n_head % n_kv_head:
        raise ValueError("n_head must be a multiple of n_kv_head")
    if arch == "qwen2" and n_head * spec.head_dim != d_model:
        raise ValueError("qwen2 in llama.cpp needs n_head * head_dim == d_model")
    return spec


def write_tiny_model(path: str | Path, arch: str, *, seed: int = 0, qtype: str = "F32", n_vocab: int = 512,
                     d_model: int = 256, d_ff: int = 512, n_head: int = 4, n_kv_head: int = 2,
                     context_length: int = 256, **overrides) -> Path:
    """Write a deterministic random-weight GGUF model for `arch` to `path` and return the path.

    qtype: storage type of the 2-D weight matrices ("F32", "F16", "BF16", "Q8_0", "Q4_0", ... anything
    gguf.quants.quantize implements); 1-D tensors (norms, biases) stay F32.
    overrides: n_layer, head_dim, rope_freq_base, rms_eps, tie_embeddings, sliding_window (gemma3), embed_std,
    n_expert / n_expert_used / expert_ff / expert_qtype (qwen3moe, gpt-oss), llama3_rope (llama).
    """
    spec = tiny_spec(arch, seed=seed, qtype=qtype, n_vocab=n_vocab, d_model=d_model, d_ff=d_ff, n_head=n_head,
                     n_kv_head=n_kv_head, context_length=context_length, **overrides)
    return write_spec(path, spec)


def spec_to_dict(spec: TinyModelSpec) -> dict:
    """JSON-friendly form; `write_tiny_model(path, **spec_to_dict(spec))` rebuilds the same file."""
    from dataclasses import asdict

    return asdict(spec)


def write_spec(path: str | Path, spec: TinyModelSpec, *, split_max_tensors: int = 0, small_first_shard: bool = False,
               strings: dict[str, str] | None = None, control_tokens: tuple[str, ...] = (),
               space_prefix: bool | None = None) -> Path:
    """Write the model of `spec` to `path`. split_max_tensors > 0: a split model as gguf-split writes it,
    `path`'s stem + -00001-of-0000N.gguf ... (returns the first shard's path); small_first_shard: its first shard
    holds metadata only (gguf-split --no-tensor-first-split). strings: extra string metadata (e.g. a chat template).
    control_tokens: texts that become control tokens in place of the vocabulary's last pieces (e.g. harmony's
    `<|channel|>`, ...); space_prefix: whether the tokenizer adds a space before text (None: SentencePiece's default
    for the architecture; False as in BPE vocabularies such as gpt-oss's)."""
    import gguf

    path = Path(path)
    w = gguf.GGUFWriter(str(path), spec.arch, split_max_tensors=split_max_tensors, small_first_shard=small_first_shard)
    _add_metadata(w, spec)
    _add_vocab(w, spec, control_tokens, space_prefix)
    for key, value in (strings or {}).items():
        w.add_string(key, value)
    for name, arr in _tensors(spec):
        expert = arr.ndim == 3 and name.endswith(".weight")
        _add_tensor(w, name, arr, (spec.expert_qtype or spec.qtype) if expert else spec.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)[0]


# ------------------------------------------------------------------------------------------------------------------
# metadata
# ------------------------------------------------------------------------------------------------------------------

def _add_metadata(w, s: TinyModelSpec) -> None:
    import gguf

    # llama.cpp's vocab loader treats a model named *phi3* / *phi-3* as Phi-3's own vocabulary (it looks up
    # <|endoftext|>, which the tiny vocab lacks): the tiny phi3 is named by its family's other name
    w.add_name(f"tiny-{'phi' if s.arch == 'phi3' else s.arch}-seed{s.seed}")
    w.add_file_type(_file_type(s.expert_qtype or s.qtype))
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.d_model)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.d_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_kv_head)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_freq_base(s.rope_freq_base)
    if s.arch == "llama":
        w.add_rope_dimension_count(s.head_dim)
    if s.arch in ("qwen3", *MOE, *GEMMA):
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.arch in (*GEMMA, "gpt-oss") and s.sliding_window:
        w.add_sliding_window(s.sliding_window)
    if s.arch == "gemma2":
        w.add_float32("gemma2.attn_logit_softcapping", 50.0)
        w.add_float32("gemma2.final_logit_softcapping", 30.0)
    if s.arch == "gpt-oss":
        w.add_string("gpt-oss.rope.scaling.type", "yarn")
        w.add_float32("gpt-oss.rope.scaling.factor", GPTOSS_YARN_FACTOR)
        w.add_uint32("gpt-oss.rope.scaling.original_context_length", GPTOSS_YARN_ORIG_CTX)
    if s.arch in MOE:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.expert_ff)
    if s.arch == "phi3":
        w.add_rope_dimension_count(PHI3_ROT)
        w.add_uint32("phi3.rope.scaling.original_context_length", PHI3_ORIG_CTX)
        w.add_float32("phi3.rope.scaling.attn_factor", PHI3_ATTN_FACTOR)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _file_type(qtype: str) -> int:
    import gguf

    name = {"F32": "ALL_F32", "MXFP4": "MOSTLY_MXFP4_MOE"}.get(qtype, f"MOSTLY_{qtype}")  # llama.cpp has no MXFP4-only
    return int(gguf.LlamaFileType[name])


def tiny_vocab(n_vocab: int = 512) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token_types) of the tiny SPM vocab: specials, 256 byte tokens, characters, merges.

    Merged pieces get decreasing scores in the order listed (SentencePiece BPE merges the highest score first);
    single characters score below every merge. Each merge is a concatenation of two earlier pieces, so the SPM
    bigram merger can reach it.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]  # UNKNOWN, CONTROL, CONTROL
    tokens += [f"<0x{b:02X}>" for b in range(N_BYTE)]
    types += [6] * N_BYTE  # BYTE
    scores = [0.0] * len(tokens)

    sp = "\u2581"
    chars = [sp] + list("etaoinshrdlucmfwypvbgkjqxz") + list("ETAOINSHRDLUCMFWYPVBGKJQXZ") + list("0123456789") \
        + list(".,!?'\"-:;()[]{}<>/=+*#_&%$@") + ["\n", "\t"]
    bigrams = [
        "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed", "is", "it",
        "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le", "ve", "co", "me", "de", "hi", "ri",
        "ro", "ic", "ne", "ea", "ra", "ce", "ll", "ma", "si", "om", "ur", "ca", "el", "ta", "la", "ns", "di", "fo",
        "ho", "pe", "ec", "pr", "no", "ct", "us", "ac", "ot", "il", "tr", "ly", "nc", "et", "ut", "ss", "so", "rs",
        "un", "lo", "wa", "ge", "ie", "wh", "ee", "wi", "em", "ad", "ol", "rt", "po", "we", "na", "ul", "ni", "ts",
        "mo", "ow", "pa", "im", "mi", "ai", "sh", "ir", "su", "id", "os", "iv", "ia", "am", "fi", "ci", "vi", "pl",
    ]
    merges = bigrams[:54] + [sp + c for c in "taswcobpfmihdlrengyuvkTIAS1(=" + sp] + [
        "ing", "ion", "tion", "the", "and", "ent", "for", "her", "ter", "hat", "tha", "ere", "ate", "his", "con",
        "res", "ver", "all", "ons", "nce", "men", "ith", "ted", "ers", "pro", "thi", "wit", "are", "ess", "not",
        sp + "th", sp + "the", sp + "an", sp + "and", sp + "of", sp + "to", sp + "in", sp + "is", sp + "it",
        sp + "wh", sp + "wa", sp + "was", sp + "for", sp + "on", sp + "he", sp + "be", sp + "as", sp + "at",
        sp + "wit", sp + "with", sp + "tha", sp + "that", sp + "thi", sp + "this", sp + "The", sp + "co",
        sp + "con", sp + "pro", sp + "re", sp + "st", sp + "de", sp + "fr", sp + "ha", sp + "ma", sp + "we",
    ] + bigrams[54:]
    room = n_vocab - len(tokens)
    pieces = chars[:room]
    tokens += pieces
    scores += [-1e4 - i for i in range(len(pieces))]
    types += [1] * len(pieces)
    known = set(tokens)
    for m in merges:
        if len(tokens) >= n_vocab:
            break
        if m in known or not any(m[:k] in known and m[k:] in known for k in range(1, len(m))):
            continue
        tokens.append(m)
        known.add(m)
        scores.append(float(N_SPECIAL + N_BYTE + len(pieces) - len(scores)))
        types.append(1)
    # Pad with user-visible but unreachable filler pieces so any n_vocab works.
    i = 0
    while len(tokens) < n_vocab:
        tokens.append(f"<extra_{i}>")
        scores.append(-1e6)
        types.append(5)  # UNUSED
        i += 1
    return tokens, scores, types


def _add_vocab(w, s: TinyModelSpec, control_tokens: tuple[str, ...] = (), space_prefix: bool | None = None) -> None:
    tokens, scores, types = tiny_vocab(s.n_vocab)
    if control_tokens:
        k = len(control_tokens)
        tokens, scores, types = tokens[:-k] + list(control_tokens), scores[:-k] + [0.0] * k, types[:-k] + [3] * k
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(s.arch not in GEMMA if space_prefix is None else space_prefix)


# ------------------------------------------------------------------------------------------------------------------
# tensors
# ------------------------------------------------------------------------------------------------------------------

def _rand(spec: TinyModelSpec, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
    # one generator per tensor: adding or reordering tensors never changes the others
    rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
    return (mean + std * rng.standard_normal(shape)).astype(np.float32)


def _tensors(s: TinyModelSpec):
    """Yield (name, float32 array in numpy (rows=out, cols=in) layout) in file order."""
    d, f, hd = s.d_model, s.d_ff, s.head_dim
    q_dim, kv_dim = s.n_head * hd, s.n_kv_head * hd
    yield "token_embd.weight", _rand(s, "token_embd.weight", (s.n_vocab, d), s.embed_std)
    yield "output_norm.weight", _rand(s, "output_norm.weight", (d,), NORM_STD, 1.0)
    if not s.tie_embeddings:
        yield "output.weight", _rand(s, "output.weight", (s.n_vocab, d), s.embed_std)
    if s.llama3_rope:  # Llama 3.1's scaling (factor 8, original context 8192) as convert/common.py computes it
        from convert.common import llama3_rope_factors

        rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
        yield "rope_freqs.weight", llama3_rope_factors({"rope_scaling": rs, "rope_theta": s.rope_freq_base}, hd)
    if s.arch == "phi3":  # LongRoPE factors: >= 1, growing with the pair index as real ones do
        half = PHI3_ROT // 2
        for kind, top in (("short", 2.0), ("long", 8.0)):
            yield f"rope_factors_{kind}.weight", np.geomspace(1.0, top, half).astype(np.float32)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        layer = [("attn_norm.weight", (d,), NORM_STD, 1.0)]
        if s.arch == "phi3":
            layer.append(("attn_qkv.weight", (q_dim + 2 * kv_dim, d), WEIGHT_STD, 0.0))
        else:
            layer += [("attn_q.weight", (q_dim, d), WEIGHT_STD, 0.0), ("attn_k.weight", (kv_dim, d), WEIGHT_STD, 0.0),
                      ("attn_v.weight", (kv_dim, d), WEIGHT_STD, 0.0)]
        if s.arch in ("qwen2", "gpt-oss"):
            layer += [("attn_q.bias", (q_dim,), BIAS_STD, 0.0), ("attn_k.bias", (kv_dim,), BIAS_STD, 0.0),
                      ("attn_v.bias", (kv_dim,), BIAS_STD, 0.0)]
        if s.arch in ("qwen3", "qwen3moe", "gemma3"):
            layer += [("attn_q_norm.weight", (hd,), NORM_STD, 1.0), ("attn_k_norm.weight", (hd,), NORM_STD, 1.0)]
        layer.append(("attn_output.weight", (d, q_dim), WEIGHT_STD, 0.0))
        if s.arch == "gpt-oss":
            layer += [("attn_output.bias", (d,), BIAS_STD, 0.0), ("attn_sinks.weight", (s.n_head,), SINK_STD, 0.0)]
        if s.arch in (*GEMMA, "gpt-oss"):
            layer.append(("post_attention_norm.weight", (d,), NORM_STD, 1.0))
        if s.arch != "gpt-oss":  # its post_attention_norm is the pre-FFN norm
            layer.append(("ffn_norm.weight", (d,), NORM_STD, 1.0))
        if s.arch == "phi3":
            layer.append(("ffn_up.weight", (2 * f, d), WEIGHT_STD, 0.0))
        elif s.arch in MOE:
            e, fe = s.n_expert, s.expert_ff
            layer += [("ffn_gate_inp.weight", (e, d), ROUTER_STD / np.sqrt(d) * 4, 0.0),
                      ("ffn_gate_exps.weight", (e, fe, d), WEIGHT_STD, 0.0),
                      ("ffn_up_exps.weight", (e, fe, d), WEIGHT_STD, 0.0),
                      ("ffn_down_exps.weight", (e, d, fe), WEIGHT_STD, 0.0)]
            if s.arch == "gpt-oss":  # router and expert biases
                layer += [("ffn_gate_inp.bias", (e,), BIAS_STD, 0.0), ("ffn_gate_exps.bias", (e, fe), BIAS_STD, 0.0),
                          ("ffn_up_exps.bias", (e, fe), BIAS_STD, 0.0), ("ffn_down_exps.bias", (e, d), BIAS_STD, 0.0)]
        else:
            layer += [("ffn_gate.weight", (f, d), WEIGHT_STD, 0.0), ("ffn_up.weight", (f, d), WEIGHT_STD, 0.0)]
        if s.arch not in MOE:
            layer.append(("ffn_down.weight", (d, f), WEIGHT_STD, 0.0))
        if s.arch in GEMMA:
            layer.append(("post_ffw_norm.weight", (d,), NORM_STD, 1.0))
        for name, shape, std, mean in layer:
            yield p + name, _rand(s, p + name, shape, std, mean)


def _add_tensor(w, name: str, arr: np.ndarray, qtype: str) -> None:
    import gguf

    if arr.ndim == 1 or qtype == "F32" or not name.endswith(".weight"):  # vectors and biases stay F32
        w.add_tensor(name, arr)
        return
    gtype = gguf.GGMLQuantizationType[qtype]
    if qtype == "F16":
        w.add_tensor(name, arr.astype(np.float16))
        return
    try:
        data = gguf.quants.quantize(arr, gtype)  # (rows, bytes_per_row) uint8 for block types
    except NotImplementedError:  # IQ4_NL / IQ4_XS: our quantizer, byte-equal to llama.cpp's (tests/test_iquants.py)
        from quant.formats import quantize
        from quant.types import QuantType

        data = quantize(arr.reshape(-1, arr.shape[-1]), QuantType[qtype]).reshape(*arr.shape[:-1], -1)
    w.add_tensor(name, data, raw_dtype=gtype)


if __name__ == "__main__":  # quick manual check: python tests/tiny_models.py /tmp/x
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for a in ARCHS:
        print(write_tiny_model(out / f"tiny_{a}.gguf", a))
