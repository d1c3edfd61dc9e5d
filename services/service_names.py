"""The full names of tokenwire's gRPC services, read from the generated descriptors.

Readiness in grpc.health.v1 is per service name, and reflection lists them: one definition,
shared by the servers that register them and the clients that probe them."""

from __future__ import annotations

from protos.decode.v1 import decode_pb2
from protos.text.v1 import text_pb2

DECODER_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decoder"].full_name  # tokenwire.decode.v1.Decoder
TOKENIZER_SERVICE = text_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name  # tokenwire.text.v1.Tokenizer
TEXT_GENERATION_SERVICE = text_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
