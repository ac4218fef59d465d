"""A provider made by hand, for tests that speak the provider's side of the wire
themselves: its session's handshake and the offers it signs, whatever it claims."""

from __future__ import annotations


async def open_session(channel, key):
    """A provider session on ``channel`` (whose calls ``key`` signs), through the whole
    handshake: hello, challenge, signed proof, welcome. Returns the open stream."""
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.jobspec import now_ms
    from gpumarket.proto.v1 import gateway_pb2 as gw
    from gpumarket.proto.v1 import gateway_pb2_grpc

    stream = gateway_pb2_grpc.ProviderGatewayStub(channel).Session()
    await stream.write(gw.ProviderMessage(hello=gw.ProviderHello(public_key=key.public_key)))
    challenge = (await stream.read()).challenge
    await stream.write(gw.ProviderMessage(proof=seal(key, gw.SessionProof(
        nonce=challenge.nonce, broker_public_key=challenge.broker_public_key, at_ms=now_ms()))))
    assert (await stream.read()).WhichOneof("msg") == "welcome"
    return stream


def signed_offer(key, *, name: str = "fake CPU", accelerator: int | None = None,
                 flops: float = 1e11, memory_gib: int = 64, cores: int = 8,
                 kinds: tuple[int, ...] | None = None):
    """An offer made by hand (a provider's claims, whatever they are), signed by ``key``."""
    from gpumarket.proto.envelope import seal
    from gpumarket.proto.jobspec import now_ms
    from gpumarket.proto.v1 import types_pb2 as pb

    device = pb.Device(index=0, name=name, uuid="FAKE-0",
                       accelerator=accelerator or pb.ACCELERATOR_CPU,
                       memory_bytes=memory_gib << 30, cpu_cores=cores,
                       benchmark=pb.Benchmark(matmul_flops=flops, matmul_dtype="fp32",
                                              memory_bandwidth_bytes_per_s=1e10))
    return seal(key, pb.Offer(provider_id=key.id, devices=[device], price_per_gpu_hour=0.5,
                              kinds=list(kinds or (pb.JOB_KIND_TRAINING,)),
                              engines=["transformers"], created_at_ms=now_ms(),
                              software_version="0.1.0"))
