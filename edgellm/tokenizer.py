"""GGUF vocabulary -> tokenizer that reproduces llama.cpp's tokenization, plus streaming detokenization.

Two GGUF tokenizer kinds are supported, each backed by a compiled library built from the GGUF vocab:

* ``llama`` (SentencePiece-style, e.g. Gemma, Llama 2): a sentencepiece BPE ``ModelProto`` is serialized
  straight from the token list, scores and types, so the merge loop (highest score first, byte fallback
  ``<0xNN>``) runs in sentencepiece's C++ code.
* ``gpt2`` (byte-level BPE, e.g. Llama 3, Qwen 2): a ``tokenizers`` BPE model with the GGUF merges and the
  pre-tokenizer regexes llama.cpp uses for the ``tokenizer.ggml.pre`` name.

What llama.cpp does around the merge loop is done here, in the same order: special/user-defined tokens are
split out of the text first (longest token text first), the SPM space prefix, BOS/EOS, the end-of-generation
set, ``token_to_piece`` and ``detokenize`` (leading-space strip, clean-up of spaces for some BPE vocabs).
"""
from __future__ import annotations

import codecs
import re
from typing import Iterable, Sequence

import numpy as np

from edgellm.gguf_file import StringArray, read_gguf
from edgellm.metadata_schema import check_tokenizer_metadata
from edgellm.pretokenizers import PRE_TOKENIZERS, PreTokenizer
from edgellm.errors import UnsupportedModelError

# llama.cpp token attributes (bit flags) and the GGUF token_type -> attribute table
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL = 1, 2, 4, 8
ATTR_USER_DEFINED, ATTR_BYTE, ATTR_LSTRIP, ATTR_RSTRIP = 16, 32, 128, 256
_TYPE_TO_ATTR = np.array([0, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_UNUSED, ATTR_BYTE],
                         dtype=np.int32)
_SPECIAL = ATTR_CONTROL | ATTR_UNKNOWN
_C_SPACE = " \t\n\v\f\r"  # C isspace(), used for the lstrip/rstrip token attributes

# token texts llama.cpp treats as end-of-turn / end-of-generation when the metadata does not say
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
             "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: user-defined

# --- BPE pre-tokenizers: the regexes llama.cpp applies one after the other, by tokenizer.ggml.pre name ----------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE token texts are written in it)."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], n = chr(256 + n), n + 1
    return table


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _pb_field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _pb_ints(pairs: Iterable[tuple[int, int]]) -> bytes:
    return b"".join(_varint(num << 3) + _varint(v & 0xFFFFFFFFFFFFFFFF) for num, v in pairs)


def spm_model_proto(pieces: Sequence[str], scores: np.ndarray, sp_types: np.ndarray, *, byte_fallback: bool,
                    unk_id: int) -> bytes:
    """Serialize a sentencepiece ``ModelProto`` (BPE, identity normalizer) without protobuf, vectorized.

    Each piece is ``message SentencePiece {string piece = 1; float score = 2; Type type = 3;}`` inside
    ``ModelProto.pieces = 1``; ``trainer_spec = 2`` selects BPE and byte fallback, ``normalizer_spec = 3`` only
    turns spaces into U+2581 (no dummy prefix, no whitespace folding), as llama.cpp's SPM tokenizer does.
    """
    n = len(pieces)
    blob = np.frombuffer("\0".join(pieces).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    seps = np.flatnonzero(blob == 0)  # (n - 1,) piece boundaries, unless a piece itself contains NUL
    if len(seps) == n - 1:
        starts = np.concatenate([[0], seps + 1])
        nb = np.diff(np.append(starts, blob.size + 1)) - 1  # (n,) UTF-8 bytes per piece
        blob = np.delete(blob, seps)
    else:
        nb = np.array([len(t.encode("utf-8", "surrogatepass")) for t in pieces], dtype=np.int64)
        blob = np.frombuffer("".join(pieces).encode("utf-8", "surrogatepass"), dtype=np.uint8)
    if nb.max(initial=0) >= 16000:
        raise UnsupportedModelError("a vocabulary token is longer than 16000 bytes")
    vl_nb = 1 + (nb >= 128)
    body = 1 + vl_nb + nb + 5 + 2  # piece field, score field, type field
    vl_body = 1 + (body >= 128)
    total = 1 + vl_body + body
    off = np.concatenate([[0], np.cumsum(total)[:-1]])
    out = np.zeros(int(total.sum()), dtype=np.uint8)
    out[off] = 0x0A
    out[off + 1] = (body & 0x7F) | np.where(body >= 128, 0x80, 0)
    two = body >= 128
    out[(off + 2)[two]] = body[two] >> 7
    p = off + 1 + vl_body
    out[p] = 0x0A
    out[p + 1] = (nb & 0x7F) | np.where(nb >= 128, 0x80, 0)
    two = nb >= 128
    out[(p + 2)[two]] = nb[two] >> 7
    q = p + 1 + vl_nb
    byte_start = np.concatenate([[0], np.cumsum(nb)[:-1]])
    dest = np.repeat((q - byte_start).astype(np.int32), nb)  # (n_bytes,) where each vocab byte goes
    dest += np.arange(blob.size, dtype=np.int32)
    out[dest] = blob
    r = q + nb
    out[r] = 0x15
    sb = np.ascontiguousarray(scores, dtype="<f4").view(np.uint8).reshape(n, 4)
    for k in range(4):
        out[r + 1 + k] = sb[:, k]
    out[r + 5] = 0x18
    out[r + 6] = sp_types
    trainer = _pb_ints([(3, 2), (35, int(byte_fallback)), (40, unk_id), (41, -1), (42, -1), (43, -1)])
    normalizer = _pb_field(1, b"identity") + _pb_ints([(3, 0), (4, 0), (5, 1)])
    return out.tobytes() + _pb_field(2, trainer) + _pb_field(3, normalizer)


class _SpecialSplitter:
    """llama.cpp ``tokenizer_st_partition``: cut special and user-defined token texts out of raw text.

    Tokens are tried longest text first; each one replaces all its occurrences in the still-raw fragments.
    Which tokens occur at all is found through their first three characters: a group of thousands of
    ``<unusedN>`` tokens costs one substring search plus a few set look-ups per occurrence of ``<un``.
    """

    def __init__(self, entries: list[tuple[str, int, int]]):  # (text, id, attr)
        entries.sort(key=lambda e: (-len(e[0]), e[1]))
        self._rank = {e[1]: i for i, e in enumerate(entries)}
        self._by_text: dict[str, tuple[str, int, int]] = {}
        groups: dict[str, set[str]] = {}
        for e in entries:
            self._by_text.setdefault(e[0], e)
            groups.setdefault(e[0][:3], set()).add(e[0])
        # per 3-char key: token texts, and (built on first use) either the run character or all text prefixes
        self._groups: list[list] = [[key, texts, None] for key, texts in groups.items()]

    def _occurring(self, text: str) -> set[str]:
        found: set[str] = set()
        for group in self._groups:
            key, texts, index = group
            if key not in text:
                continue
            if len(texts) <= 8:
                found.update(t for t in texts if t in text)
                continue
            if index is None:
                run = all(len(set(t)) == 1 for t in texts)  # e.g. runs of 3..31 newlines, tabs or spaces
                index = group[2] = key[0] if run else {t[:n] for t in texts for n in range(4, len(t) + 1)}
            if isinstance(index, str):  # every run token not longer than the longest run occurs
                longest = max(len(m) for m in re.findall(re.escape(index) + "{3,}", text))
                found.update(t for t in texts if len(t) <= longest)
                continue
            pos = text.find(key)
            while pos >= 0:  # extend each occurrence of the key while it is a prefix of some token
                if key in texts:
                    found.add(key)
                n = 4
                while pos + n <= len(text) and (s := text[pos:pos + n]) in index:
                    if s in texts:
                        found.add(s)
                    n += 1
                pos = text.find(key, pos + 1)
        return found

    def split(self, text: str, parse_special: bool) -> list[str | int]:
        found = [self._by_text[t] for t in self._occurring(text)]
        if not parse_special:
            found = [e for e in found if not e[2] & _SPECIAL]
        if not found:
            return [text]
        found.sort(key=lambda e: self._rank[e[1]])
        frags: list[str | int] = [text]
        for tok, tid, attr in found:
            out: list[str | int] = []
            for f in frags:
                if type(f) is int or tok not in f:
                    out.append(f)
                    continue
                pos = 0
                while (m := f.find(tok, pos)) >= 0:
                    left = f[pos:m]
                    if attr & ATTR_LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        out.append(left)
                    out.append(tid)
                    pos = m + len(tok)
                    if attr & ATTR_RSTRIP:
                        while pos < len(f) and f[pos] in _C_SPACE:
                            pos += 1
                if pos < len(f):
                    out.append(f[pos:])
            frags = out
        return frags


class Tokenizer:
    """Encode text to token ids and back exactly as llama.cpp does for the same GGUF vocabulary.

    Build it with :meth:`from_metadata` (a GGUF metadata dict) or :meth:`from_gguf` (a file path).
    Attributes: ``kind`` ("llama" or "gpt2"), ``pre`` (pre-tokenizer name), ``vocab_size``, ``bos_id``,
    ``eos_id``, ``eot_id``, ``unk_id``, ``pad_id`` (None when absent), ``stop_ids`` (llama.cpp's
    end-of-generation set), ``add_bos``/``add_eos`` (metadata defaults for :meth:`encode`).
    """

    def __init__(self, meta: dict):
        meta = check_tokenizer_metadata(meta)  # a no-op for metadata checked at load (LoadedModel.metadata)
        kind = meta["tokenizer.ggml.model"]
        if kind not in ("llama", "gpt2"):
            raise UnsupportedModelError(f"unsupported tokenizer model {kind!r} (supported: 'llama', 'gpt2')")
        tokens = meta["tokenizer.ggml.tokens"]
        if not isinstance(tokens, StringArray):  # keep the compact array; copy anything else
            tokens = list(tokens)
            if tokens and not isinstance(tokens[0], str):
                tokens = [t.decode("utf-8", "surrogateescape") for t in tokens]
        if "" in tokens:  # llama.cpp renames empty tokens
            tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.kind: str = kind
        self.tokens: list[str] = tokens
        self.vocab_size: int = len(tokens)
        n = self.vocab_size
        types = meta.get("tokenizer.ggml.token_type")
        types = np.ones(n, np.int32) if types is None else np.asarray(types, dtype=np.int64)  # (n,)
        attr = _TYPE_TO_ATTR[np.clip(types, 0, 6)] * (types <= 6)  # (n,) int32 flags
        self.pre = meta.get("tokenizer.ggml.pre") or "default"

        def tid(key: str, default: int | None) -> int | None:
            v = meta.get("tokenizer.ggml." + key)  # the schema dropped an out-of-range id: llama.cpp's default
            if v is not None:
                return int(v)
            return default if default is not None and default < n else None

        spm = kind == "llama"
        if spm:
            pre_spec, self.add_space_prefix = None, True
        else:
            if self.pre not in PRE_TOKENIZERS:
                raise UnsupportedModelError(f"unsupported BPE pre-tokenizer {self.pre!r}")
            pre_spec, self.add_space_prefix = PRE_TOKENIZERS[self.pre], False
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", self.add_space_prefix))
        self.clean_spaces = bool(pre_spec and pre_spec.clean_spaces)
        self.bos_id = tid("bos_token_id", 1 if spm else None)
        self.eos_id = tid("eos_token_id", 2 if spm else None)
        self.unk_id = tid("unknown_token_id", 0 if spm else None)
        self.pad_id = tid("padding_token_id", None)
        self.eot_id = tid("eot_token_id", None)
        self.eom_id = tid("eom_token_id", None)
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", spm or bool(pre_spec and pre_spec.add_bos)))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))

        # llama.cpp finds EOT / EOG tokens by text and forces them to be control tokens
        present = (set(EOT_TEXTS) | set(EOG_TEXTS) | set(ALWAYS_RENDERED)).intersection(tokens)
        rev = tokens[::-1] if present else []
        by_text = {t: n - 1 - rev.index(t) for t in present}  # last occurrence wins, as in llama.cpp
        if self.eot_id is None:  # llama.cpp takes the first in hash-map order, in practice the highest id
            self.eot_id = max((by_text[t] for t in EOT_TEXTS if t in by_text), default=None)
        eog = {by_text[t] for t in EOG_TEXTS if t in by_text}
        for i in eog | {self.eot_id} - {None}:
            attr[i] |= ATTR_CONTROL
        for t in ALWAYS_RENDERED:
            if t in by_text:
                attr[by_text[t]] = ATTR_USER_DEFINED
        eog |= {i for i in (self.eos_id, self.eot_id, self.eom_id) if i is not None}
        for i in (meta.get(f"tokenizer.ggml.fim_{k}_token_id") for k in ("pad", "rep", "sep")):
            if i is not None:
                eog.add(int(i))
        texts = {tokens[i]: i for i in eog}
        if {"<|return|>", "<|end|>"} <= texts.keys() and ({"<|call|>"} & texts.keys() or
                                                           {"<|calls|>", "<|flush|>"} <= texts.keys()):
            eog.discard(texts["<|end|>"])  # gpt-oss / solar-open: <|end|> ends a message, not generation
            attr[texts["<|end|>"]] = ATTR_USER_DEFINED
        self.stop_ids: frozenset[int] = frozenset(eog)
        name = str(meta.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:  # llama.cpp: Phi-3 special tokens eat the spaces after them
            attr[(attr & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)) != 0] |= ATTR_RSTRIP
            for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                i = self.token_to_id(t)
                if i is not None:
                    attr[i] = attr[i] | ATTR_RSTRIP if on else attr[i] & ~ATTR_RSTRIP
        self._attr = attr
        special = np.nonzero(attr & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))[0]
        self._splitter = _SpecialSplitter([(tokens[i], int(i), int(attr[i])) for i in special])
        self._pieces: list[bytes | None] = [None] * n  # token_to_piece(special=True) cache, filled lazily
        self._backend = _SpmBackend(self, meta) if spm else _BpeBackend(self, meta, pre_spec)

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from GGUF metadata (``tokenizer.ggml.*`` keys); raises UnsupportedModelError on unknown kinds
        and GGUFError on malformed values (``metadata_schema``)."""
        return cls(meta)

    @classmethod
    def from_gguf(cls, path: str) -> "Tokenizer":
        """Build from the metadata of a GGUF file (tensors are not read)."""
        return cls(check_tokenizer_metadata(read_gguf(path).metadata, path=path))

    # --- encoding -----------------------------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool | None = None, add_eos: bool | None = None,
               special: bool = True) -> list[int]:
        """Token ids of ``text`` (llama.cpp ``llama_tokenize``).

        ``add_bos`` / ``add_eos``: None follows the metadata. ``special=True`` turns control-token texts such as
        ``<start_of_turn>`` into their ids (llama.cpp ``parse_special``); user-defined tokens always are.
        """
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.append(self.bos_id)
        if text:
            frags = self._splitter.split(text, special)
            raw = [f for f in frags if type(f) is str]
            encoded = iter(self._backend.encode(raw) if raw else [])
            for f in frags:
                if type(f) is int:
                    ids.append(f)
                else:
                    ids.extend(next(encoded))
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    # --- decoding -----------------------------------------------------------------------------------------------
    def token_to_piece(self, token_id: int, *, special: bool = True) -> bytes:
        """The bytes one token contributes to the text (llama.cpp ``llama_token_to_piece``, no lstrip).

        With ``special=False`` control and unknown tokens give ``b""``.
        """
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range [0, {self.vocab_size})")
        if not special and self._attr[token_id] & _SPECIAL:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = _piece(self.tokens[token_id], int(self._attr[token_id]), self.kind == "gpt2")
            self._pieces[token_id] = piece
        return piece

    id_to_bytes = token_to_piece

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """llama.cpp ``llama_detokenize(remove_special=skip_special, unparse_special=not skip_special)`` bytes."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space, ids = False, ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        pieces = [self.token_to_piece(i, special=not skip_special) for i in ids]
        if remove_space and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        out = b"".join(pieces)
        return clean_up_spaces(out) if self.clean_spaces else out

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (e.g. a cut-off byte-fallback sequence) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", "replace")

    # --- vocabulary queries -------------------------------------------------------------------------------------
    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens (the ones ``skip_special`` hides)."""
        return bool(self._attr[token_id] & _SPECIAL)

    def is_eog(self, token_id: int) -> bool:
        """True if generating this token ends generation (llama.cpp ``llama_vocab_is_eog``)."""
        return token_id in self.stop_ids

    def token_to_id(self, text: str) -> int | None:
        """Id of the token whose vocabulary text is ``text`` (last one wins, as in llama.cpp), or None."""
        if not hasattr(self, "_text_to_id"):
            self._text_to_id = {t: i for i, t in enumerate(self.tokens)}
        return self._text_to_id.get(text)


def _piece(text: str, attr: int, byte_level: bool) -> bytes:
    """llama.cpp ``token_to_piece`` of one vocab entry (special=True): the bytes the token stands for."""
    if attr & (_SPECIAL | ATTR_USER_DEFINED):
        return text.encode("utf-8", "surrogateescape")
    if attr & ATTR_BYTE:
        return bytes([int(text[3:5], 16)])
    if not attr & ATTR_NORMAL:
        return b""  # unused / undefined tokens print nothing
    if not byte_level:
        return text.replace("\u2581", " ").encode("utf-8", "surrogateescape")
    raw = [_BYTE_DECODER.get(ch) for ch in text]
    if None not in raw:
        return bytes(raw)
    # a character outside GPT-2's byte alphabet: llama.cpp writes a marker instead
    return b"".join(bytes([b]) if b is not None else b"[UNK_BYTE_0x" + ch.encode().hex().encode() + text.encode() + b"]"
                    for ch, b in zip(text, raw))


def clean_up_spaces(text: bytes) -> bytes:
    """llama.cpp's three clean-up passes: `` ?``/`` !``/`` .``/`` ,``; `` ' ``; `` 's`` `` 'm`` `` 're`` `` 've``."""
    text = re.sub(rb" (?=[?!.,])", b"", text)
    text = re.sub(rb" ' ", b"'", text)
    return re.sub(rb" (?='(?:s|m|re|ve))", b"", text)


class _SpmBackend:
    """SentencePiece-style merges in sentencepiece's C++ BPE, built from the GGUF vocab."""

    def __init__(self, tok: Tokenizer, meta: dict):
        import sentencepiece

        n = tok.vocab_size
        scores = meta.get("tokenizer.ggml.scores")
        scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, dtype=np.float32)[:n]
        is_byte = (tok._attr & ATTR_BYTE) != 0
        byte_fallback = bool(is_byte.sum() == 256)
        # llama.cpp merges into any vocab entry whatever its type, so everything but bytes/unk is NORMAL here
        sp_types = np.where(is_byte & byte_fallback, 6, 1).astype(np.uint8)  # (n,)
        unk = tok.unk_id if tok.unk_id is not None else 0
        sp_types[unk] = 2
        pieces = tok.tokens
        proc = sentencepiece.SentencePieceProcessor()
        for _ in range(2):
            try:
                proc.LoadFromSerializedProto(spm_model_proto(pieces, scores, sp_types, byte_fallback=byte_fallback,
                                                             unk_id=unk))
                break
            except RuntimeError:  # duplicate texts: only the last is reachable (llama.cpp's token_to_id)
                last = {t: i for i, t in enumerate(pieces)}
                pieces = [t if last[t] == i else f"\uf8ff\uf8fe{i}\uf8fe" for i, t in enumerate(pieces)]
        else:
            raise UnsupportedModelError("sentencepiece rejected the GGUF vocabulary")
        self._proc = proc
        self._prefix = " " if tok.add_space_prefix else ""

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._prefix:
            texts = [self._prefix + t for t in texts]
        return self._proc.encode(texts, num_threads=1)  # threads cost more than they save on prompts


class _BpeBackend:
    """Byte-level BPE (GPT-2 style) in the ``tokenizers`` library with llama.cpp's pre-tokenizer regexes."""

    def __init__(self, tok: Tokenizer, meta: dict, pre: PreTokenizer):
        from tokenizers import Regex, Tokenizer as HFTokenizer, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(tok.tokens)}
        merges = []
        for m in meta.get("tokenizer.ggml.merges") or []:
            m = m.decode("utf-8", "surrogateescape") if isinstance(m, bytes) else m
            pos = m.find(" ", 1)  # as llama.cpp: a merge's first part may itself start with a space
            a, b = (m[:pos], m[pos + 1:]) if pos >= 0 else ("", "")
            if a in vocab and b in vocab and a + b in vocab:  # tokenizers needs merges inside the vocab
                merges.append((a, b))
        model = models.BPE(vocab, merges, ignore_merges=pre.ignore_merges)
        hf = HFTokenizer(model)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        self._hf = hf

    def encode(self, texts: list[str]) -> list[list[int]]:
        if len(texts) == 1:
            return [self._hf.encode(texts[0], add_special_tokens=False).ids]
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas whose concatenation equals ``Tokenizer.decode``.

    Bytes are held back until they form complete UTF-8 characters (a byte-fallback emoji arrives as four
    tokens and is emitted once, whole), and, for vocabularies with llama.cpp's space clean-up, until no
    pending space can still be removed by what follows. The first piece loses its leading space when the
    vocabulary adds a space prefix, as ``llama_detokenize`` does.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._n = 0  # tokens seen
        self._remove_space = tokenizer.add_space_prefix
        self._held = b""  # raw bytes not yet past the clean-up stage
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        """Feed one token id; returns the text that is now final (possibly "")."""
        tok, first = self.tokenizer, self._n == 0
        self._n += 1
        if first and self.skip_special and tok.add_bos and token_id == tok.bos_id:
            self._remove_space = False
            return ""
        piece = tok.token_to_piece(token_id, special=not self.skip_special)
        if self._remove_space:
            self._remove_space = False
            if piece[:1] == b" ":
                piece = piece[1:]
        if not tok.clean_spaces:
            return self._utf8.decode(piece)
        buf = self._held + piece
        cut = len(buf)
        while cut > 0 and (sp := buf.rfind(b" ", max(0, cut - 3), cut)) >= 0:
            cut = sp  # a space in the last 3 bytes may still be removed by the clean-up
        self._held = buf[cut:]
        return self._utf8.decode(clean_up_spaces(buf[:cut])) if cut else ""

    def flush(self) -> str:
        """End of stream: return everything still held (incomplete UTF-8 becomes U+FFFD)."""
        held, self._held = self._held, b""
        text = clean_up_spaces(held) if held else b""
        return self._utf8.decode(text, final=True)
