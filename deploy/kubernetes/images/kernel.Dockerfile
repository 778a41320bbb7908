# syntax=docker/dockerfile:1
#
# The kernel image for Kubernetes: one pod of it per kernel, named by a policy's
# [kubernetes] image (deploy/kubernetes/policies/default.toml), or by its kernel_images for
# another language. It holds one kernel's environment (--build-arg KERNEL: python3 by default;
# python3-lean, bash, deno or ir) and cellgate-agent, which the gateway reaches on TCP 7070 (the pod's
# command, set by the gateway: `cellgate-agent --listen-tcp 0.0.0.0:7070 --key-file
# /var/run/secrets/cellgate/key`) and which starts ipykernel when asked. Layout:
#
#   /usr/bin/python3.11                      Debian's Python 3.11 (the Python kernels')
#   /opt/cellgate/venv                       the kernel's environment, as `./dev setup`
#                                            makes it (a venv; Deno's binary and relay; R's
#                                            start files, R itself being Debian's in /usr)
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
    cargo build --release --locked -p cellgate-agent -p cellgate-tcp-kernel \
 && install -D -m 0755 target/release/cellgate-agent /out/cellgate-agent \
 && install -D -m 0755 target/release/cellgate-tcp-kernel /out/cellgate-tcp-kernel

# --- the kernel's environment, at the path the pod runs it from ----------------------------
FROM ${BASE_IMAGE} AS venv
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# python3-lean: the small environment of kernels/python3-lean instead of the full stack
# (DEPLOY.md, "A lean kernel"); bash, deno, ir: the other languages' kernels.
ARG KERNEL=python3
COPY kernels/python3/cellgate_kernel_launcher.py kernels/python3/cellgate_display.py \
     kernels/python3/cellgate_command.py /tmp/python3/
COPY kernels/${KERNEL}/ /tmp/kernel/
COPY --from=agent /out/cellgate-tcp-kernel /tmp/relay/
# The steps of `./dev setup` (setup_venvs, setup_deno_env, setup_r_env):
# - a Python kernel: Debian's interpreter makes the venv at /opt/cellgate/venv, pip installs
#   exactly the lock file's pins, the kernel's own modules (python3's: the launcher, the
#   display extension and the commands API's runner, cellgate_command.py, which POST
#   /v1/sessions/{id}/commands runs in the kernel; bash's: its kernel) go into
#   site-packages, compiled where they will run (the pod's root is read-only: nothing can be
#   compiled there later), and pip check finds no broken requirement;
# - deno: the npm registry's tarball kernels/deno/environment.lock names, its sha256
#   checked, and the relay Deno runs behind (it binds TCP only);
# - ir: R's start files (R, IRkernel and the packages are Debian's: the image stage below).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN case "$KERNEL" in \
      python3) modules="/tmp/python3/cellgate_kernel_launcher.py /tmp/python3/cellgate_display.py /tmp/python3/cellgate_command.py" ;; \
      python3-lean) modules="/tmp/python3/cellgate_kernel_launcher.py /tmp/python3/cellgate_command.py" ;; \
      bash) modules="/tmp/kernel/cellgate_bash_kernel.py /tmp/python3/cellgate_command.py" ;; \
    esac \
 && if [ -f /tmp/kernel/requirements.txt ]; then \
      /usr/bin/python3.11 -m venv /opt/cellgate/venv \
   && /opt/cellgate/venv/bin/python -m pip install --no-cache-dir --quiet --no-input \
          --disable-pip-version-check --progress-bar off -r /tmp/kernel/requirements.txt \
   && purelib="$(/opt/cellgate/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
   && for module in $modules; do \
        install -m 0644 "$module" "$purelib/" \
     && /opt/cellgate/venv/bin/python -m compileall -q -f "$purelib/$(basename "$module")"; \
      done \
   && /opt/cellgate/venv/bin/python -m pip check --disable-pip-version-check; \
    elif [ "$KERNEL" = deno ]; then \
      package="$(sed -n 's/^package=//p' /tmp/kernel/environment.lock)" \
   && version="$(sed -n 's/^version=//p' /tmp/kernel/environment.lock)" \
   && sha="$(sed -n 's/^sha256=//p' /tmp/kernel/environment.lock)" \
   && curl -fsSL -o /tmp/deno.tgz "https://registry.npmjs.org/$package/-/${package##*/}-$version.tgz" \
   && echo "$sha  /tmp/deno.tgz" | sha256sum --check --quiet \
   && tar -xzf /tmp/deno.tgz -C /tmp package/deno \
   && install -D -m 0755 /tmp/package/deno /opt/cellgate/venv/bin/deno \
   && install -m 0755 /tmp/relay/cellgate-tcp-kernel /opt/cellgate/venv/bin/cellgate-tcp-kernel \
   && echo "cellgate kernel environment: the sandboxes show this directory at /opt/cellgate/venv" \
          > /opt/cellgate/venv/cellgate-environment; \
    elif [ "$KERNEL" = ir ]; then \
      install -D -m 0755 /tmp/kernel/r-kernel /opt/cellgate/venv/bin/r-kernel \
   && install -D -m 0644 /tmp/kernel/cellgate_kernel.R /opt/cellgate/venv/lib/cellgate_kernel.R \
   && echo "cellgate kernel environment: the sandboxes show this directory at /opt/cellgate/venv" \
          > /opt/cellgate/venv/cellgate-environment; \
    else echo "KERNEL=$KERNEL: no such kernel (python3, python3-lean, bash, deno, ir)" >&2; exit 1; fi

# --- the image -----------------------------------------------------------------------------
FROM ${BASE_IMAGE}
# python3.11: a Python venv's base interpreter (its bin/python links to /usr/bin/python3.11);
# ca-certificates: TLS to the hosts a policy allows, through the gateway's proxy. The kernel's
# own Debian packages (kernels/KERNEL/guest-packages: R, IRkernel, ggplot2, dplyr, readr,
# tidyr and fonts for ir; bash and curl for bash) are what the microVM guest holds for it.
ARG KERNEL=python3
COPY kernels/${KERNEL}/ /tmp/kernel/
# hadolint ignore=DL3008,SC2046
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 ca-certificates \
 && if [ -f /tmp/kernel/guest-packages ]; then \
      apt-get install -y --no-install-recommends $(grep -v '^#' /tmp/kernel/guest-packages); \
    fi \
 && rm -rf /var/lib/apt/lists/* /tmp/kernel
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
