"""Speculative decoding (prompt lookup) vs plain greedy decoding on the default model (issue 18 figures).

    flock /tmp/bench.lock python benchmarks/speculative.py [--model GGUF] [--threads 2] [--rounds 3] [--new 200]

Workloads whose answer repeats the prompt (rewrite a 60-line code file with one change: a web page, answer with
quotes from a passage, reformat a JSON document) and free-text prompts; and, with no target, a Python file the
bundled base model does not copy. Each request runs alone on an engine of its own over the
same weights, speculation off and on alternating (side by side on a loaded machine), decode tokens/s from the
request's metrics (tokens after the first over the time since it). Printed per workload: median tokens/s of each
mode, the median of the per-round ratios, draft acceptance, and whether the outputs are identical (they must be).
Targets: overlap >= 1.7x, free text >= 0.97x.
"""
from __future__ import annotations

import argparse
import json
import statistics

from edgellm import LLM, SamplingParams
from edgellm.engine.engine import Engine

CODE = "\n".join([
    "import json", "import os", "from dataclasses import dataclass", "", "",
    "@dataclass", "class Item:", "    name: str", "    price: float", "    quantity: int = 1", "",
    "    def total(self) -> float:", "        return self.price * self.quantity", "", "",
    "def load_items(path: str) -> list[Item]:", "    \"\"\"Read items from a JSON file.\"\"\"",
    "    with open(path) as f:", "        data = json.load(f)", "    return [Item(**d) for d in data]", "", "",
    "def save_items(path: str, items: list[Item]) -> None:", "    tmp = path + \".tmp\"",
    "    with open(tmp, \"w\") as f:", "        json.dump([vars(i) for i in items], f, indent=2)",
    "    os.replace(tmp, path)", "", "",
    "def cheapest(items: list[Item]) -> Item | None:", "    if not items:", "        return None",
    "    return min(items, key=lambda i: i.price)", "", "",
    "def grand_total(items: list[Item]) -> float:", "    total = 0.0", "    for item in items:",
    "        total += item.total()", "    return total", "", "",
    "def by_name(items: list[Item]) -> dict[str, Item]:", "    return {i.name: i for i in items}", "", "",
    "def restock(items: list[Item], name: str, n: int) -> None:", "    for item in items:",
    "        if item.name == name:", "            item.quantity += n", "            return",
    "    raise KeyError(name)", "", "",
    "def main() -> None:", "    items = load_items(\"items.json\")", "    restock(items, \"apple\", 3)",
    "    print(grand_total(items))", "    save_items(\"items.json\", items)", "",
])
PAGE = "\n".join([  # a 60-line web page: the code file of the rewrite workload
    "<!DOCTYPE html>", "<html lang=\"en\">", "<head>", "  <meta charset=\"utf-8\">", "  <title>My Bakery</title>",
    "  <link rel=\"stylesheet\" href=\"style.css\">", "  <script src=\"menu.js\" defer></script>", "</head>", "<body>",
    "  <header>", "    <h1>My Bakery</h1>", "    <nav>", "      <a href=\"index.html\">Home</a>",
    "      <a href=\"menu.html\">Menu</a>", "      <a href=\"order.html\">Order</a>", "      <a href=\"contact.html\">Contact</a>",
    "    </nav>", "  </header>", "  <main>", "    <section id=\"bread\">", "      <h2>Bread</h2>", "      <ul>",
    "        <li>Sourdough - $5</li>", "        <li>Baguette - $3</li>", "        <li>Rye - $4</li>",
    "        <li>Focaccia - $6</li>", "      </ul>", "    </section>", "    <section id=\"cakes\">", "      <h2>Cakes</h2>",
    "      <ul>", "        <li>Carrot cake - $6</li>", "        <li>Cheesecake - $7</li>", "        <li>Chocolate cake - $6</li>",
    "        <li>Lemon tart - $5</li>", "      </ul>", "    </section>", "    <section id=\"order\">", "      <h2>Order</h2>",
    "      <form action=\"/order\" method=\"post\">", "        <label for=\"item\">Item</label>",
    "        <input id=\"item\" name=\"item\" required>", "        <label for=\"count\">Count</label>",
    "        <input id=\"count\" name=\"count\" type=\"number\" min=\"1\" value=\"1\">",
    "        <button type=\"submit\">Send</button>", "      </form>", "    </section>", "  </main>", "  <footer>",
    "    <p>Open daily from 7 to 19.</p>", "    <p>12 Mill Street, Springfield</p>", "  </footer>", "</body>", "</html>", "",
])
PASSAGE = ("The lighthouse at Point Reyes was built in 1870 and stands on a cliff above the Pacific Ocean. Its "
           "first-order Fresnel lens, made in France, has 24 panels and 1,032 pieces of glass. The keepers had to "
           "climb 308 steps down the cliff to reach the lighthouse every day. Fog covers the point for weeks at a "
           "time in summer, which made the station one of the foggiest on the coast. The light was automated in "
           "1975, and the Coast Guard transferred it to the National Park Service. Today visitors can walk down the "
           "steps on weekends when the wind is calm, and rangers explain how the clockwork that turned the lens was "
           "wound every two hours through the night.")
DOC = {"store": {"name": "Corner Shop", "open": True, "hours": {"mon": "8-18", "tue": "8-18", "sat": "9-14"},
                 "items": [{"id": i, "name": n, "price": p, "tags": t} for i, (n, p, t) in enumerate([
                     ("apple", 0.5, ["fruit", "fresh"]), ("bread", 2.25, ["bakery"]), ("milk", 1.1, ["dairy"]),
                     ("cheese", 4.8, ["dairy", "aged"]), ("coffee", 7.5, ["drinks"]), ("tea", 3.2, ["drinks"])])]}}

OVERLAP = {
    "code rewrite": f"Here is index.html:\n```html\n{PAGE}```\n\nThe same page with the title changed to \"Our Bakery\" "
                    f"(everything else unchanged):\n```html\n",
    "quotes": f"Passage: {PASSAGE}\n\nQuestion: What does the passage say about the lens, the steps and the "
              f"automation? Answer with exact quotes from the passage.\nAnswer: \"The lighthouse at Point Reyes",
    "json reformat": f"Compact JSON:\n{json.dumps(DOC, separators=(',', ':'))}\n\nThe same JSON document, "
                     f"pretty-printed with an indent of 2 spaces:\n",
}
# Not counted in the targets: the bundled 270M base model does not copy this Python file (llama.cpp's greedy
# continuation is the same: a few imports, then "from datacte import json" over and over), so its ratio measures
# the model, not the engine (kept to show what a model that strays from the text gives).
MODEL_BOUND = {
    "python rewrite": f"Here is a Python file:\n```python\n{CODE}```\n\nThe same file with the function `grand_total` "
                      f"renamed to `sum_total` (everything else unchanged):\n```python\n",
}
FREE = {
    "free: story": "Once upon a time, in a small village at the edge of a great forest,",
    "free: essay": "The invention of the printing press changed Europe in several ways. First,",
    "free: science": "Photosynthesis is the process by which plants",
}

TARGETS = {"overlap": 1.7, "free": 0.97}


def run(llm: LLM, prompt: str, new: int, speculative) -> tuple[float, list[int], int, int]:
    """(decode tokens/s, tokens, drafted, accepted) of one greedy request alone on a fresh engine."""
    eng = Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size, speculative=speculative)
    req = eng.add_request(llm.prompt_ids(prompt), SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    m = req.metrics()
    return m["decode_tps"], req.output_ids, req.n_drafted, req.n_accepted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=200, help="tokens generated per request")
    ap.add_argument("--only", default=None, help="run the workloads whose name contains this")
    a = ap.parse_args()
    llm = LLM(a.model, threads=a.threads, ctx_size=2048, progress=True, speculative="off")
    run(llm, "Warm-up", 8, "off"), run(llm, "Warm-up, warm-up, warm-up", 8, "ngram")  # kernels compiled
    print(f"{'workload':16s} {'off tok/s':>10s} {'spec tok/s':>10s} {'ratio':>6s} {'accepted':>12s}  identical")
    for kind, table in (("overlap", OVERLAP), ("free", FREE), ("model-bound (no target)", MODEL_BOUND)):
        ratios_kind = []
        for name, prompt in table.items():
            if a.only and a.only not in name:
                continue
            off, on, ratios, same, acc = [], [], [], True, (0, 0)
            for i in range(a.rounds):
                order = ("off", "ngram") if i % 2 == 0 else ("ngram", "off")  # alternate who runs first
                res = {mode: run(llm, prompt, a.new, mode) for mode in order}
                off.append(res["off"][0])
                on.append(res["ngram"][0])
                ratios.append(on[-1] / off[-1])
                same &= res["off"][1] == res["ngram"][1]
                acc = res["ngram"][2:]
            ratio = statistics.median(ratios)
            ratios_kind.append(ratio)
            print(f"{name:16s} {statistics.median(off):10.1f} {statistics.median(on):10.1f} {ratio:5.2f}x "
                  f"{acc[1]:5d}/{acc[0]:<6d}  {'yes' if same else 'NO'}", flush=True)
        if ratios_kind and kind in TARGETS:
            print(f"{kind}: median ratio {statistics.median(ratios_kind):.2f}x "
                  f"(min {min(ratios_kind):.2f}x, target {TARGETS[kind]}x)", flush=True)


if __name__ == "__main__":
    main()
