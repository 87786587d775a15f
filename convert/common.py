"""Driver for `edgellm convert`: a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)
to a GGUF file as llama.cpp's convert_hf_to_gguf.py writes it.

The HF architectures it accepts, and the GGUF architecture each becomes, come from the one architecture table
(edgellm/architectures.py, `HF_ARCHS`); convert/<arch>.py holds that architecture's `Recipe` (convert/recipe.py):
HF tensor-name patterns -> GGUF names, config.json keys -> GGUF metadata keys, and a few flags (q/k permutation,
norm shift, tied output). Tensors are read one at a time (safetensors.safe_open), converted and streamed to the
output, so memory stays near twice the largest tensor. q8_0 / q4_k_m go through an f16 GGUF in a temporary file,
then convert.quantize_model (llama.cpp's mixes).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convert.recipe import Recipe
from edgellm.architectures import HF_ARCHS
from edgellm.errors import InvalidRequestError, UnsupportedModelError

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_k_m")

# HF tensors that carry nothing llama.cpp needs
SKIP = (re.compile(r".*rotary_emb\.inv_freq"),)


def recipe_for(hf_archs: list[str]) -> tuple[str, Recipe]:
    """(GGUF architecture, its Recipe) for the first supported name in config.json's `architectures`."""
    arch = next((HF_ARCHS[a] for a in hf_archs if a in HF_ARCHS), None)
    if arch is None:
        raise UnsupportedModelError(f"unsupported HF architecture {hf_archs!r} "
                                    f"(supported: {', '.join(sorted(HF_ARCHS))})")
    return arch, importlib.import_module(f"convert.{arch}").RECIPE


def load_config(hf_dir: Path) -> dict:
    cfg = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrapper: text part only
        cfg = {**cfg, **cfg["text_config"]}
    rp = cfg.get("rope_parameters")  # transformers >= 5 moves rope_theta / rope_scaling here
    if isinstance(rp, dict):
        if "rope_theta" not in cfg and "rope_theta" in rp:
            cfg["rope_theta"] = rp["rope_theta"]
        if "rope_theta" not in cfg and isinstance(rp.get("full_attention"), dict):
            cfg["rope_theta"] = rp["full_attention"].get("rope_theta")
        if not cfg.get("rope_scaling") and rp.get("rope_type") not in (None, "default"):
            cfg["rope_scaling"] = rp
    return cfg


# ------------------------------------------------------------------------------------------------------------------
# safetensors, tensor by tensor
# ------------------------------------------------------------------------------------------------------------------

def safetensors_files(hf_dir: Path) -> list[Path]:
    idx = hf_dir / "model.safetensors.index.json"
    if idx.is_file():
        files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        return [hf_dir / f for f in files]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"no *.safetensors files in {hf_dir} (only safetensors checkpoints are supported)")
    return files


class SafetensorsSource:
    """All tensors of a checkpoint: names, shapes, dtypes; `read(name)` loads one as float32."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._handles = {}
        self.where: dict[str, Path] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}
        for f in files:
            h = safe_open(str(f), framework="numpy")
            self._handles[f] = h
            for k in h.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                sl = h.get_slice(k)
                self.where[k] = f
                self.shape[k] = tuple(sl.get_shape())
                self.dtype[k] = sl.get_dtype()
        self._headers: dict[Path, tuple[int, dict]] = {}

    def names(self) -> list[str]:
        return list(self.where)

    def read(self, name: str) -> np.ndarray:
        f = self.where[name]
        if self.dtype[name] in ("BF16", "bfloat16"):  # numpy has no bfloat16: read the raw bits
            raw = self._raw(f, name).view(np.uint16)
            return (raw.astype(np.uint32) << 16).view(np.float32).reshape(self.shape[name])
        return np.asarray(self._handles[f].get_tensor(name), dtype=np.float32)

    def _raw(self, f: Path, name: str) -> np.ndarray:
        if f not in self._headers:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                self._headers[f] = (8 + n, json.loads(fh.read(n)))
        base, header = self._headers[f]
        a, b = header[name]["data_offsets"]
        return np.fromfile(f, dtype=np.uint8, count=b - a, offset=base + a)


# ------------------------------------------------------------------------------------------------------------------
# tensor transforms
# ------------------------------------------------------------------------------------------------------------------

def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half (NeoX) row order -> llama.cpp's interleaved pairs (convert_hf_to_gguf LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def llama3_rope_factors(cfg: dict, head_dim: int) -> np.ndarray | None:
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type", rs.get("type")) != "llama3":
        return None
    base = float(cfg.get("rope_theta", 10000.0))
    factor = rs.get("factor", 8.0)
    low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old_ctx / low, old_ctx / high
    out = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)):
        wl = 2 * math.pi / freq
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old_ctx / wl - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# ------------------------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------------------------

@dataclass
class _Planned:
    gguf_name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]


def _plan(arch: str, spec: Recipe, cfg: dict, src: SafetensorsSource) -> list[_Planned]:
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    out: list[_Planned] = []
    seen = set()
    for name in src.names():
        if any(p.fullmatch(name) for p in SKIP):
            continue
        g = spec.gguf_name(name)
        if g is None:
            if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                "model.multi_modal_projector.")):
                continue
            raise UnsupportedModelError(f"{arch}: no GGUF name for HF tensor {name!r}")
        if g == "output.weight" and (spec.tied_output or cfg.get("tie_word_embeddings") and
                                      "model.embed_tokens.weight" in src.where):
            continue

        def load(name=name, g=g):
            x = src.read(name)
            if spec.permute_qk and g.endswith("attn_q.weight"):
                x = permute_rows(x, n_head)
            elif spec.permute_qk and g.endswith("attn_k.weight"):
                x = permute_rows(x, n_kv)
            if spec.norm_shift and name.endswith("norm.weight"):
                x = x + np.float32(spec.norm_shift)
            return np.ascontiguousarray(x, dtype=np.float32)

        out.append(_Planned(g, src.shape[name], load))
        seen.add(g)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head)
    factors = llama3_rope_factors(cfg, head_dim)
    if factors is not None:
        out.insert(0, _Planned("rope_freqs.weight", factors.shape, lambda f=factors: f))
    if "token_embd.weight" not in seen:
        raise UnsupportedModelError(f"{arch}: checkpoint has no token embedding")
    return out


def _out_type(outtype: str, shape: tuple[int, ...]):
    import gguf

    if len(shape) < 2 or outtype == "f32":
        return gguf.GGMLQuantizationType.F32
    return {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16}[outtype]


def _add_metadata(w, arch: str, spec: Recipe, cfg: dict, outtype: str, name: str) -> None:
    import gguf

    c = {**spec.defaults, **{k: v for k, v in cfg.items() if v is not None}}
    c.setdefault("num_key_value_heads", c.get("num_attention_heads"))
    w.add_name(name)
    for hf_key, key, typ in spec.metadata:
        if hf_key not in c:
            continue
        v = typ(c[hf_key])
        (w.add_uint32 if typ is int else w.add_float32)(f"{arch}.{key}", v)
    n_head, d = int(c["num_attention_heads"]), int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or d // n_head)
    if spec.always_key_length or head_dim != d // n_head:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if spec.rope_dimension_count:
        w.add_rope_dimension_count(head_dim)
    rs = c.get("rope_scaling") or {}
    rtype = rs.get("rope_type", rs.get("type"))
    if rtype == "linear" and rs.get("factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rs["factor"]))
    elif rtype == "yarn" and rs.get("factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rs["factor"]))
        if rs.get("original_max_position_embeddings"):
            w.add_rope_scaling_orig_ctx_len(int(rs["original_max_position_embeddings"]))
    ft = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
          "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]
    w.add_file_type(int(ft))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def convert_hf(hf_dir: str | os.PathLike, dst: str | os.PathLike, *, outtype: str = "f16", progress: bool = False,
               threads: int = 1) -> Path:
    """Convert the HF checkpoint in `hf_dir` to the GGUF file `dst` (outtype f32, f16, bf16, q8_0 or q4_k_m)."""
    outtype = outtype.lower()
    if outtype not in OUTTYPES:
        raise InvalidRequestError(f"unknown outtype {outtype!r}; expected one of {', '.join(OUTTYPES)}")
    hf_dir, dst = Path(hf_dir), Path(dst)
    if outtype in ("q8_0", "q4_k_m"):
        from convert.quantize_model import quantize_model

        fd, tmp = tempfile.mkstemp(suffix=".f16.gguf", dir=dst.parent if dst.parent.exists() else None)
        os.close(fd)
        try:
            convert_hf(hf_dir, tmp, outtype="f16", progress=progress)
            quantize_model(tmp, dst, outtype.upper(), threads=threads, progress=progress)
        finally:
            os.unlink(tmp)
        return dst

    import gguf
    from tqdm import tqdm

    from convert.vocab import add_vocab

    cfg = load_config(hf_dir)
    arch, spec = recipe_for(cfg.get("architectures") or [])
    src = SafetensorsSource(safetensors_files(hf_dir))
    plan = _plan(arch, spec, cfg, src)

    w = gguf.GGUFWriter(str(dst), arch)
    _add_metadata(w, arch, spec, cfg, outtype, cfg.get("_name_or_path") or hf_dir.name)
    n_vocab = add_vocab(w, hf_dir, cfg, spec)
    if n_vocab is not None:
        w.add_vocab_size(n_vocab)
    types = []
    for p in plan:
        t = _out_type(outtype, p.shape)
        types.append(t)
        elem = {gguf.GGMLQuantizationType.F32: 4}.get(t, 2)
        np_dtype = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}.get(
            t, np.uint16)
        raw = t if t == gguf.GGMLQuantizationType.BF16 else None
        w.add_tensor_info(p.gguf_name, p.shape, np.dtype(np_dtype), int(np.prod(p.shape)) * elem, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for p, t in tqdm(list(zip(plan, types)), desc="convert", unit="tensor", disable=not progress):
        x = p.load()
        if x.shape != p.shape:
            raise UnsupportedModelError(f"{p.gguf_name}: shape {x.shape} != {p.shape}")
        if t == gguf.GGMLQuantizationType.F16:
            x = x.astype(np.float16)
        elif t == gguf.GGMLQuantizationType.BF16:
            x = to_bf16(x)
        w.write_tensor_data(x)
        del x
    w.close()
    return dst
