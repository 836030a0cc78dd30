# tarn's image: a statically linked `tarn` in an empty (`scratch`) image, run as an unprivileged
# user (65532), collections in the /data volume, health checked with `tarn healthcheck`, SIGTERM
# handled by `tarn serve` (stop accepting, finish in-flight requests, sync, exit 0).
#
# Two ways to build it, with the same result:
#
#   scripts/docker-image.sh          builds the static binary on the host, then
#                                    `docker build --target prebuilt`: needs no registry at all.
#   docker build -t tarn .           multi-stage: compiles inside the official Rust image
#                                    (needs a registry to pull rust:1-bookworm; BuildKit skips the
#                                    `prebuilt` stage, so no host binary is needed).
#
# Stage order matters: Docker's classic builder (no BuildKit) builds every stage up to the
# target, so `prebuilt` comes before the stage that pulls an image. No `# syntax=` line: it makes
# BuildKit pull a frontend image.

FROM scratch AS base
COPY --chown=65532:65532 docker/rootfs/ /
USER 65532:65532
ENV TARN_DATA_DIR=/data \
    TARN_LISTEN=0.0.0.0:50051 \
    TARN_METRICS_LISTEN=0.0.0.0:9090 \
    TARN_ADDR=http://127.0.0.1:50051
VOLUME ["/data"]
EXPOSE 50051 9090
HEALTHCHECK --interval=5s --timeout=3s --start-period=20s --retries=3 \
    CMD ["/usr/local/bin/tarn", "healthcheck"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/tarn"]
CMD ["serve"]

# The binary from the host: `RUSTFLAGS='-C target-feature=+crt-static' cargo build --release
# --target x86_64-unknown-linux-gnu -p tarn` (what scripts/docker-image.sh runs).
FROM base AS prebuilt
COPY target/x86_64-unknown-linux-gnu/release/tarn /usr/local/bin/tarn

FROM rust:1-bookworm AS build
# Nothing to install: every .proto (tarn's and etcd's) is compiled by protox, in Rust.
WORKDIR /src
COPY . .
RUN RUSTFLAGS='-C target-feature=+crt-static' \
    cargo build --release --locked --target x86_64-unknown-linux-gnu -p tarn

FROM base AS runtime
COPY --from=build /src/target/x86_64-unknown-linux-gnu/release/tarn /usr/local/bin/tarn
