#!/usr/bin/env python3
"""Renders chat templates as transformers' apply_chat_template does (Jinja2 sandbox with
trim_blocks, lstrip_blocks, loopcontrols, its tojson and raise_exception), without needing
transformers itself. Reads {"template": str, "cases": [{"messages": [...], "add_generation_prompt":
bool}]} on stdin, writes a JSON list of rendered strings."""
import json
import sys
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt):
    return datetime.now().strftime(fmt)


req = json.load(sys.stdin)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now
tmpl = env.from_string(req["template"])
out = []
for case in req["cases"]:
    out.append(tmpl.render(messages=case["messages"], tools=None, documents=None,
                           add_generation_prompt=case["add_generation_prompt"], enable_thinking=True))
json.dump(out, sys.stdout)
