"""Text logic of the tokenizer service, pure Python (no gRPC): tokenizer loading, encode/decode,
incremental detokenization, stop strings and chat templates. `services/` wraps it in gRPC."""

from tokenizer_svc.chat import ChatMessage, ChatTemplate, ChatTemplateError
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.stop_strings import StopResult, StopStringMatcher
from tokenizer_svc.tokenizer import DecoderTraits, TextTokenizer

__all__ = [
    "ChatMessage",
    "ChatTemplate",
    "ChatTemplateError",
    "DecoderTraits",
    "IncrementalDetokenizer",
    "StopResult",
    "StopStringMatcher",
    "TextTokenizer",
]
