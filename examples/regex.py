"""Constrain the output to a regular expression, or to a grammar (Lark or llama.cpp GBNF)."""
from edgellm import LLM, SamplingParams

llm = LLM()
print(llm.generate("Call us at ", SamplingParams(regex=r"\(\d{3}\) \d{3}-\d{4}", max_tokens=20)).text)
print(llm.generate("Today's date:", SamplingParams(grammar='root ::= " " [0-9]{4} "-" [0-9]{2} "-" [0-9]{2}',
                                                   max_tokens=20)).text)
