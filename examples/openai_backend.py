"""Run a program against any OpenAI-compatible server (start one with: edgellm serve --port 8080)."""
import edgellm
from edgellm import assistant, gen, select, system, user
from edgellm.program import OpenAIBackend

backend = OpenAIBackend("http://127.0.0.1:8080/v1", api_key="none")


@edgellm.program
def trivia(s, question):
    s += system("Answer briefly.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=32))
    s += user("Are you sure? Answer yes or no.")
    s += assistant(select("sure", choices=["yes", "no"]))  # a grammar-constrained choice on the server


state = trivia.run("What is the capital of Italy?", backend=backend)
print(state["answer"], "| sure:", state["sure"])
