"""Generate JSON that validates against a schema (pip install 'edgellm[structured]')."""
import json

from edgellm import LLM, SamplingParams

schema = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 15}}},
    "required": ["name", "age", "hobbies"],
}
llm = LLM()
out = llm.generate("A person described as JSON:\n", SamplingParams(json_schema=schema, max_tokens=100))
print(json.loads(out.text))
