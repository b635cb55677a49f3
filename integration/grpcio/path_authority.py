"""A device plugin written with grpcio (gRPC's C core, an independent stack) registers with the fake kubelet.

grpcio, like grpc-go when a plugin dials a plain socket path, sends the socket path as the HTTP/2 :authority
of its Register call. The real kubelet accepts that, so the fake kubelet must too: this script is the proof.
It serves a minimal DevicePlugin (GetDevicePluginOptions, ListAndWatch with one device) on a Unix socket,
registers it with the default channel options, and checks that the fake kubelet accepted the registration
and received the device list.

Usage: python3 path_authority.py <fake-kubelet binary>
Exit status 0 when it all worked; otherwise a message on stderr.
"""

import os
import queue
import subprocess
import sys
import tempfile
import threading
from concurrent import futures

import grpc

TIMEOUT_S = 20


def field(number, payload):
    """A length-delimited protobuf field (wire type 2)."""
    tag = (number << 3) | 2
    return varint(tag) + varint(len(payload)) + payload


def varint(n):
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def register_request(endpoint, resource):
    return (
        field(1, b"v1beta1")
        + field(2, endpoint.encode())
        + field(3, resource.encode())
    )


def list_response():
    device = field(1, b"dev0") + field(2, b"Healthy")
    return field(1, device)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory() as directory:
        kubelet = subprocess.Popen(
            [binary, "--dir", directory],
            stdout=subprocess.PIPE,
            text=True,
        )
        lines = queue.Queue()

        def read():
            for line in kubelet.stdout:
                lines.put(line.strip())

        threading.Thread(target=read, daemon=True).start()

        def expect(wanted):
            seen = []
            while True:
                try:
                    line = lines.get(timeout=TIMEOUT_S)
                except queue.Empty:
                    sys.exit(f"fake kubelet never printed {wanted!r}; it printed {seen}")
                seen.append(line)
                if line == wanted or line.startswith(wanted):
                    return

        stop = threading.Event()
        try:
            expect("serving")

            def options(request, context):
                return b""

            def list_and_watch(request, context):
                yield list_response()
                stop.wait(TIMEOUT_S)

            handler = grpc.method_handlers_generic_handler(
                "v1beta1.DevicePlugin",
                {
                    "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(options),
                    "ListAndWatch": grpc.unary_stream_rpc_method_handler(list_and_watch),
                },
            )
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            server.add_generic_rpc_handlers((handler,))
            endpoint = "python-plugin.sock"
            server.add_insecure_port("unix:" + os.path.join(directory, endpoint))
            server.start()

            # Default options: no grpc.default_authority, so the :authority is grpcio's own choice for a
            # Unix socket target.
            channel = grpc.insecure_channel("unix:" + os.path.join(directory, "kubelet.sock"))
            register = channel.unary_unary("/v1beta1.Registration/Register")
            try:
                register(register_request(endpoint, "example.com/dev"), timeout=TIMEOUT_S)
            except grpc.RpcError as e:
                sys.exit(f"Register failed: {e.code()}: {e.details()}")
            expect(f"registered 1 example.com/dev {endpoint}")
            expect("list 1 1/1")
            print("grpcio plugin registered and listed its device")
        finally:
            stop.set()
            kubelet.terminate()
            kubelet.wait(timeout=TIMEOUT_S)


if __name__ == "__main__":
    main()
