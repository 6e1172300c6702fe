#!/usr/bin/env python3
"""Loads GGUF files written by `refusion convert` with llama.cpp itself (through
llama-cpp-python) and compares its prefill logits with the reference's
(tests/fixtures/forward.json). Proves the files are llama.cpp-compatible `qwen3` models.

    pip install llama-cpp-python numpy      # builds llama.cpp once (10-20 minutes)
    for m in pub-a pub-b pub-c; do
        target/release/refusion convert tests/fixtures/models/$m -o /tmp/$m.gguf --outtype f32 -q
        python3 benches/llama_cpp_accepts.py /tmp/$m.gguf $m
    done

Not part of CI (llama.cpp takes too long to build there). llama.cpp's CPU path computes parts of
attention in f16, so expect differences around 1e-3 relative, and the same argmax.
"""
import json
import os
import sys

import numpy as np
from llama_cpp import Llama

path, model = sys.argv[1], sys.argv[2]
root = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "forward.json")
call = json.load(open(root))["models"][model]["prefill"]
tokens = call["tokens"][0]
llm = Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=2)
llm.eval(tokens)
got = np.array(llm.scores[: len(tokens)])
ref = np.array(call["logits"][0])
diff = np.abs(got - ref).max()
same = bool((got.argmax(-1) == ref.argmax(-1)).all())
print(f"{path}: llama.cpp loaded it; max |logit diff| {diff:.4f} (logits up to {np.abs(ref).max():.1f}); argmax equal: {same}")
sys.exit(0 if same else 1)
