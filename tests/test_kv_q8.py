"""q8_0 KV cache (kv_dtype="q8_0"): ggml's blocks bit-exact with gguf.quants, attention read in place equal to
llama.cpp's float operations on the dequantized cache, the paged cache's storage, the engine's invariants, the
default model's perplexity and memory, the CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from test_kernels_attention_ops import assert_close_to_ggml

from edgellm import LLM, SamplingParams
from edgellm.engine.engine import Engine
from edgellm.engine.kv_cache import KV_DTYPES, PagedKVCache, check_kv_dtype, to_f16_bits
from edgellm.engine.swa import slots_needed
from edgellm.errors import InvalidRequestError, UnsupportedModelError
from kernels_cpu.attention import attention_reference, paged_attention
from kernels_cpu.attention_q8 import Q8Cache, dequantize_q8_0, quantize_q8_0
from timing import scaled

GREEDY = dict(temperature=0, ignore_eos=True)
Q8 = GGMLQuantizationType.Q8_0


# -- the format ---------------------------------------------------------------------------------------------------
def _rows(rng, n=64, hd=256):
    x = rng.normal(size=(n, hd)).astype(np.float32) * rng.uniform(0.01, 30, size=(n, 1)).astype(np.float32)
    x[0] = 0.0  # a zero block: d = 0, q = 0
    x[1, :32] = np.float32(2.5) * np.arange(-16, 16, dtype=np.float32) / 16  # round-half cases at d = 2.5 / 127
    x[2, 7] = 1e6  # one large value: the rest of its block rounds to 0
    return x


def test_quantize_is_gguf_q8_0_bit_for_bit():
    x = _rows(np.random.default_rng(0))
    c = quantize_q8_0(x.reshape(16, 4, 256))  # (tokens, heads, hd) as the cache stores them
    assert c.qs.shape == (16, 4, 256) and c.qs.dtype == np.int8 and c.d.shape == (16, 4, 8) and c.d.dtype == np.int16
    ref = quantize(x, Q8).reshape(-1, 34)  # gguf's blocks: f16 d, then 32 int8 q
    np.testing.assert_array_equal(c.d.reshape(-1), ref[:, :2].copy().view(np.int16).reshape(-1))
    np.testing.assert_array_equal(c.qs.reshape(-1), ref[:, 2:].reshape(-1).view(np.int8))
    np.testing.assert_array_equal(dequantize_q8_0(c).reshape(x.shape), dequantize(quantize(x, Q8), Q8))


def test_quantize_rejects_rows_not_made_of_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="blocks of 32"):
        Q8Cache(np.zeros((2, 64), np.int8), np.zeros((2, 3), np.int16)).flat()


# -- attention over a q8_0 cache ------------------------------------------------------------------------------------
def _paged_q8(k, v, bs, rng):
    """Scatter contiguous (P, KVH, hd) float k/v, quantized, into shuffled blocks: Q8Cache K, V and the block
    table, and the dequantized k/v (what the cache holds)."""
    P = k.shape[0]
    nblk = -(-P // bs)
    ids = rng.permutation(nblk + 3)[:nblk]
    rows = np.array([ids[p // bs] * bs + p % bs for p in range(P)])

    def page(x):
        c = quantize_q8_0(x)
        qs = np.zeros(((nblk + 3) * bs,) + c.qs.shape[1:], np.int8)
        d = np.zeros(((nblk + 3) * bs,) + c.d.shape[1:], np.int16)
        qs[rows], d[rows] = c.qs, c.d
        return Q8Cache(qs.reshape(nblk + 3, bs, *c.qs.shape[1:]), d.reshape(nblk + 3, bs, *c.d.shape[1:])), \
            dequantize_q8_0(c)
    (kc, kd), (vc, vd) = page(k), page(v)
    return kc, vc, ids[None, :], kd, vd


@pytest.mark.parametrize("H,KVH,hd,window,softcap,bs", [(4, 1, 256, 0, 0.0, 16), (4, 2, 96, 5, 0.0, 16),
                                                        (8, 2, 64, 7, 50.0, 16), (2, 2, 32, 0, 30.0, 4)])
@pytest.mark.parametrize("P", [1, 17, 70])
def test_q8_attention_is_close_to_ggml_on_the_dequantized_cache(H, KVH, hd, window, softcap, bs, P):
    """Within rounding of llama.cpp's float operations (tests/ggml_ref.py) on the values d * q the cache holds:
    prefill and decode rows (the decode row's bits the chunk's), GQA, sliding window, soft-cap, a head size with
    a tail past the vector partials (96), blocks of 4 cells."""
    rng = np.random.default_rng(P * 7 + H + hd)
    k = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    v = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    q = (rng.normal(size=(P, H, hd)) * 3).astype(np.float32)
    kc, vc, bt, kd, vd = _paged_q8(k, v, bs, rng)
    kw = dict(window=window, scale=hd ** -0.5, softcap=softcap)
    got = assert_close_to_ggml(q, kc, vc, bt, kd, vd, **kw)  # the decode step's rows
    # and within q8_0's error of attention over the float K/V
    np.testing.assert_allclose(got, attention_reference(q[-1:], k, v, [P - 1], **kw), atol=0.05)


def test_q8_attention_rows_batch_invariant():
    """A row's result does not depend on the other rows of its sequence or other sequences in the call; a decode
    row sums as the same position in a prefill chunk does, as with an f16 or F32 cache."""
    rng = np.random.default_rng(0)
    k = rng.normal(size=(40, 1, 64)).astype(np.float32)
    v = rng.normal(size=(40, 1, 64)).astype(np.float32)
    kc, vc, bt, _, _ = _paged_q8(k, v, 16, rng)
    q = rng.normal(size=(40, 4, 64)).astype(np.float32)

    def att(rows, pos, seq, bts):
        return paged_attention(q[rows], kc, vc, np.array(pos), np.array(seq), bts, scale=0.1)
    full = att(slice(None), np.arange(40), np.zeros(40, np.int64), bt)
    np.testing.assert_array_equal(full[37:], att(slice(37, 40), [37, 38, 39], [0, 0, 0], bt))
    two = np.concatenate([bt, bt])
    mixed = att([20, 21, 22, 39], [20, 21, 22, 39], [0, 0, 0, 1], two)
    np.testing.assert_array_equal(mixed[:3], full[20:23])
    np.testing.assert_array_equal(mixed[3:], att([39], [39], [0], bt))
    np.testing.assert_array_equal(mixed[3:], full[39:])  # a lone decode row: the prefill chunk's order


# -- the paged cache -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    return LLM(tiny_model("llama"), ctx_size=256, progress=False)


@pytest.fixture(scope="module")
def tiny_gemma(tiny_model):
    return LLM(tiny_model("gemma3"), ctx_size=512, progress=False)


def test_storage_lists_every_array_by_block_and_copy_block_copies_scales(tiny_gemma):
    cfg = tiny_gemma.config
    kv = PagedKVCache(cfg, 12, 4, kv_dtype="q8_0", swa_slots=6)
    assert any(kv.trimmed) and not all(kv.trimmed)
    for i in range(cfg.n_layers):
        arrays = kv.storage(i)
        n = 7 if kv.trimmed[i] else 12  # slots + 1 for a trimmed layer
        assert [(a.dtype, a.shape) for a in arrays] == [(np.dtype(np.int8), (n, 4, cfg.n_kv_heads, 128)),
                                                        (np.dtype(np.int16), (n, 4, cfg.n_kv_heads, 4))] * 2
    full = PagedKVCache(cfg, 12, 4, kv_dtype="q8_0")  # every layer indexed by block
    rng = np.random.default_rng(1)
    k = rng.normal(size=(4, cfg.n_kv_heads, 128)).astype(np.float32)
    v = rng.normal(size=(4, cfg.n_kv_heads, 128)).astype(np.float32)
    full.write(0, np.arange(8, 12), k, v)  # block 2
    kk, vv = full.layer(0)
    np.testing.assert_array_equal(dequantize_q8_0(Q8Cache(kk.qs[2], kk.d[2])), dequantize_q8_0(quantize_q8_0(k)))
    np.testing.assert_array_equal(vv.qs[2], quantize_q8_0(v).qs)
    assert full.copy_block(2, 5, 3)
    for a in full.storage(0):
        np.testing.assert_array_equal(a[5, :3], a[2, :3])  # the scales too
        assert not a[5, 3:].any()
    assert full.storage(0)[1][5, :3].any()


def test_q8_0_bytes_per_token_at_most_0_55_of_f16(default_model):
    from edgellm.api import load_model

    cfg = load_model(default_model, progress=False).config
    size = {dt: PagedKVCache(cfg, 64, 16, kv_dtype=dt).nbytes for dt in ("f16", "q8_0")}
    per_token = {dt: b / (64 * 16) for dt, b in size.items()}
    assert per_token["q8_0"] / per_token["f16"] <= 0.55
    assert per_token["q8_0"] == cfg.n_layers * cfg.n_kv_heads * 2 * (cfg.head_dim + cfg.head_dim // 32 * 2)


def test_bad_kv_dtype_and_head_size_are_named_errors(tiny_model):
    with pytest.raises(InvalidRequestError, match="q8_0"):
        check_kv_dtype("q4_0")
    path = tiny_model("llama", d_model=192, head_dim=48)  # 48 values per head: no whole q8_0 blocks (ggml refuses it too)
    with pytest.raises(UnsupportedModelError, match="multiples of 32"):
        LLM(path, ctx_size=64, progress=False, kv_dtype="q8_0")
    assert LLM(path, ctx_size=64, progress=False, kv_dtype="f16").engine.kv.kv_dtype == "f16"
    assert set(KV_DTYPES) == {"f32", "f16", "bf16", "q8_0"}


# -- the engine with a q8_0 cache --------------------------------------------------------------------------------------
def engine(llm, kv_tokens=1024, **kw) -> Engine:
    return Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size, kv_cache_tokens=kv_tokens,
                  kv_dtype="q8_0", **kw)


def run(eng, prompts, n):
    reqs = [eng.add_request(p, SamplingParams(max_tokens=n, **GREEDY)) for p in prompts]
    while eng.has_work():
        eng.step()
    eng.step()
    assert all(c == 0 for c in eng.pool.ref) and eng.pool.n_free == eng.pool.n_blocks  # no block leaked
    return [(r.output_ids, r.logprobs) for r in reqs]


def alone(llm, prompt, n):
    return run(engine(llm), [prompt], n)[0]


def test_batch_invariance_prefix_hit_and_copy_on_write(tiny_llm):
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(3, 500, int(rng.integers(3, 40))).tolist() for _ in range(6)]
    eng = engine(tiny_llm)
    assert eng.kv.kv_dtype == "q8_0"
    assert run(eng, prompts, 8) == [alone(tiny_llm, p, 8) for p in prompts]  # a batch of 6 == each alone
    shared = [1] + rng.integers(3, 500, 36).tolist()  # 37 tokens: 2 full blocks + 5 rows
    eng = engine(tiny_llm)
    run(eng, [shared], 1)
    (src,) = [b for b, node in eng.prefix.by_block.items() if node.key == tuple(shared[32:])]  # the partial leaf
    before = [a[src].tobytes() for i in range(eng.loaded.config.n_layers) for a in eng.kv.storage(i)]
    follow = [shared + rng.integers(3, 500, k).tolist() for k in (3, 20)]
    got = run(eng, follow, 8)  # each request copies the partial block (qs and scales)
    assert eng.kv_manager.cow_copies == 2 and eng.stats()["prefix_hit_tokens"] == 74
    assert [a[src].tobytes() for i in range(eng.loaded.config.n_layers) for a in eng.kv.storage(i)] == before
    assert got == [alone(tiny_llm, p, 8) for p in follow]  # copied K/V == recomputed K/V, bit for bit


# preemption with a q8_0 cache: tests/test_prefix_cow.py::test_preempted_request_resumes_from_its_own_partial_block


def test_sliding_window_trimming_equals_full_cache(tiny_gemma):
    rng = np.random.default_rng(3)
    base = [1] + rng.integers(3, 500, 30).tolist()
    prompts = [base + rng.integers(3, 500, int(rng.integers(2, 20))).tolist() for _ in range(4)] + [base[:20]]

    def outputs(swa_slots):
        eng = engine(tiny_gemma, 512, max_batch=2, token_budget=16, block_size=4, swa_slots=swa_slots)
        return eng, run(eng, prompts, 10)
    trimmed, got = outputs(slots_needed(2, 8, 4, 16))
    assert trimmed.kv.windows is not None and trimmed.stats()["swa_slots_reused"] > 0
    assert trimmed.kv_manager.cow_copies > 0  # slot-to-slot copies of partial blocks, scales included
    assert got == outputs(0)[1]


# -- the default model -------------------------------------------------------------------------------------------------
GOLDEN = Path(__file__).parent / "golden"


def test_perplexity_within_half_percent_of_f16_kv():
    import json

    from edgellm.perplexity import perplexity

    cfg = json.loads((GOLDEN / "perplexity_gemma3.json").read_text())
    text = (GOLDEN / cfg["text_file"]).read_text()
    ppl = {}
    for dt in ("f16", "q8_0"):
        llm = LLM(kv_dtype=dt, ctx_size=cfg["n_ctx"], progress=False)
        ppl[dt] = perplexity(llm, text, n_ctx=cfg["n_ctx"]).ppl
        llm.shutdown()
    rel = (ppl["q8_0"] - ppl["f16"]) / ppl["f16"]
    print(f"ppl f16 KV {ppl['f16']:.4f}, q8_0 KV {ppl['q8_0']:.4f} ({rel:+.3%})")
    assert abs(rel) <= 0.005


# -- the CLI -------------------------------------------------------------------------------------------------------------
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True, timeout=scaled(300))


def test_cli_kv_dtype(tiny_model, tiny_llm):
    path = tiny_model("llama")
    r = _cli("generate", "--model", path, "--prompt", "hello world", "-n", "6", "--temperature", "0",
             "--kv-dtype", "q8_0")
    assert r.returncode == 0, r.stderr
    llm = LLM(path, ctx_size=256, progress=False, kv_dtype="q8_0")
    assert r.stdout.rstrip("\n") == llm.generate("hello world", SamplingParams(max_tokens=6, temperature=0)).text
    for cmd in (["generate", "--prompt", "hi"], ["perplexity", "--file", str(GOLDEN / "perplexity.txt")], ["serve"],
                ["chat"]):
        r = _cli(*cmd, "--model", path, "--kv-dtype", "q4_0")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "kv_dtype must be one of" in r.stderr, r.stderr


def test_f16_cache_rows_are_what_an_f32_cache_of_their_values_gives():
    """The f16 form goes through the same vector loads (attention_kernel's loaders) as q8_0: bit-identical to an F32
    cache holding the widened values, prefill and decode."""
    rng = np.random.default_rng(2)
    k = rng.normal(size=(2, 16, 2, 96)).astype(np.float32)
    v = rng.normal(size=(2, 16, 2, 96)).astype(np.float32)
    q = rng.normal(size=(3, 4, 96)).astype(np.float32)
    kb, vb = to_f16_bits(k), to_f16_bits(v)
    widen = lambda b: b.view(np.float16).astype(np.float32)  # noqa: E731
    for rows in (slice(None), slice(2, 3)):  # a prefill chunk, a decode row
        args = (np.array([29, 30, 31])[rows], np.zeros(3, np.int64)[rows], np.array([[1, 0]]))
        np.testing.assert_array_equal(paged_attention(q[rows], kb, vb, *args, scale=0.2),
                                      paged_attention(q[rows], widen(kb), widen(vb), *args, scale=0.2))
