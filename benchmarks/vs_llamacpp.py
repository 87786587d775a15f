"""edgellm vs llama.cpp (llama-cpp-python), side by side on the same model and thread count.

    python benchmarks/vs_llamacpp.py [--model GGUF] [-p 512] [-n 128] [--threads 2] [--repetitions 3]

Each engine runs in its own long-lived process that loads the model once; after one untimed warm-up measurement
each, the repetitions alternate between them, in ABBA order (edgellm, llama.cpp, llama.cpp, edgellm, ...), each
measurement as `edgellm bench -r 1` / llama-bench take it (pp: a fresh prompt; tg: greedy steps from an empty
context). On a VM whose memory bandwidth drifts by a third from one minute to the next, one fresh process per
measurement (this script before) put one engine's runs in a fast minute and the other's in a slow one; paired
back-to-back runs see the same host. Prints the medians of pp/tg tokens/s and peak RSS, their ratios edgellm /
llama.cpp, and the median of each round's own ratio ("paired").
Also the decode bound: the weight bytes one decode step reads (every matrix; the token embedding only when it
is also the output head) over this host's read bandwidth with that many threads, probed after each round (the
median is printed), and each engine's tg as a share of it: the median of each round's tg over that round's bound. Needs the `bench` extra (llama-cpp-python).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PAUSE_S = 0.5  # between two measurements

# Each engine runs in one long-lived worker process: it loads the model once, then answers "run" lines with one
# measurement (pp: a fresh p-token prompt; tg: n greedy single-token steps from an empty context) as a JSON line.
WORKER_LOOP = r"""
for line in sys.stdin:
    if line.strip() != "run":
        break
    out = measure()
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out), flush=True)
"""

LLAMA_CPP_CHILD = r"""
import json, resource, sys, time
import numpy as np
import llama_cpp
model, p, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model, n_ctx=max(p, n) + 16, n_batch=max(p, n) + 16, n_ubatch=512, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
rng = np.random.default_rng(0)
vocab = llm.n_vocab()

def measure():
    out = {}
    if p:
        toks = rng.integers(0, vocab, p).tolist()
        llm.reset(); t = time.perf_counter(); llm.eval(toks); out["pp_tps"] = p / (time.perf_counter() - t)
    if n:
        llm.reset(); tok = int(rng.integers(0, vocab)); t = time.perf_counter()
        for i in range(n):
            llm.eval([tok]); tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out["tg_tps"] = n / (time.perf_counter() - t)
    return out
""" + WORKER_LOOP

EDGELLM_CHILD = r"""
import json, resource, sys
from edgellm import LLM
from edgellm.bench import bench
model, p, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model or None, threads=threads, ctx_size=max(p, n) + 16, load_tokenizer=False, progress=False)

def measure():  # as `edgellm bench -r 1`
    r = bench(llm, n_prompt=p, n_gen=n, repetitions=1)
    return {k: v for k, v in (("pp_tps", r.pp_tps), ("tg_tps", r.tg_tps)) if v is not None}
""" + WORKER_LOOP


class Worker:
    """One engine's long-lived benchmark process (see WORKER_LOOP)."""

    def __init__(self, name: str, child: str, model: str, p: int, n: int, threads: int):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-c", child, model or "", str(p), str(n), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)

    def run(self) -> dict:
        try:
            self.proc.stdin.write("run\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.proc.stdout.readline()
        if not line:
            self._died()
        return json.loads(line)

    def _died(self):
        rc = self.proc.wait()
        err = self.proc.stderr.read().strip()[-2000:]
        if self.name == "llama.cpp" and rc < 0:  # seen with llama.cpp's AMX kernels on VMs that report AMX
            sys.exit(f"llama.cpp died with signal {-rc}. If this CPU reports AMX, rebuild without it: "
                     "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_INT8=OFF' "
                     "pip install --force-reinstall --no-cache-dir llama-cpp-python")
        sys.exit(f"{self.name} benchmark failed (exit {rc}):\n{err}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


READ_BW_CHILD = r"""
import sys, time, numpy as np, numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic
threads = int(sys.argv[1])
numba.set_num_threads(threads)

@intrinsic
def prefetch(typingctx, a, i):  # llvm.prefetch (to L2) of a[i]; past the end it does not fault
    def codegen(context, builder, sig, args):
        p8 = ir.IntType(8).as_pointer()
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        fn = builder.module.globals.get("llvm.prefetch.p0") or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), [p8] + [ir.IntType(32)] * 3), "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), p8)] + [ir.Constant(ir.IntType(32), x)
                                                                              for x in (0, 2, 1)])
        return context.get_dummy_value()
    return types.void(a, types.int64), codegen

@numba.njit(nogil=True)
def chunk_sum(a, ahead):  # every byte read, 8 independent sums: vector loads as a matmul kernel streams its weights
    acc = np.zeros(8, np.int64)
    for i in range(0, a.size - 7, 8):
        if ahead:
            prefetch(a, i + ahead)
        for j in range(8):
            acc[j] += a[i + j]
    return acc.sum()

@numba.njit(parallel=True, nogil=True)
def scan(a, nchunks, ahead):
    n = a.size // nchunks
    s = np.zeros(nchunks, np.int64)
    for c in numba.prange(nchunks):
        s[c] = chunk_sum(a[c * n:(c + 1) * n], ahead)
    return s.sum()

a = np.ones(1 << 27, np.int64)  # 1 GiB: far beyond any cache
best = 0.0
for ahead in (0, 256, 1024, 2048):  # int64 elements: no prefetch, then 2, 8, 16 KiB ahead (the kernels prefetch)
    scan(a, 16 * threads, ahead)
    for _ in range(3):
        t0 = time.perf_counter(); scan(a, 16 * threads, ahead); best = max(best, a.nbytes / (time.perf_counter() - t0))
print(best)
"""


def read_bandwidth(threads: int) -> float:
    """Bytes/s that `threads` threads stream from memory on this host (a fresh process, a 1 GiB array): the best
    of plain reads and reads that prefetch 2-16 KiB ahead, as the decode kernels do. On an Intel (model 207) KVM
    guest plain reads gave 10-11 GB/s, prefetching ones 20-21: the hardware prefetchers alone did not keep
    enough misses in flight."""
    out = subprocess.run([sys.executable, "-c", READ_BW_CHILD, str(threads)], capture_output=True, text=True,
                         check=True).stdout
    return float(out.strip().splitlines()[-1])


def decode_bytes(model: str) -> int:
    """Weight bytes one decode step reads: every 2-D tensor (the token embedding only if it is the output head:
    untied models only look rows of it up), and of each 3-D expert tensor the routed share
    (expert_used_count / expert_count)."""
    from edgellm.gguf_file import read_gguf

    g = read_gguf(model)
    arch = g.metadata.get("general.architecture", "")
    n_exp = int(g.metadata.get(f"{arch}.expert_count", 0) or 0)
    used = int(g.metadata.get(f"{arch}.expert_used_count", 0) or 0)
    tied = "output.weight" not in g.tensors
    dense = sum(t.n_bytes for name, t in g.tensors.items()
                if len(t.shape) == 2 and (name != "token_embd.weight" or tied))
    experts = sum(t.n_bytes for t in g.tensors.values() if len(t.shape) == 3)
    return dense + (experts * used // n_exp if n_exp else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repetitions", type=int, default=3)
    a = ap.parse_args()
    if a.model is None:
        from edgellm.model_path import resolve_model

        a.model = resolve_model(None)
    workers = [Worker("edgellm", EDGELLM_CHILD, a.model, a.p, a.n, a.threads),
               Worker("llama.cpp", LLAMA_CPP_CHILD, a.model, a.p, a.n, a.threads)]
    runs = {"edgellm": [], "llama.cpp": []}
    bws = []  # the host's read bandwidth, probed after each round (it drifts by a third within minutes on a VM)
    try:
        for w in workers:  # a first, untimed measurement: both models loaded and warm before the rounds
            w.run()
        for r in range(a.repetitions):
            for w in (workers if r % 2 == 0 else workers[::-1]):  # ABBA: a drift in the host's speed hits both
                time.sleep(PAUSE_S)  # the other engine's spinning threads settle
                res = w.run()
                runs[w.name].append(res)
                print(f"rep {r + 1} {w.name:9s} " + " ".join(f"{k}={v:.1f}" for k, v in res.items()
                                                             if k in ("pp_tps", "tg_tps", "rss_mb")), flush=True)
            time.sleep(PAUSE_S)
            bws.append(read_bandwidth(a.threads))
            print(f"rep {r + 1} read bandwidth {bws[-1] / 1e9:.1f} GB/s", flush=True)
    finally:
        for w in workers:
            w.close()
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("pp_tps", "tg_tps", "rss_mb")}
           for name, rs in runs.items()}
    print(f"\nmodel {a.model}, threads {a.threads}, {a.repetitions} repetitions (medians)")
    print(f"{'':10s} {'pp' + str(a.p) + ' t/s':>12s} {'tg' + str(a.n) + ' t/s':>12s} {'peak RSS MiB':>13s}")
    for name, m in med.items():
        print(f"{name:10s} {m['pp_tps']:12.1f} {m['tg_tps']:12.1f} {m['rss_mb']:13.0f}")
    e, l = med["edgellm"], med["llama.cpp"]
    print(f"{'ratio':10s} {e['pp_tps'] / l['pp_tps']:12.2f} {e['tg_tps'] / l['tg_tps']:12.2f} "
          f"{e['rss_mb'] / l['rss_mb']:13.2f}")
    paired = {k: statistics.median(x[k] / y[k] for x, y in zip(runs["edgellm"], runs["llama.cpp"]))
              for k in ("pp_tps", "tg_tps")}
    print(f"{'paired':10s} {paired['pp_tps']:12.2f} {paired['tg_tps']:12.2f}   (median of each round's ratio)")
    wbytes, bw = decode_bytes(a.model), statistics.median(bws)
    bound = bw / wbytes
    # each round's tokens/s over that round's own bound, then the median: robust to the bandwidth's drift
    share = {name: statistics.median(x["tg_tps"] * wbytes / b for x, b in zip(rs, bws)) for name, rs in runs.items()}
    print(f"decode bound: {wbytes / 1e6:.0f} MB of weights per token / {bw / 1e9:.1f} GB/s read bandwidth "
          f"({a.threads} threads; median of a probe a round, {min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f}) = "
          f"{bound:.1f} t/s; edgellm at {share['edgellm']:.0%}, llama.cpp at {share['llama.cpp']:.0%} "
          f"(median of each round's share of its own bound)")
    print(json.dumps({"ratio_pp": e["pp_tps"] / l["pp_tps"], "ratio_tg": e["tg_tps"] / l["tg_tps"],
                      "paired_ratio_pp": paired["pp_tps"], "paired_ratio_tg": paired["tg_tps"],
                      "ratio_rss": e["rss_mb"] / l["rss_mb"], "decode_bound_tps": bound,
                      "weight_bytes_per_token": wbytes, "read_bandwidth": bw, "read_bandwidth_rounds": bws,
                      "bound_share": share, "medians": med}))


if __name__ == "__main__":
    main()
