"""refusion: the ReFusion diffusion language model from GGUF files, from Python.

    from refusion import Refusion
    llm = Refusion("model.gguf")
    out = llm.create_chat_completion([{"role": "user", "content": "What is 23 + 16?"}])
    print(out["choices"][0]["message"]["content"])

The API follows llama-cpp-python where the concepts match (``create_completion``,
``create_chat_completion``, ``tokenize``, ``from_pretrained``) and returns the dicts
``refusion serve`` answers; ``generate`` and ``generate_batch`` are ReFusion's own (slot
decoding's settings and figures). The native code runs in the package (``refusion._native``):
no separate binary, no network unless ``from_pretrained`` downloads. docs/python.md.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from ._native import Model as _Model
from ._native import __version__
from ._native import hub_gguf as _hub_gguf

__all__ = ["Refusion", "__version__"]

Prompt = Union[str, Sequence[int]]

# The decoding fields every call takes, as the server's request fields.
_KNOBS = (
    "max_tokens",
    "temperature",
    "seed",
    "slot_size",
    "serial_blocks",
    "slot_threshold",
    "token_threshold",
    "strategy",
)

_ids = itertools.count(1)


class Refusion:
    """A GGUF file loaded to decode, with a thread of its own that decodes every call made
    to it together (from any number of Python threads; the GIL is released meanwhile)."""

    def __init__(
        self,
        model_path: str,
        *,
        n_ctx: Optional[int] = None,
        n_threads: Optional[int] = None,
        n_gpu_layers: Optional[int] = None,
        cache_type_k: Optional[str] = None,
        cache_type_v: Optional[str] = None,
        n_parallel: int = 4,
        max_tokens: int = 4096,
        device: Optional[str] = None,
        verbose: bool = False,
    ) -> None:
        self.model_path = str(model_path)
        self._model = _Model(
            self.model_path,
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_gpu_layers=n_gpu_layers,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            n_parallel=n_parallel,
            max_tokens=max_tokens,
            device=device,
            verbose=verbose,
        )
        self.metadata: Dict[str, Any] = self._model.info()

    @classmethod
    def from_pretrained(
        cls, repo_id: str, filename: Optional[str] = None, **kwargs: Any
    ) -> "Refusion":
        """Loads a GGUF file of a Hugging Face repository (downloaded into the Hub's cache
        once, or found there): ``filename`` a file name, a quant name or a glob
        (``"*Q4_K_M.gguf"``); by default Q4_K_M, or the only file."""
        return cls(_hub_gguf(repo_id, filename), **kwargs)

    def n_ctx(self) -> int:
        return self.metadata["context"]

    def tokenize(self, text: Union[str, bytes], add_bos: bool = False, special: bool = True) -> List[int]:
        """Token ids of ``text`` (special tokens' text read as the tokens). Qwen3 has no BOS:
        ``add_bos`` adds nothing."""
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self._model.tokenize(text)

    def detokenize(self, tokens: Sequence[int], special: bool = True) -> bytes:
        """The text of ``tokens`` as bytes (``special=False``: without control tokens)."""
        return self._model.detokenize(list(tokens), skip_special=not special).encode("utf-8")

    # ReFusion's own calls -------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt,
        *,
        template: Optional[str] = None,
        chat_template: bool = True,
        trace: bool = False,
        **knobs: Any,
    ) -> Dict[str, Any]:
        """Decodes ``prompt`` (text, through the chat template unless ``chat_template=False``,
        or token ids) and returns ``text``, ``tokens``, ``finish_reason``, ``tpf``,
        ``forwards``, ``forward_tokens``, the token counts; with ``template`` (an answer with
        ``{{gap}}`` / ``{{gap:N}}`` markers, filled in any order: docs/infill.md) each gap's
        fill as ``gaps``; with ``trace=True`` the decode's ``steps`` (each a list of ``(answer
        index, state, token)``, what the web page draws). ``knobs``: max_tokens, temperature,
        seed, slot_size, serial_blocks, slot_threshold, token_threshold, strategy ("slots",
        "ar", "infill"), logprobs."""
        return self.generate_batch(
            [prompt], template=template, chat_template=chat_template, trace=trace, **knobs
        )[0]

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        *,
        template: Optional[str] = None,
        chat_template: bool = True,
        trace: bool = False,
        **knobs: Any,
    ) -> List[Dict[str, Any]]:
        """``generate`` for many prompts, decoded together by the scheduler (``n_parallel``
        at a time); the results in order."""
        _check_knobs(knobs, _KNOBS + ("logprobs",))
        ids = [self._prompt_ids(p, chat_template) for p in prompts]
        return self._model.decode(ids, trace=trace, template=template, **knobs)

    # llama-cpp-python's calls, answering as refusion serve does ------------------------------

    def create_completion(
        self,
        prompt: Prompt,
        suffix: Optional[str] = None,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        echo: bool = False,
        logprobs: Optional[int] = None,
        stop: Optional[Union[str, List[str]]] = None,
        stream: bool = False,
        seed: Optional[int] = None,
        **knobs: Any,
    ):
        """``/v1/completions``: the text after ``prompt`` (text as it is, or token ids), as
        the server's ``text_completion`` dict, or with ``stream=True`` an iterator of its
        chunks. ``logprobs=N``: each token's with N alternatives; ``echo``: the prompt first
        (with ``logprobs``, scored; ``max_tokens=0`` then scores it alone)."""
        stops = _stops(stop)
        _check_knobs(knobs, _KNOBS)
        if isinstance(logprobs, bool) and logprobs:
            raise ValueError("logprobs must be an integer from 0 to 20")
        n = logprobs or None
        _check_logprobs(n, stream, stops)
        ids = self._prompt_ids(prompt, template=False)
        echoed = (prompt if isinstance(prompt, str) else self._model.detokenize(ids)) if echo else ""
        knobs.update(max_tokens=max_tokens, temperature=temperature, seed=seed)
        head = _head("cmpl", "text_completion", self.model_path)
        if stream:
            if suffix:
                raise ValueError("suffix with stream: true is not supported by the Python API yet (ask for the answer whole)")
            return self._stream_completion(head, ids, echoed, stops, knobs)
        r = self._model.decode([ids], logprobs=n, echo=echo, suffix=suffix or None, **knobs)[0]
        if suffix:
            # The answer is the gap's fill alone (decoded whole, then cut: counted whole, as
            # the server counts a gap's fill).
            r["text"] = r["gaps"][0]["text"]
        text = self._cut(r, stops, recount=not suffix)
        choice = {"index": 0, "text": echoed + text, "finish_reason": r["finish_reason"],
                  "logprobs": self._completion_logprobs(r, ids, echo) if n else None}
        return {**head, "choices": [choice], "usage": _usage(r)}

    __call__ = create_completion

    def create_chat_completion(
        self,
        messages: List[Dict[str, str]],
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        logprobs: bool = False,
        top_logprobs: Optional[int] = None,
        stop: Optional[Union[str, List[str]]] = None,
        stream: bool = False,
        seed: Optional[int] = None,
        **knobs: Any,
    ):
        """``/v1/chat/completions``: the assistant's answer to ``messages`` (``role`` and
        ``content`` each) through the file's chat template, as the server's
        ``chat.completion`` dict, or with ``stream=True`` an iterator of its chunks."""
        if top_logprobs and not logprobs:
            raise ValueError("top_logprobs is not supported without logprobs: true")
        stops = _stops(stop)
        _check_knobs(knobs, _KNOBS)
        n = (top_logprobs or 0) if logprobs else None
        _check_logprobs(n, stream, stops)
        pairs = [(m["role"], m.get("content") or "") for m in messages]
        if not pairs:
            raise ValueError("messages must not be empty")
        ids = self._model.tokenize(self._model.apply_chat_template(pairs))
        knobs.update(max_tokens=max_tokens, temperature=temperature, seed=seed)
        head = _head("chatcmpl", "chat.completion", self.model_path)
        if stream:
            return self._stream_chat(head, ids, stops, knobs)
        r = self._model.decode([ids], logprobs=n, **knobs)[0]
        text = self._cut(r, stops)
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": self._chat_logprobs(r) if logprobs else None, "finish_reason": r["finish_reason"]}
        return {**head, "choices": [choice], "usage": _usage(r)}

    # ---------------------------------------------------------------------------------------

    def _cut(self, r: Dict[str, Any], stops: List[str], recount: bool = True) -> str:
        """``r``'s text up to its first stop string; cut, ``r`` says "stop" and (``recount``)
        counts the tokens of the text kept (as the server, whose decode the stop string ends)."""
        text = r["text"]
        at = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if at < 0:
            return text
        r["finish_reason"] = "stop"
        if recount:
            r["completion_tokens"] = len(self._model.tokenize(text[:at]))
        return text[:at]

    def _prompt_ids(self, prompt: Prompt, template: bool) -> List[int]:
        if isinstance(prompt, str):
            if template:
                prompt = self._model.apply_chat_template([("user", prompt)])
            return self._model.tokenize(prompt)
        return [int(t) for t in prompt]

    def _scored(self, tokens: List[int], lps: List[Any]) -> List[Dict[str, Any]]:
        """Each token's text, bytes, logprob and alternatives (None: the prompt's first)."""
        alts = [a for lp in lps if lp is not None for a, _ in lp[2]]
        pieces = self._model.pieces(list(tokens) + alts)
        texts = iter(pieces[len(tokens):])
        out = []
        for (text, raw), lp in zip(pieces, lps):
            top = [] if lp is None else [(*next(texts), p) for _, p in lp[2]]
            out.append({"text": text, "bytes": list(raw), "logprob": None if lp is None else lp[1], "top": top})
        return out

    def _completion_logprobs(self, r: Dict[str, Any], prompt: List[int], echo: bool) -> Dict[str, Any]:
        tokens, lps = list(r["tokens"]), list(r["logprobs"] or [])
        if echo:
            tokens = prompt + tokens
            lps = [None] + list(r["prompt_logprobs"] or []) + lps
        eos = r.get("eos_logprob")
        if eos is not None:
            tokens, lps = tokens + [eos[0]], lps + [eos]
        scored = self._scored(tokens, lps)
        if eos is not None:
            # The end-of-sequence token that ended the answer: listed, with no text.
            scored[-1].update(text="", bytes=[])
        offsets, at = [], 0
        for s in scored:
            offsets.append(at)
            at += len(s["text"])
        tops = []
        for s in scored:
            if s["logprob"] is None:
                tops.append(None)
                continue
            d: Dict[str, float] = {}
            for text, _, p in s["top"]:
                d.setdefault(text, p)
            tops.append(d)
        return {"tokens": [s["text"] for s in scored], "token_logprobs": [s["logprob"] for s in scored],
                "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, r: Dict[str, Any]) -> Dict[str, Any]:
        scored = self._scored(list(r["tokens"]), list(r["logprobs"] or []))
        content = [{"token": s["text"], "logprob": s["logprob"], "bytes": s["bytes"],
                    "top_logprobs": [{"token": t, "logprob": p, "bytes": list(b)} for t, b, p in s["top"]]}
                   for s in scored]
        return {"content": content, "refusal": None}

    def _stream_completion(self, head, ids, echoed, stops, knobs) -> Iterator[Dict[str, Any]]:
        def chunk(text, finish=None):
            return {**head, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

        if echoed:
            yield chunk(echoed)
        for text, finish in self._stream_text(ids, stops, knobs):
            yield chunk(text, finish)

    def _stream_chat(self, head, ids, stops, knobs) -> Iterator[Dict[str, Any]]:
        head = {**head, "object": "chat.completion.chunk"}

        def chunk(delta, finish=None):
            return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        for text, finish in self._stream_text(ids, stops, knobs):
            yield chunk({"content": text} if finish is None else {}, finish)

    def _stream_text(self, ids, stops, knobs):
        """(text, None) as it becomes final, cut at the first stop string, then ("", finish)."""
        s = self._model.stream(ids, **{k: v for k, v in knobs.items() if v is not None})
        held, hit = "", False
        keep = max((len(x) for x in stops), default=1) - 1
        for piece in s:
            held += piece
            at = min((i for i in (held.find(x) for x in stops) if i >= 0), default=-1)
            if at >= 0:
                held, hit = held[:at], True
                s.cancel()
                break
            out, held = (held[: len(held) - keep], held[len(held) - keep:]) if keep else (held, "")
            if out:
                yield out, None
        if held:
            yield held, None
        r = s.result()
        finish = "stop" if hit or r is None else r["finish_reason"]
        yield "", finish


def _head(prefix: str, obj: str, model: str) -> Dict[str, Any]:
    return {"id": f"{prefix}-py{next(_ids)}", "object": obj, "created": int(time.time()), "model": model}


def _usage(r: Dict[str, Any]) -> Dict[str, int]:
    p, c = r["prompt_tokens"], r["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _stops(stop: Optional[Union[str, List[str]]]) -> List[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    return [s for s in stops if s]


def _check_knobs(knobs: Dict[str, Any], allowed: Sequence[str]) -> None:
    unknown = sorted(set(knobs) - set(allowed))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (known: {', '.join(allowed)})")


def _check_logprobs(n: Optional[int], stream: bool, stops: List[str]) -> None:
    """The server's refusals, in its words."""
    if n is None:
        return
    if stream:
        raise ValueError("logprobs is not supported with stream: true (ask for the answer whole)")
    if stops:
        raise ValueError("logprobs is not supported with stop strings (the answer is cut by text, its log-probabilities by token)")
