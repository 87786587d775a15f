"""Paged attention and element-wise ops against their NumPy twins."""
from __future__ import annotations

from pathlib import Path

import ggml_ref
import numpy as np
import pytest

from kernels_cpu.attention import attention_plan, attention_reference, paged_attention
from kernels_cpu.parallel import get_threads
from kernels_cpu.ops import GELU_F16, apply_rope, geglu, qk_norm_rope, rmsnorm, rope_tables, swiglu


def _paged(k, v, bs, rng):
    """Scatter contiguous (P, KVH, hd) k/v into shuffled blocks; returns caches and the block table."""
    P = k.shape[0]
    nblk = -(-P // bs)
    ids = rng.permutation(nblk + 3)[:nblk]
    kc = np.zeros((nblk + 3, bs) + k.shape[1:], k.dtype)
    vc = np.zeros((nblk + 3, bs) + v.shape[1:], v.dtype)
    for p in range(P):
        kc[ids[p // bs], p % bs] = k[p]
        vc[ids[p // bs], p % bs] = v[p]
    return kc, vc, ids[None, :]


@pytest.mark.parametrize("H,KVH,hd,window,softcap", [(4, 1, 64, 0, 0.0), (4, 2, 32, 5, 0.0), (2, 2, 16, 0, 30.0),
                                                     (8, 4, 48, 7, 50.0)])
@pytest.mark.parametrize("P", [1, 17, 40])
def test_paged_attention_matches_reference(H, KVH, hd, window, softcap, P):
    rng = np.random.default_rng(P + H)
    k = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    v = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    T = min(P, 9)
    pos = np.arange(P - T, P)
    q = rng.normal(size=(T, H, hd)).astype(np.float32)
    kc, vc, bt = _paged(k, v, 16, rng)
    got = paged_attention(q, kc, vc, pos, np.zeros(T, np.int64), bt, window=window, scale=hd ** -0.5, softcap=softcap)
    want = attention_reference(q, k, v, pos, window=window, scale=hd ** -0.5, softcap=softcap)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_attention_rows_batch_invariant():
    rng = np.random.default_rng(0)
    k = rng.normal(size=(30, 1, 32)).astype(np.float32)
    v = rng.normal(size=(30, 1, 32)).astype(np.float32)
    kc, vc, bt = _paged(k, v, 16, rng)
    q = rng.normal(size=(30, 4, 32)).astype(np.float32)
    att = lambda rows, pos, seq, bts: paged_attention(q[rows], kc, vc, np.array(pos), np.array(seq), bts, scale=0.1)  # noqa: E731
    full = att(slice(None), np.arange(30), np.zeros(30, np.int64), bt)
    # a prefill row does not depend on how many rows of its sequence share the call (2 or 30)
    np.testing.assert_array_equal(full[28:], att(slice(28, 30), [28, 29], [0, 0], bt))
    # nor on other sequences' rows: sequence 1 (same cache) decodes position 29 next to sequence 0's chunk
    two = np.concatenate([bt, bt])
    mixed = att([20, 21, 22, 29], [20, 21, 22, 29], [0, 0, 0, 1], two)
    np.testing.assert_array_equal(mixed[:3], full[20:23])
    np.testing.assert_array_equal(mixed[3:], att([29], [29], [0], bt))
    # a sequence's single row (a decode step) sums as the same position in a prefill chunk does, bit for bit
    np.testing.assert_array_equal(mixed[3:], full[29:])


@pytest.mark.parametrize("H,KVH,hd,window,softcap", [(4, 1, 64, 0, 0.0), (8, 1, 40, 0, 0.0), (2, 2, 48, 6, 30.0),
                                                     (32, 8, 64, 0, 0.0), (16, 1, 24, 9, 0.0)])
def test_attention_rows_are_invariant_to_chunking_and_batching(H, KVH, hd, window, softcap):
    """Each row's bits are the same whether it is computed in a long prefill chunk (query vectors as the lanes of
    qk_lanes' jobs), in short chunks that start anywhere, or alone as a decode row (qk_cells), next to other
    sequences' rows; head sizes with leftovers past the vector partials (40, 24), GQA groups of 1 to 16 query
    heads (16: a job of one row), a sliding window, a soft-cap."""
    rng = np.random.default_rng(H + hd)
    P = 45
    k = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    v = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    q = (rng.normal(size=(P, H, hd)) * 2).astype(np.float32)
    kc, vc, bt = _paged(k, v, 16, rng)
    kw = dict(window=window, scale=hd ** -0.5, softcap=softcap)

    def att(rows, seqs=None, tables=bt):
        rows = np.asarray(rows)
        seq = np.zeros(len(rows), np.int64) if seqs is None else np.asarray(seqs)
        return paged_attention(q[rows], kc, vc, rows, seq, tables, **kw)
    full = att(np.arange(P))
    np.testing.assert_allclose(full, attention_reference(q, k, v, np.arange(P), **kw), rtol=2e-5, atol=2e-5)
    for cut in (1, 7, 13, 30):  # chunked prefill: rows [0, cut) then [cut, P)
        np.testing.assert_array_equal(np.concatenate([att(np.arange(cut)), att(np.arange(cut, P))]), full)
    for p in (0, 5, 17, 44):  # decode rows, alone and next to another sequence's chunk
        np.testing.assert_array_equal(att([p]), full[p:p + 1])
        two = np.concatenate([bt, bt])
        mixed = att([10, 11, 12, p], [1, 1, 1, 0], two)
        np.testing.assert_array_equal(mixed[3:], full[p:p + 1])
        np.testing.assert_array_equal(mixed[:3], full[10:13])


@pytest.mark.parametrize("H,KVH,hd,window,softcap", [(4, 1, 256, 0, 0.0), (4, 2, 64, 5, 0.0), (2, 2, 48, 0, 30.0),
                                                     (8, 4, 16, 7, 0.0), (16, 2, 32, 0, 0.0)])
@pytest.mark.parametrize("P", [1, 17, 70])
def test_paged_attention_is_close_to_ggml(H, KVH, hd, window, softcap, P):
    """Within float rounding of the NumPy twin of llama.cpp's float operations (tests/ggml_ref.py), prefill chunk
    and decode row; the decode row's bits are the chunk's last row's."""
    rng = np.random.default_rng(P * 7 + H + hd)
    k = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    v = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    q = (rng.normal(size=(P, H, hd)) * 3).astype(np.float32)
    kc, vc, bt = _paged(k, v, 16, rng)
    assert_close_to_ggml(q, kc, vc, bt, k, v, window=window, scale=hd ** -0.5, softcap=softcap)


def assert_close_to_ggml(q, kc, vc, bt, k, v, **kw):
    """Paged attention over caches kc/vc (block table bt) of the last 9 rows of q as a prefill chunk and of its
    last row as a decode step: within float rounding of tests/ggml_ref.py's orders on the values k/v (P, KVH, hd)
    they hold (llama.cpp: a chunk's order, a one-token batch's), and the decode row equal to the chunk's last row,
    bit for bit. Returns the decode row."""
    P = len(q)
    rows = np.arange(max(0, P - 9), P)
    tol = dict(rtol=1e-5, atol=2e-6)
    chunk = paged_attention(q[rows], kc, vc, rows, np.zeros(len(rows), np.int64), bt, **kw)
    np.testing.assert_allclose(chunk, ggml_ref.attention(q[rows], k, v, rows, single=False, **kw), **tol)
    last = rows[-1:]  # a decode step
    got = paged_attention(q[last], kc, vc, last, np.zeros(1, np.int64), bt, **kw)
    np.testing.assert_array_equal(got, chunk[-1:])
    np.testing.assert_allclose(got, ggml_ref.attention(q[last], k, v, last, single=True, **kw), **tol)
    return got


@pytest.mark.parametrize("form", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("P,window", [(1, 0), (17, 5), (70, 0)])
def test_attention_sinks_are_close_to_ggml(form, P, window):
    """gpt-oss's attention sinks (a per-head logit in each softmax's max and denominator, no value): within
    rounding of llama.cpp's float operations for every K/V cache form, and of the float64 twin; no sinks and
    sinks=None give the same bits."""
    from edgellm.engine.kv_cache import to_f16_bits
    from kernels_cpu.attention_q8 import Q8Cache, dequantize_q8_0, quantize_q8_0

    H, KVH, hd = 12, 2, 64  # 6 heads a KV head: a decode row is a job of 6 query vectors (qk_lanes' 8 lanes)
    rng = np.random.default_rng(P + len(form))
    k = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    v = rng.normal(size=(P, KVH, hd)).astype(np.float32)
    q = (rng.normal(size=(P, H, hd)) * 3).astype(np.float32)
    # heads 3, 7, 11: the sink dominates (its max replaces the row's)
    sinks = np.tile(np.float32([2.0, -1.0, 0.5, 30.0]), 3)
    if form == "f16":
        k, v = (x.astype(np.float16).astype(np.float32) for x in (k, v))
        kc, vc, bt = _paged(to_f16_bits(k), to_f16_bits(v), 16, rng)
    elif form == "q8_0":
        kq, vq = quantize_q8_0(k), quantize_q8_0(v)
        k, v = dequantize_q8_0(kq), dequantize_q8_0(vq)
        (kqs, vqs, bt), (kd, vd, _) = _paged(kq.qs, vq.qs, 16, np.random.default_rng(0)), \
            _paged(kq.d, vq.d, 16, np.random.default_rng(0))
        kc, vc = Q8Cache(kqs, kd), Q8Cache(vqs, vd)
    else:
        kc, vc, bt = _paged(k, v, 16, rng)
    kw = dict(window=window, scale=hd ** -0.5)
    got = assert_close_to_ggml(q, kc, vc, bt, k, v, sinks=sinks, **kw)
    np.testing.assert_allclose(got, attention_reference(q[-1:], k, v, [P - 1], sinks=sinks, **kw), rtol=2e-5,
                               atol=2e-5)
    row = np.arange(P - 1, P)
    plain = paged_attention(q[row], kc, vc, row, np.zeros(1, np.int64), bt, **kw)
    assert not np.array_equal(got, plain)
    np.testing.assert_array_equal(plain, paged_attention(q[row], kc, vc, row, np.zeros(1, np.int64), bt,
                                                         sinks=None, **kw))
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(q[row], kc, vc, row, np.zeros(1, np.int64), bt, sinks=sinks[:2], **kw)


def test_attention_is_llama_cpps():
    """Gemma 3 layer 0 in llama.cpp (tests/golden/attention_ops.npz): prefill rows and the decode step within float
    rounding of llama.cpp's outputs (its own orders, which tests/ggml_ref.py reproduces bit for bit)."""
    g = np.load(Path(__file__).parent / "golden" / "attention_ops.npz")
    k, v, q, pos, want = g["attn_k"][:, None], g["attn_v"][:, None], g["attn_q"], g["attn_pos"], g["attn_out"]
    rng = np.random.default_rng(9)
    kc, vc, bt = _paged(k, v, 16, rng)
    kw = dict(window=512, scale=float(g["attn_scale"]))
    pre = paged_attention(q[:-1], kc, vc, pos[:-1], np.zeros(len(pos) - 1, np.int64), bt, **kw)  # rows of a prefill
    dec = paged_attention(q[-1:], kc, vc, pos[-1:], np.zeros(1, np.int64), bt, **kw)  # the decode step
    np.testing.assert_allclose(pre, want[:-1], rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(dec, want[-1:], rtol=1e-5, atol=2e-6)
    assert np.abs(pre - want[:-1]).max() > 0  # (the orders differ: a check that compares something)
    np.testing.assert_array_equal(ggml_ref.attention(q[:-1], k, v, pos[:-1], single=False, **kw), want[:-1])
    np.testing.assert_array_equal(ggml_ref.attention(q[-1:], k, v, pos[-1:], single=True, **kw), want[-1:])


def test_softmax_exponentials_are_ggml_expf():
    """The softmax's vector exponentials (attention_kernel.exp_sum) are ops.ggml_expf's values bit for bit: normal
    values, the clamp edges, +-inf and NaN, each lane less its own max; the denominators are float64 sums over
    the rows in order."""
    import numba

    from kernels_cpu.attention_kernel import exp_sum
    from kernels_cpu.ops import expf

    @numba.njit
    def run(s, n, m, total):
        exp_sum(s, n, m, total, 8)

    rng = np.random.default_rng(3)
    edges = np.float32([np.nan, np.inf, -np.inf, 88.7, 89.0, -87.3, -103.9, -150.0, 0.0, -0.0, 1e-40, 200, -200,
                        133.0, -133.0, 1e30])
    x = np.concatenate([(rng.normal(size=1000) * 40).astype(np.float32), edges, -edges]).reshape(-1, 8)
    m = np.float32([0.0, 2.5, -7.0, 0.0, 1e-3, 40.0, -40.0, 3.0])
    s, total = x.copy(), np.zeros(8)
    run(s.reshape(-1), len(x) - 1, m, total)  # all rows but the last
    want = expf(x[:-1] - m)
    np.testing.assert_array_equal(s[:-1].view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(s[-1], x[-1])  # past n: untouched
    acc = np.zeros(8)
    for row in want:
        acc = acc + row.astype(np.float64)
    np.testing.assert_array_equal(total, acc)


@pytest.mark.parametrize("T,P,split", [(1, 300, True), (1, 5, False), (12, 40, True)])  # decode rows, prefill rows
def test_one_plan_serves_every_layer_alike(T, P, split):
    """A forward validates and splits its rows once (attention_plan) and every layer attends with that plan: the
    same bits as a call that plans for itself, whatever the layer's queries and caches; a plan for other shapes is
    refused."""
    rng = np.random.default_rng(T + P)
    H, KVH, hd = 8, 2, 64
    pos = np.arange(P - T, P)
    seq = np.zeros(T, np.int64)
    layers = [_paged(*(rng.normal(size=(P, KVH, hd)).astype(np.float32) for _ in range(2)), 16,
                     np.random.default_rng(0)) for _ in range(3)]  # same block table, other K/V
    bt = layers[0][2]
    plan = attention_plan(pos, seq, bt, layers[0][0].shape, H, hd)
    assert plan.threads == (min(get_threads(), len(plan.jobs)) if split else 1)
    for kc, vc, _ in layers:
        q = rng.normal(size=(T, H, hd)).astype(np.float32)
        for window in (0, 7):
            want = paged_attention(q, kc, vc, pos, seq, bt, window=window, scale=0.125)
            got = paged_attention(q, kc, vc, pos, seq, bt, window=window, scale=0.125, plan=plan)
            np.testing.assert_array_equal(got, want)
    kc, vc, _ = layers[0]
    with pytest.raises(ValueError, match="attention plan made for"):
        paged_attention(rng.normal(size=(T, 2 * H, hd)).astype(np.float32), kc, vc, pos, seq, bt, scale=0.1,
                        plan=plan)
    with pytest.raises(ValueError, match="position beyond the block table"):
        attention_plan(pos + 16 * bt.shape[1], seq, bt, kc.shape, H, hd)


def test_attention_rejects_bad_block_table():
    q = np.zeros((1, 2, 8), np.float32)
    kc = np.zeros((2, 16, 1, 8), np.float32)
    with pytest.raises(ValueError):
        paged_attention(q, kc, kc, np.array([20]), np.zeros(1, np.int64), np.array([[0, 5]]), scale=1.0)
    with pytest.raises(ValueError):
        paged_attention(q, kc, kc, np.array([40]), np.zeros(1, np.int64), np.array([[0, 1]]), scale=1.0)
    # per sequence, only the blocks its rows reach are checked: -1 past them is a free table slot
    q2 = np.zeros((2, 2, 8), np.float32)
    tables = np.array([[0, -1], [1, 7]])
    paged_attention(q2, kc, kc, np.array([3, 5]), np.array([0, 1]), tables, scale=1.0)
    with pytest.raises(ValueError, match="sequence 1"):
        paged_attention(q2, kc, kc, np.array([3, 20]), np.array([0, 1]), tables, scale=1.0)
    with pytest.raises(ValueError, match="sequence 0"):
        paged_attention(q2, kc, kc, np.array([20, 5]), np.array([0, 1]), tables, scale=1.0)
    with pytest.raises(ValueError, match="negative position or row_seq"):
        paged_attention(q2, kc, kc, np.array([3, -1]), np.array([0, 1]), tables, scale=1.0)
    with pytest.raises(ValueError, match="negative position or row_seq"):
        paged_attention(q2, kc, kc, np.array([3, 5]), np.array([0, 2]), tables, scale=1.0)
    # one position for two query rows (or two for one): refused, the kernel would read past q / out
    with pytest.raises(ValueError):
        paged_attention(q2, kc, kc, np.array([3]), np.array([0]), tables, scale=1.0)
    with pytest.raises(ValueError):
        paged_attention(q, kc, kc, np.array([3, 5]), np.array([0, 1]), tables, scale=1.0)


def test_rmsnorm():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 3, 64)).astype(np.float32)
    w = rng.normal(size=64).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(rmsnorm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("neox", [True, False])
def test_rope_matches_complex_rotation(neox):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(6, 2, 16)).astype(np.float32)
    pos = np.array([0, 1, 5, 17, 100, 1000])
    cos, sin = rope_tables(pos, 16, 10000.0)
    got = apply_rope(x.copy(), cos, sin, neox=neox)
    freqs = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    ang = pos[:, None] * freqs[None, :]  # (T, 8)
    if neox:
        z = x[..., :8] + 1j * x[..., 8:]
    else:
        z = x[..., 0::2] + 1j * x[..., 1::2]
    r = z * np.exp(1j * ang)[:, None, :]
    want = np.concatenate([r.real, r.imag], -1) if neox else np.stack([r.real, r.imag], -1).reshape(x.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("T", [1, 3, 200])  # 200 rows: split over the threads
@pytest.mark.parametrize("norm, rot, neox", [(True, 64, True), (True, 64, False), (False, 64, True),
                                             (True, 32, True), (False, 24, False), (True, 0, True)])
def test_qk_norm_rope_is_rmsnorm_then_rope(T, norm, rot, neox):
    """The fused per-head step gives the bits of rmsnorm then apply_rope (on the first rot dims: partial rotary;
    rot 0: no rope), in place on q and k; bad shapes are refused."""
    rng = np.random.default_rng(T + rot)
    q = rng.normal(size=(T, 8, 64)).astype(np.float32)
    k = rng.normal(size=(T, 2, 64)).astype(np.float32)
    wq, wk = (rng.normal(size=64).astype(np.float32) for _ in range(2))
    tables = rope_tables(np.arange(T) * 7 + 3, rot, 10000.0) if rot else None
    want = []
    for x, w in ((q, wq), (k, wk)):
        y = rmsnorm(x, w, 1e-6) if norm else x.copy()
        if rot:
            part = np.ascontiguousarray(y[..., :rot])
            y[..., :rot] = apply_rope(part, *tables, neox=neox)
        want.append(y)
    qk_norm_rope(q, k, wq if norm else None, wk if norm else None, 1e-6, tables, neox=neox)
    np.testing.assert_array_equal(q, want[0])
    np.testing.assert_array_equal(k, want[1])
    with pytest.raises(ValueError):
        qk_norm_rope(q[:, :, :32], k, None, None, 1e-6, None, neox=neox)  # not C-contiguous
    with pytest.raises(ValueError):
        qk_norm_rope(q, k, None, None, 1e-6, rope_tables(np.arange(T), 192, 10000.0), neox=neox)  # tables too wide


def test_geglu_uses_f16_table_and_swiglu():
    rng = np.random.default_rng(3)
    g = (rng.normal(size=(4, 64)) * 4).astype(np.float32)
    g[0, :3] = [-12.0, 12.0, 0.0]
    u = rng.normal(size=(4, 64)).astype(np.float32)
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * g * (1 + 0.044715 * g * g)))
    np.testing.assert_allclose(geglu(g, u), gelu * u, rtol=2e-3, atol=2e-3)  # f16 table resolution
    idx = g[1].astype(np.float16).view(np.uint16)
    want = np.where(g[1] <= -10, 0, np.where(g[1] >= 10, g[1], GELU_F16[idx])) * u[1]
    np.testing.assert_array_equal(geglu(g, u)[1], want.astype(np.float32))
    np.testing.assert_allclose(swiglu(g, u), g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)


def test_bf16_kv_cache_attention():
    from edgellm.engine.kv_cache import to_bf16_bits

    rng = np.random.default_rng(4)
    k = rng.normal(size=(20, 2, 32)).astype(np.float32)
    v = rng.normal(size=(20, 2, 32)).astype(np.float32)
    kb, vb = to_bf16_bits(k), to_bf16_bits(v)
    widen = lambda b: (b.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    np.testing.assert_allclose(widen(kb), k, rtol=2 ** -8)
    q = rng.normal(size=(3, 4, 32)).astype(np.float32)
    kc, vc, bt = _paged(kb, vb, 16, rng)
    got = paged_attention(q, kc, vc, np.array([17, 18, 19]), np.zeros(3, np.int64), bt, scale=0.2)
    want = attention_reference(q, widen(kb), widen(vb), np.array([17, 18, 19]), scale=0.2)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_f16_kv_cache_attention():
    from edgellm.engine.kv_cache import to_f16_bits

    rng = np.random.default_rng(5)
    k = rng.normal(size=(20, 2, 32)).astype(np.float32)
    v = rng.normal(size=(20, 2, 32)).astype(np.float32)
    kb, vb = to_f16_bits(k), to_f16_bits(v)
    widen = lambda b: b.view(np.float16).astype(np.float32)  # noqa: E731
    q = rng.normal(size=(3, 4, 32)).astype(np.float32)
    kc, vc, bt = _paged(kb, vb, 16, rng)
    got = paged_attention(q, kc, vc, np.array([17, 18, 19]), np.zeros(3, np.int64), bt, scale=0.2)
    want = attention_reference(q, widen(kb), widen(vb), np.array([17, 18, 19]), scale=0.2)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
