"""Tokenizer files of an HF checkpoint -> GGUF vocab (tokenizer.ggml.*), as llama.cpp's converter writes it.

* byte-level BPE (tokenizer.json, GPT-2 style: Llama 3, Qwen 2/3): model "gpt2", tokens, types, merges and the
  pre-tokenizer name (tokenizer.ggml.pre) recognised from the pre-tokenizer's split regex.
* SentencePiece (tokenizer.model, or tokenizer.json Unigram / BPE with byte fallback: Llama 2, Mistral, Gemma):
  model "llama", pieces with U+2581, scores, types.
Special ids come from tokenizer_config.json (then config.json), the chat template from tokenizer_config.json.
"""
from __future__ import annotations

import json
from pathlib import Path

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTR = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# HF split regexes -> llama.cpp pre-tokenizer names (convert_hf_to_gguf_update.py hashes the same families)
KNOWN_SPLITS = {
    _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    _CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+": "gpt-2",
}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _walk_pre(pre: dict | None) -> list[dict]:
    if not pre:
        return []
    if pre.get("type") == "Sequence":
        return [q for p in pre.get("pretokenizers", []) for q in _walk_pre(p)]
    return [pre]


def pre_name(tj: dict, default: str) -> str:
    """tokenizer.ggml.pre for a byte-level BPE tokenizer.json."""
    parts = _walk_pre(tj.get("pre_tokenizer"))
    for p in parts:
        if p.get("type") == "Split":
            pat = p.get("pattern", {})
            regex = pat.get("Regex") or pat.get("String")
            if regex in KNOWN_SPLITS:
                return KNOWN_SPLITS[regex]
    if [p.get("type") for p in parts] == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"  # llama.cpp spells it so
    return default


def _is_byte_level(tj: dict) -> bool:
    parts = _walk_pre(tj.get("pre_tokenizer"))
    dec = tj.get("decoder") or {}
    return any(p.get("type") == "ByteLevel" for p in parts) or dec.get("type") == "ByteLevel"


def add_vocab(w, hf_dir: Path, cfg: dict, spec) -> int | None:
    """Write the tokenizer to the GGUFWriter `w`; returns the vocab size written (None: no tokenizer files)."""
    from edgellm.errors import UnsupportedModelError

    tc = _read_json(hf_dir / "tokenizer_config.json")
    tj = _read_json(hf_dir / "tokenizer.json")
    vocab_size = cfg.get("vocab_size")
    model = tj.get("model", {})
    if tj and model.get("type") == "BPE" and _is_byte_level(tj):
        tokens, types, piece_id = _bpe_vocab(tj, vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre_name(tj, spec.default_pre))
        w.add_token_list(tokens)
        w.add_token_types(types)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        w.add_token_merges(merges)
    elif (hf_dir / "tokenizer.model").is_file():
        tokens, scores, types, piece_id = _spm_model_vocab(hf_dir, vocab_size)
        _write_spm(w, tokens, scores, types, spec)
    elif tj and model.get("type") in ("Unigram", "BPE"):
        tokens, scores, types, piece_id = _spm_json_vocab(tj, vocab_size)
        _write_spm(w, tokens, scores, types, spec)
    elif not tj:
        return None
    else:
        raise UnsupportedModelError(f"unsupported tokenizer model {model.get('type')!r}")

    def special_id(key: str) -> int | None:
        tok = _content(tc.get(f"{key}_token"))
        if tok is not None and tok in piece_id:
            return piece_id[tok]
        v = cfg.get(f"{key}_token_id")
        if isinstance(v, list):
            v = v[0] if v else None
        return int(v) if v is not None else None

    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                     ("pad", w.add_pad_token_id)):
        i = special_id(key)
        if i is not None:
            add(i)
    add_bos, add_eos = tc.get("add_bos_token"), tc.get("add_eos_token")
    post = tj.get("post_processor") or {}
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs:
        if p.get("type") == "TemplateProcessing" and p.get("single"):
            single = p["single"]
            if add_bos is None:
                add_bos = "SpecialToken" in single[0]
            if add_eos is None:
                add_eos = "SpecialToken" in single[-1]
    if add_bos is not None:
        w.add_add_bos_token(bool(add_bos))
    if add_eos is not None:
        w.add_add_eos_token(bool(add_eos))
    template = tc.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        w.add_chat_template(template)
    return len(tokens)


def _added(tj: dict) -> dict[int, dict]:
    return {int(t["id"]): t for t in tj.get("added_tokens", [])}


def _bpe_vocab(tj: dict, vocab_size: int | None):
    vocab = dict(tj["model"]["vocab"])
    added = _added(tj)
    for i, t in added.items():
        vocab[t["content"]] = i
    n = max(int(vocab_size or 0), max(vocab.values()) + 1)
    rev = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(n):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(rev[i])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        else:
            tokens.append(rev[i])
            types.append(NORMAL)
    return tokens, types, {s: i for i, s in enumerate(tokens)}


def _write_spm(w, tokens, scores, types, spec) -> None:
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if spec.spm_add_space_prefix is not None:
        w.add_add_space_prefix(spec.spm_add_space_prefix)


def _pad(tokens, scores, types, n):
    while len(tokens) < n:
        tokens.append(f"[PAD{len(tokens)}]")
        scores.append(-1000.0)
        types.append(UNUSED)


def _spm_model_vocab(hf_dir: Path, vocab_size: int | None):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(hf_dir / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        types.append(UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else
                     UNUSED if sp.is_unused(i) else BYTE if sp.is_byte(i) else NORMAL)
    extra = _read_json(hf_dir / "added_tokens.json")
    tj = _read_json(hf_dir / "tokenizer.json")
    added = {t["content"]: t for t in tj.get("added_tokens", [])}
    for piece, i in sorted(extra.items(), key=lambda kv: kv[1]):
        if i >= len(tokens):
            _pad(tokens, scores, types, i)
            tokens.append(piece)
            scores.append(-1000.0)
            types.append(CONTROL if added.get(piece, {}).get("special") else USER_DEFINED)
    for i, t in _added(tj).items():  # added tokens override the pieces they replace
        if i < len(tokens) and tokens[i] != t["content"]:
            tokens[i] = t["content"]
            types[i] = CONTROL if t.get("special") else USER_DEFINED
    _pad(tokens, scores, types, int(vocab_size or 0))
    return tokens, scores, types, {s: i for i, s in enumerate(tokens)}


def _spm_json_vocab(tj: dict, vocab_size: int | None):
    model = tj["model"]
    if model["type"] == "Unigram":
        entries = [(p, float(s)) for p, s in model["vocab"]]
    else:  # SentencePiece BPE exported to tokenizer.json: earlier ids merge first
        entries = [(p, -float(i)) for p, i in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    tokens = [p for p, _ in entries]
    scores = [s for _, s in entries]
    unk = model.get("unk_id") if model["type"] == "Unigram" else None
    unk_tok = model.get("unk_token")
    types = []
    for i, p in enumerate(tokens):
        if i == unk or p == unk_tok:
            types.append(UNKNOWN)
        elif len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    for i, t in _added(tj).items():
        if i >= len(tokens):
            _pad(tokens, scores, types, i)
            tokens.append(t["content"])
            scores.append(0.0)
            types.append(CONTROL)
        else:
            tokens[i] = t["content"]
        types[i] = CONTROL if t.get("special") else USER_DEFINED
        if t["content"] == unk_tok:
            types[i] = UNKNOWN
    _pad(tokens, scores, types, int(vocab_size or 0))
    return tokens, scores, types, {s: i for i, s in enumerate(tokens)}
