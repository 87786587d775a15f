"""Pre-tokenizer regexes of byte-level BPE vocabularies, by `tokenizer.ggml.pre` name (as llama.cpp's
llama-vocab.cpp lists them), as data."""
from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_LETTERS_UL = r"((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_LETTERS_LU = r"((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UL + r"|[^\r\n\p{L}\p{N}]?" + _LETTERS_LU +
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UL + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?" + _LETTERS_LU +
          _CONTRACTIONS + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK_LATIN = (  # letters of scripts with case, as listed in llama.cpp (escaped: NFC would alter them)
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943")
# llama.cpp matches regexes without \p{..} on text whose non-ASCII spaces became \x0b: "&&[^\s]" does the same
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&[^\\s]]+"
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp pre-splits text for one family of ``tokenizer.ggml.pre`` names (before BPE merges)."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True  # llama.cpp's clean_up_tokenization_spaces on detokenize
    ignore_merges: bool = False  # a whole pre-token that is in the vocab is emitted as-is
    add_bos: bool = False  # default when tokenizer.ggml.add_bos_token is absent


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_PRE_FAMILIES: list[tuple[tuple[str, ...], PreTokenizer]] = [
    (("default",), _DEFAULT),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizer((_LLAMA3,))),
    (("chatglm-bpe",), PreTokenizer((_LLAMA3,))),
    (("deepseek-llm",), PreTokenizer((
        "[\r\n]", r"\s?[" + _DEEPSEEK_LATIN + "]+", "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002&&[^\\s]]+",
        r"\s+$", _CJK_HANGUL, r"\p{N}+"), clean_spaces=False)),
    (("deepseek-coder",), PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
                                       clean_spaces=False)),
    (("deepseek-v3", "hunyuan-dense"), PreTokenizer((
        r"\p{N}{1,3}", _CJK_KANA,
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"), clean_spaces=False)),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"))),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b"), PreTokenizer((r"\p{N}", _GPT2))),
    (("command-r", "smollm"), PreTokenizer((r"\p{N}", _GPT2), clean_spaces=False)),
    (("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "gigachat", "exaone4"),
     PreTokenizer((_GPT2,))),
    (("stablelm2",), PreTokenizer((_QWEN2,))),
    (("qwen2", "deepseek-r1-qwen", "megrez", "hunyuan"), PreTokenizer((_QWEN2,), clean_spaces=False)),
    (("qwen35",), PreTokenizer((_QWEN35,), clean_spaces=False)),
    (("poro-chat",), PreTokenizer((_BLOOM,), clean_spaces=False)),
    (("bloom", "gpt3-finnish"), PreTokenizer((_BLOOM,))),
    (("viking",), PreTokenizer((_BLOOM, r"\p{N}"), clean_spaces=False)),
    (("tekken",), PreTokenizer((_TEKKEN,), clean_spaces=False, ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4"), PreTokenizer((_GPT4O,), clean_spaces=False)),
]
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: spec for names, spec in _PRE_FAMILIES for name in names}
