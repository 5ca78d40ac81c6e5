"""The wire: everything that crosses between a trainer and a peer, or between two peers.

A leaf package: the peers and the trainer both import it, and it imports neither (nor any other
project package), so both ends share one contract.

- `protocol`: the RPC names, the typed headers of every call, the limits a receiver enforces, and
  `ProtocolError`. Start here: its docstring is the contract.
- `messages`: headers and tensors as hivemind protobuf messages and back, one call per direction
  (`write_request` / `read_request`, `write_response` / `read_response`, unary calls, the state stream).
- `tensors`: one named tensor encoded, its parts regrouped after a header, decoded.
- `failures`: `Failure`, the one vocabulary of why a call failed (a peer's answer, a trainer's record).
- `request_limits`: a request's size cap and the penalty box for callers that keep sending bad ones.
- `compression`: the codecs (`TensorHeader`, `EncodedTensor`, the registry), error feedback, the
  adaptive codec choice and byte accounting.
"""
