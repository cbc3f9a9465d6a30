"""The JSON schemas that ``stepserve bench --constrained N`` sends (``--constrained-schema``)."""

# The schema of the constrained streams (--constrained): JSON notes (the default model closes them after
# about 18 tokens, so those streams keep sending requests while the free ones run: see run_level).
NOTES = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "notes"],
}
# --constrained-schema report: a longer structured answer (sections of points, at least 4 x 3), which the
# default model does not close within 128 tokens: its streams send about as many requests as the free ones,
# so the comparison with free text isolates what constraining a row costs per step.
REPORT = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "sections": {
            "type": "array",
            "minItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "heading": {"type": "string"},
                    "points": {"type": "array", "minItems": 3, "items": {"type": "string"}},
                },
                "required": ["heading", "points"],
            },
        },
    },
    "required": ["title", "sections"],
}
SCHEMAS = {"notes": NOTES, "report": REPORT}
