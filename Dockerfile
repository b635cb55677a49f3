# syntax=docker/dockerfile:1
#
# gpu-device-plugin's image: a Rust build stage, then a small glibc runtime (NVML is loaded with dlopen, so the
# binary needs the C library the driver's libnvidia-ml.so.1 is built against, not a static musl one).
#
#   docker build -t registry.example.com/gpu-device-plugin:0.1.0 .
#
# registry.example.com/gpu-device-plugin:0.1.0 is a placeholder, the same as in manifests/base: put your registry
# in its place, push, and set that image in an overlay of your own (docs/deploy.md, "The image").
#
# The fake NVML library ships beside the binary (/usr/local/lib/gpu-device-plugin/fake-nvml/libnvidia-ml.so.1)
# for end-to-end tests on machines without a GPU (manifests/overlays/kind-e2e); a real node never loads it
# unless told to with --nvml-lib.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-slim-${DEBIAN_RELEASE} AS build
WORKDIR /src
COPY . .
# Stripped release build of the plugin and the fake library; the cargo registry and target directory are
# cached between builds, so the artifacts are copied out in the same step.
ENV CARGO_PROFILE_RELEASE_STRIP=symbols
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpu-device-plugin -p fake-nvml \
    && mkdir -p /out/bin /out/lib \
    && cp target/release/gpu-device-plugin /out/bin/ \
    && cp target/release/libfake_nvml.so /out/lib/libnvidia-ml.so.1

# Debian 12's C library (2.36, which the packed relocations of the release build need), no shell, no package
# manager; runs as an unprivileged user unless the pod says otherwise (the DaemonSet must run it as root: the
# kubelet's sockets are root's).
FROM gcr.io/distroless/cc-debian12:nonroot
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="gpu-device-plugin" \
      org.opencontainers.image.description="Kubernetes device plugin for NVIDIA GPUs that tells the truth about device health" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="gcr.io/distroless/cc-debian12:nonroot"
COPY --from=build /out/bin/gpu-device-plugin /usr/local/bin/gpu-device-plugin
COPY --from=build /out/lib/libnvidia-ml.so.1 /usr/local/lib/gpu-device-plugin/fake-nvml/libnvidia-ml.so.1
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpu-device-plugin"]
