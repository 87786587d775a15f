"""A program that forks into parallel branches: they run as one batch and share the prefix's KV blocks."""
import edgellm
from edgellm import LLM, gen

llm = LLM()


@edgellm.program
def ideas(s, topic):
    s += f"Here are some creative, practical ideas about {topic}, each one written as a single short line.\n"
    branches = s.fork(3)
    for i, b in enumerate(branches):
        b += f"Idea {i + 1}:" + gen("idea", max_tokens=20, stop="\n", temperature=0.8, seed=i)
    s.vars["ideas"] = [b["idea"] for b in branches]


state = ideas.run("saving energy at home", backend=llm)
print("\n".join(state["ideas"]))
print("prefix tokens reused:", llm.stats()["prefix_hit_tokens"])

# many inputs at once
for st in ideas.run_batch([{"topic": "learning a language"}, {"topic": "cooking"}], backend=llm):
    print(st["ideas"])
