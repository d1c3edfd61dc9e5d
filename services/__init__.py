"""tokenwire's transport shell: gRPC servicers, protobuf conversion, error mapping, entry points.

The only package that imports grpc or generated code. It validates at the edge, converts
protobuf to the cores' own types (`engine`, `tokenizer_svc`) and back, and maps exceptions
to status codes in one place (`services.errors`).
"""
