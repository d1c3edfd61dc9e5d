"""Text logic of the tokenizer service, pure Python (no gRPC): tokenizer loading, encode/decode,
incremental detokenization, stop strings, chat templates, and the text-generation use case that
joins them over a decoder's event stream. `services/` wraps it in gRPC."""

from tokenizer_svc.chat import ChatMessage, ChatTemplate, ChatTemplateError
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.generation import (
    AccountingMismatch,
    Chat,
    DecoderFault,
    StreamEndedWithoutFinished,
    TextDelta,
    TextFinished,
    TextRequest,
    UnknownTokenId,
    generate_text,
    prepare_request,
)
from tokenizer_svc.stop_strings import StopResult, StopStringMatcher
from tokenizer_svc.tokenizer import TextTokenizer
from tokenizer_svc.vocabulary import DecoderTraits, Vocabulary

__all__ = [
    "AccountingMismatch",
    "Chat",
    "ChatMessage",
    "ChatTemplate",
    "ChatTemplateError",
    "DecoderFault",
    "DecoderTraits",
    "IncrementalDetokenizer",
    "StopResult",
    "StopStringMatcher",
    "StreamEndedWithoutFinished",
    "TextDelta",
    "TextFinished",
    "TextRequest",
    "TextTokenizer",
    "UnknownTokenId",
    "Vocabulary",
    "generate_text",
    "prepare_request",
]
