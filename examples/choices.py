"""Pick one of a list: constrained sampling (choices=) and, in a program, by model log-probability (select)."""
import edgellm
from edgellm import LLM, SamplingParams, select

llm = LLM()
review = "Review: The food was cold and the waiter ignored us.\nSentiment:"
print(llm.generate(review, SamplingParams(choices=[" positive", " negative", " neutral"], max_tokens=5)).text)


@edgellm.program
def sentiment(s, text):
    s += text + select("label", choices=[" positive", " negative", " neutral"])


state = sentiment.run(review, backend=llm)
print(state["label"], state.scores["label"])  # the chosen label and each choice's summed log-probability
