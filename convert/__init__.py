"""HF checkpoint (safetensors + tokenizer) -> GGUF: `convert_hf(hf_dir, dst, outtype=...)`."""
from convert.common import OUTTYPES, convert_hf

__all__ = ["OUTTYPES", "convert_hf"]
