"""StructuredOutputsParams: what a request's output must match, as vLLM names it.

Exactly one constraint per request: a JSON schema (`json`), any JSON object
(`json_object`), a regular expression (`regex`), one of a list of strings
(`choice`), a context-free grammar in EBNF/GBNF or Lark form (`grammar`), or vLLM's
`structural_tag` (free text in which tagged segments follow a schema). Each becomes
one llguidance grammar (`grammar_text`); `check()` compiles it and raises a
ValueError naming the problem, which is how a bad schema, regex or grammar becomes a
400 before anything runs. Plain Python and llguidance (no numpy): the engine core's
scheduler imports it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import llguidance

MAX_JSON_INDENT = 16  # spaces or tabs after a line break between two JSON tokens
_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclasses.dataclass
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema (a dict is serialized on construction)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF) or Lark
    structural_tag: str | None = None  # JSON: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens of the JSON

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)  # property order kept: it is the order generated
        if self.choice is not None:
            self.choice = list(self.choice)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(_KINDS)} must be set, "
                             f"got {', '.join(given) or 'none'}")
        self._check_types()

    def _check_types(self) -> None:
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name}: must be a string, got {type(value).__name__}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar of the constraint (ValueError if it cannot be built)."""
        kind = self.kind
        try:
            if kind in ("json", "json_object"):
                schema = closed_objects(json.loads(self.json)) if kind == "json" else {"type": "object"}
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=self._json_options())
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":
                return llguidance.grammar_from("choice", self.choice)
            if kind == "grammar":
                return llguidance.grammar_from("grammar", self.grammar)
            return _structural_tag_grammar(self.structural_tag, self._json_options())
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None

    def _json_options(self) -> dict[str, Any]:
        """JSON between its tokens: no whitespace (`disable_any_whitespace`), else what
        pretty-printing uses: one space, or a line break and up to MAX_JSON_INDENT
        spaces or tabs. vLLM allows any amount; a small model then often repeats newlines
        or spaces until max_tokens (SmolLM2-135M did on 23 of 100 schemas; with up to 32
        spaces in a row it padded every gap with them)."""
        if self.disable_any_whitespace:
            return {"whitespace_flexible": False}
        return {"whitespace_pattern": rf"( |\r?\n[ \t]{{0,{MAX_JSON_INDENT}}})?"}

    def check(self) -> str:
        """The grammar text, after llguidance compiled it without a tokenizer; a
        ValueError naming the field and the problem otherwise."""
        text = self.grammar_text()
        error = llguidance.LLMatcher.validate_grammar(text)
        if error:
            raise ValueError(f"structured_outputs.{self.kind}: {_short(error)}")
        return text


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that declares
    `properties` and says nothing about others: only the declared properties are
    generated, as xgrammar's strict mode (vLLM's default backend) does. Without it a
    model may add properties of its own for as long as max_tokens lets it (SmolLM2 did
    for a tool's arguments). An object that allows others explicitly keeps them."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMAS:
        if key in out:
            out[key] = [closed_objects(x) for x in out[key]] if isinstance(out[key], list) else closed_objects(out[key])
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _short(message: str, limit: int = 500) -> str:
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + "..."


def _structural_tag_grammar(text: str, json_options: dict[str, Any]) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers":
    [...]}) as llguidance StructTags: free text, in which each trigger starts a
    segment `begin` + JSON following `schema` + `end`."""
    try:
        spec = json.loads(text)
        structures, triggers = spec["structures"], spec["triggers"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"must be JSON with 'structures' and 'triggers' ({e})") from None
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str):
            raise ValueError(f"each structure needs a 'begin' string, got {s!r}")
        trigger = next((t for t in triggers if isinstance(t, str) and t and s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger starts the begin string {s['begin']!r}")
        schema = closed_objects(s.get("schema", {}))
        if json_options:
            schema = {**schema, "x-guidance": {**json_options, **schema.get("x-guidance", {})}}
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s.get("end", "")))
    if not tags:
        raise ValueError("'structures' must not be empty")
    return llguidance.StructTag.to_grammar(tags, assume_special=False)
