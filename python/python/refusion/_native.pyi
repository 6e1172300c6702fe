"""Type stubs of the native module (python/src/lib.rs); the package's API is refusion.Refusion."""

from typing import Any, Dict, Iterator, List, Optional, Tuple

__version__: str

LogprobEntry = Tuple[int, float, List[Tuple[int, float]]]

class Model:
    def __init__(
        self,
        model_path: str,
        n_ctx: Optional[int] = None,
        n_threads: Optional[int] = None,
        n_gpu_layers: Optional[int] = None,
        cache_type_k: Optional[str] = None,
        cache_type_v: Optional[str] = None,
        n_parallel: int = 4,
        max_tokens: int = 4096,
        device: Optional[str] = None,
        verbose: bool = False,
    ) -> None: ...
    def tokenize(self, text: str) -> List[int]: ...
    def detokenize(self, ids: List[int], skip_special: bool = False) -> str: ...
    def pieces(self, ids: List[int]) -> List[Tuple[str, bytes]]: ...
    def apply_chat_template(self, messages: List[Tuple[str, str]]) -> str: ...
    def info(self) -> Dict[str, Any]: ...
    def decode(
        self,
        prompts: List[List[int]],
        *,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        seed: Optional[int] = None,
        slot_size: Optional[int] = None,
        serial_blocks: Optional[int] = None,
        slot_threshold: Optional[float] = None,
        token_threshold: Optional[float] = None,
        strategy: Optional[str] = None,
        logprobs: Optional[int] = None,
        echo: bool = False,
        trace: bool = False,
        template: Optional[str] = None,
        suffix: Optional[str] = None,
    ) -> List[Dict[str, Any]]: ...
    def stream(
        self,
        prompt: List[int],
        *,
        max_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        seed: Optional[int] = None,
        slot_size: Optional[int] = None,
        serial_blocks: Optional[int] = None,
        slot_threshold: Optional[float] = None,
        token_threshold: Optional[float] = None,
        strategy: Optional[str] = None,
    ) -> "Stream": ...
    def close(self) -> None: ...

class Stream(Iterator[str]):
    def __next__(self) -> str: ...
    def result(self) -> Optional[Dict[str, Any]]: ...
    def cancel(self) -> None: ...

def hub_gguf(repo_id: str, filename: Optional[str] = None) -> str: ...
