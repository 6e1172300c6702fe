"""The tiny model's held-out tasks' scoring for lm-evaluation-harness: an answer is right when
its exact final answer is the reference's, by train/corpus.py's own rule (the one `refusion
bench --decode` and train/evaluate.py apply)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "train"))
from corpus import extract  # noqa: E402


def process_results(doc, results):
    """generate_until: 1 when the answer's final answer is the reference's."""
    want = extract("code", doc["answer"]) if doc["kind"] == "code" else doc["answer"].strip()
    got = extract(doc["kind"], results[0])
    return {"exact_match": int(want is not None and got == want)}
