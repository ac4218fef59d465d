"""The link layer: how every role talks to the broker over the wire.

One TLS channel pinned to the broker's key with a signed token on every call
(``channel``), one typed client per service with a deadline on every call and grpc errors
turned into the project's own (``client``, ``artifacts``), and the provider's gateway
session as an object (``gateway``). Roles import ``gpumarket.proto`` and this package, never
each other; nothing outside this package and the broker's servicers touches a grpc stub.
"""
