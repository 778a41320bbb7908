# syntax=docker/dockerfile:1
#
# The kernel image for Kubernetes: one pod of it per kernel, named by a policy's
# [kubernetes] image (deploy/kubernetes/policies/default.toml). It holds the python3
# kernel's environment and cellgate-agent, which the gateway reaches on TCP 7070 (the pod's
# command, set by the gateway: `cellgate-agent --listen-tcp 0.0.0.0:7070 --key-file
# /var/run/secrets/cellgate/key`) and which starts ipykernel when asked. Layout:
#
#   /usr/bin/python3.11                      Debian's Python 3.11
#   /opt/cellgate/venv                       the kernel venv, as `./dev setup` makes it
#   /opt/cellgate/bin/cellgate-agent         the agent (workspace crate guest/agent)
#   uid/gid 1000, HOME=/home/user            the workspace (an emptyDir in the pod)
#
# Build from the repository root:
#
#   docker build -f deploy/kubernetes/images/kernel.Dockerfile -t REGISTRY/cellgate-kernel:TAG .
#
# Without Docker or a registry, `./dev release --images` (deploy/release/images.sh) builds
# this file with buildah on a Debian root of its own (BASE_IMAGE), and replaces the build
# stages `agent` and `venv` by name with a directory of what the release already made
# (`--build-context agent=DIR --build-context venv=DIR`, which BuildKit's `docker buildx
# build` also takes): DIR/out/cellgate-agent, the stripped agent, and DIR/opt/cellgate/venv,
# the kernel environment `./dev setup` built from the same lock file. The final stage, what
# the image holds, is this file's either way; that build is smoke-tested (DEPLOY.md,
# "Kubernetes"). UNTESTED: the stages that compile and pip-install were never run here (no
# registry, so no rust image), nor was the image run in a cluster. It passes hadolint 2.15.1.
#
# Bases are pinned by tag (the Rust release rust-toolchain.toml names, Debian 12); pin them
# by digest (image@sha256:...) in your own builds for reproducible images.

ARG DEBIAN=bookworm
# The Debian image every stage but the Rust build starts from.
ARG BASE_IMAGE=docker.io/library/debian:${DEBIAN}-slim
ARG RUST_VERSION=1.95.0

# --- the agent -----------------------------------------------------------------------------
FROM docker.io/library/rust:${RUST_VERSION}-${DEBIAN} AS agent
WORKDIR /src
# The whole workspace: cargo loads every member's manifest, and the lock file covers them.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=cellgate-agent-target \
    cargo build --release --locked -p cellgate-agent \
 && install -D -m 0755 target/release/cellgate-agent /out/cellgate-agent

# --- the kernel venv, at the path the pod runs it from ---------------------------------------
FROM ${BASE_IMAGE} AS venv
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/*
# python3-lean (--build-arg KERNEL=python3-lean): the small environment of
# kernels/python3-lean instead of the full stack (DEPLOY.md, "A lean kernel").
ARG KERNEL=python3
COPY kernels/${KERNEL}/requirements.txt kernels/python3/cellgate_kernel_launcher.py \
     kernels/python3/cellgate_display.py kernels/python3/cellgate_command.py /tmp/kernel/
# The steps of `./dev setup` (setup_venv, install_kernel_files): Debian's interpreter
# makes the venv at /opt/cellgate/venv, pip installs exactly the lock file's pins, the
# launcher, the display extension and the commands API's runner (cellgate_command.py, which
# POST /v1/sessions/{id}/commands runs in the kernel) go into site-packages, compiled where
# they will run (the pod's root is read-only: nothing can be compiled there later), and pip
# check finds no broken requirement.
RUN /usr/bin/python3.11 -m venv /opt/cellgate/venv \
 && /opt/cellgate/venv/bin/python -m pip install --no-cache-dir --quiet --no-input \
        --disable-pip-version-check --progress-bar off -r /tmp/kernel/requirements.txt \
 && purelib="$(/opt/cellgate/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
 && install -m 0644 /tmp/kernel/cellgate_kernel_launcher.py /tmp/kernel/cellgate_display.py \
        /tmp/kernel/cellgate_command.py "$purelib/" \
 && /opt/cellgate/venv/bin/python -m compileall -q -f "$purelib/cellgate_kernel_launcher.py" "$purelib/cellgate_display.py" \
        "$purelib/cellgate_command.py" \
 && /opt/cellgate/venv/bin/python -m pip check --disable-pip-version-check

# --- the image -----------------------------------------------------------------------------
FROM ${BASE_IMAGE}
# python3.11: the venv's base interpreter (its bin/python links to /usr/bin/python3.11);
# ca-certificates: TLS to the hosts a policy allows, through the gateway's proxy.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# The kernel's user (the pod's runAsUser/runAsGroup/fsGroup 1000). Its home is the pod's
# workspace emptyDir; /run/cellgate and /tmp are memory emptyDirs; the rest is read-only.
RUN groupadd --gid 1000 user \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /home/user --shell /usr/sbin/nologin user \
 && install -d -o 1000 -g 1000 -m 0700 /home/user \
 && install -d -m 0755 /run/cellgate /var/run/secrets/cellgate
COPY --from=venv /opt/cellgate/venv /opt/cellgate/venv
COPY --from=agent /out/cellgate-agent /opt/cellgate/bin/cellgate-agent
ENV HOME=/home/user \
    PATH=/opt/cellgate/venv/bin:/usr/local/bin:/usr/bin:/bin
WORKDIR /home/user
USER 1000:1000
EXPOSE 7070
# The gateway sets the pod's command to exactly this; here for `docker run` and readers.
ENTRYPOINT ["/opt/cellgate/bin/cellgate-agent"]
CMD ["--listen-tcp", "0.0.0.0:7070", "--key-file", "/var/run/secrets/cellgate/key"]
