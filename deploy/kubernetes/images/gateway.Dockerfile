# syntax=docker/dockerfile:1
#
# The gateway's image for Kubernetes (deploy/kubernetes/deployment.yaml): the release binary
# and the kernelspecs, nothing else. Its kernels are pods of the kernel image
# (kernel.Dockerfile), so this image has no sandbox tools (no runsc, no QEMU), runs as a
# non-root user and needs no capability. Build from the repository root:
#
#   docker build -f deploy/kubernetes/images/gateway.Dockerfile -t REGISTRY/cellgate-gateway:TAG .
#
# Without Docker or a registry, `./dev release --images` (deploy/release/images.sh) builds
# this file with buildah on a Debian root of its own (BASE_IMAGE), and replaces the build
# stage `build` by name with a directory of what the release already made (`--build-context
# build=DIR`, which BuildKit's `docker buildx build` also takes): DIR/out/cellgate, the
# release's stripped binary. The final stage, what the image holds, is this file's either
# way; that build is smoke-tested (DEPLOY.md, "Kubernetes"). UNTESTED: the stage that
# compiles was never run here (no registry, so no rust image), nor was the image run in a
# cluster. It passes hadolint 2.15.1.
#
# Bases are pinned by tag (the Rust release rust-toolchain.toml names, Debian 12); pin them
# by digest (image@sha256:...) in your own builds for reproducible images.

ARG DEBIAN=bookworm
# The Debian image every stage but the Rust build starts from.
ARG BASE_IMAGE=docker.io/library/debian:${DEBIAN}-slim
ARG RUST_VERSION=1.95.0

# --- the gateway ---------------------------------------------------------------------------
FROM docker.io/library/rust:${RUST_VERSION}-${DEBIAN} AS build
# Packages follow the Debian release and its security updates rather than pinned versions.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends nodejs npm pkg-config make \
 && rm -rf /var/lib/apt/lists/*
# The web client's chart libraries and the API reference's Swagger UI are embedded by
# build.rs from web-client/node_modules (locked by its package-lock.json).
WORKDIR /src/web-client
COPY web-client/package.json web-client/package-lock.json ./
RUN npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=cellgate-target \
    cargo build --release --locked --bin cellgate \
 && install -D -m 0755 target/release/cellgate /out/cellgate

# --- the image -----------------------------------------------------------------------------
FROM ${BASE_IMAGE}
# python3.11 only for the kernelspec's environment check (below); ca-certificates for the
# package index's upstream and the egress proxy's TLS checks; tini as PID 1.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 ca-certificates tini \
 && rm -rf /var/lib/apt/lists/*
# The user the Deployment runs as (runAsUser/runAsGroup 10001); no login, no home.
RUN groupadd --system --gid 10001 cellgate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin cellgate
COPY --from=build /out/cellgate /usr/local/bin/cellgate
COPY kernels/python3/kernel.json kernels/python3/logo-32x32.png kernels/python3/logo-64x64.png kernels/python3/logo-svg.svg \
     /usr/local/share/cellgate/kernels/python3/
# The gateway resolves a kernelspec's `python` to its .venv and checks that the interpreter
# exists before any backend runs it. The kernel's real environment is in the kernel image
# (/opt/cellgate/venv there); here an empty venv of the same interpreter, at the same path,
# stands for it (~0 MB: python3.11 is installed above anyway).
# The other languages' kernelspecs (their pods run the images a policy's [kubernetes]
# kernel_images names): placeholders of the same kind, an empty venv for bash, a marked
# directory for Deno and R (src/sandbox/relocate.rs, ENVIRONMENT_MARKER).
COPY kernels/bash/kernel.json /usr/local/share/cellgate/kernels/bash/
COPY kernels/deno/kernel.json /usr/local/share/cellgate/kernels/deno/
COPY kernels/ir/kernel.json /usr/local/share/cellgate/kernels/ir/
RUN python3.11 -m venv --without-pip /opt/cellgate/venv \
 && ln -s /opt/cellgate/venv /usr/local/share/cellgate/kernels/python3/.venv \
 && python3.11 -m venv --without-pip /opt/cellgate/envs/bash \
 && ln -s /opt/cellgate/envs/bash /usr/local/share/cellgate/kernels/bash/.venv \
 && for kernel in deno ir; do \
      mkdir -p "/opt/cellgate/envs/$kernel" \
   && echo "placeholder: the kernel's environment is in its pod's image" > "/opt/cellgate/envs/$kernel/cellgate-environment" \
   && ln -s "/opt/cellgate/envs/$kernel" "/usr/local/share/cellgate/kernels/$kernel/.venv"; \
    done \
 && mkdir -p /etc/cellgate/config /etc/cellgate/policies /var/lib/cellgate /var/cache/cellgate
# Settings and policies come from ConfigMaps mounted at /etc/cellgate/{config,policies};
# /var/lib/cellgate, /var/cache/cellgate and /tmp are emptyDir volumes (read-only root).
ENV RUST_LOG=info,zeromq=error
USER 10001:10001
EXPOSE 8888 9464
# tini reaps and forwards SIGTERM; the gateway then deletes its kernels' pods and exits
# (terminationGracePeriodSeconds: 30).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/cellgate"]
CMD ["serve", "--config", "/etc/cellgate/config/cellgate.toml"]
