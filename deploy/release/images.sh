#!/usr/bin/env bash
# Builds cellgate's container images without Docker and without any registry, saves them as
# OCI archives and smoke-tests them: the second half of `./dev release --images`, which
# passes every argument (run it through ./dev: it checks the inputs first).
#
#   deploy/release/images.sh --dist DIR --version V --agent PATH --venv DIR --kernels DIR
#                            [--work DIR]
#
#   --dist DIR     the release's directory: reads cellgate-V-linux-ARCH.tar.gz (its stripped
#                  binary and zygote library), writes the three OCI archives beside it
#   --version V    the release's version (the images' tag)
#   --agent PATH   cellgate-agent, for the kernel image (stripped on the way)
#   --venv DIR     the python3 kernel's environment, built at /opt/cellgate/venv from
#                  kernels/python3/requirements.txt (what `./dev setup` makes in
#                  kernels/python3/.venv)
#   --kernels DIR  the checkout's kernels/: the bash, Deno and R kernels' environments
#                  `./dev setup` made in DIR/NAME/.venv (bash's at /opt/cellgate/venv), for
#                  the all-in-one image and the languages' kernel images
#   --work DIR     caches and scratch space (default target/images): the image store, the
#                  Debian base
#
# How (DEPLOY.md, "The container", says it for operators):
#
# 1. A Debian bookworm root from `debootstrap --variant=minbase`, from the mirror this host's
#    apt uses, upgraded from bookworm-updates and bookworm-security and trimmed as Debian's
#    own bookworm-slim image is; imported as the local image that the Dockerfiles' BASE_IMAGE
#    names. Cached for the day (a new day's build gets that day's security updates).
# 2. `buildah bud` runs the Dockerfiles themselves, so they stay the one description of what
#    is in each image (packages, users, paths, entrypoints). Their build stages compile Rust
#    and pip-install the kernel's environment; here those stages are replaced, by name, with a
#    directory (`--build-context STAGE=DIR`: BuildKit's `docker buildx build` does the same)
#    holding what the release already made: the stripped binaries of the release tarball,
#    and the kernel environment the test suite runs (`./dev setup` builds it from the same
#    lock file, with the same Debian python3.11, at the path the images use). Nothing is
#    compiled and nothing is pip-installed in an image: only Debian packages are fetched.
# 3. `buildah push` to oci-archive: in DIR: cellgate-V-oci.tar (deploy/container/Dockerfile:
#    the gateway with its kernels' environment and sandboxes), cellgate-gateway-V-oci.tar and
#    cellgate-kernel-V-oci.tar (deploy/kubernetes/images).
# 4. Smoke tests with podman (--network host, the gateway on 127.0.0.1 only): the gateway
#    image serves /readyz and runs `6*7` through API v1 in a forked namespaces kernel, and
#    stops cleanly on SIGTERM; the Kubernetes gateway image's binary runs as its user; the
#    kernel image runs its agent as a kernel pod does (listening, with a key) and its
#    environment imports the launcher files.
#
# Needs root (debootstrap, the image store, privileged containers) and Debian's buildah,
# podman, debootstrap and runc (installed when missing). Everything it stores is under
# --work: its own image store, never the host's (/var/lib/containers).
set -euo pipefail
# The whole script is one block, read before any of it runs: editing this file while a
# build runs cannot change what that build does.
{
dist="" version="" agent="" venv="" kernels=""
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
repo="$(cd "$here/../.." && pwd -P)"
work="$repo/target/images"
while [ $# -gt 0 ]; do
  case "$1" in
    --dist) dist=$2; shift 2 ;;
    --version) version=$2; shift 2 ;;
    --agent) agent=$2; shift 2 ;;
    --venv) venv=$2; shift 2 ;;
    --kernels) kernels=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    -h | --help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "images.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

START=$SECONDS
log() { printf '==> [images %d:%02d] %s\n' $(((SECONDS - START) / 60)) $(((SECONDS - START) % 60)) "$*" >&2; }
note() { printf '    %s\n' "$*" >&2; }
die() {
  printf 'images.sh: error: %s\n' "$*" >&2
  exit 1
}
# Each step's duration, printed at the end.
TIMES=()
step_name="" step_started=0
step() {
  step_done
  step_name=$1
  step_started=$SECONDS
  log "$1"
}
step_done() {
  if [ -n "$step_name" ]; then
    TIMES+=("$(printf '%4ds  %s' $((SECONDS - step_started)) "$step_name")")
  fi
  step_name=""
}

[ -n "$dist" ] && [ -n "$version" ] && [ -n "$agent" ] && [ -n "$venv" ] && [ -n "$kernels" ] ||
  die "--dist, --version, --agent, --venv and --kernels are required (see --help)"
bash_env=$kernels/bash/.venv deno_env=$kernels/deno/.venv ir_env=$kernels/ir/.venv
[ "$(id -u)" -eq 0 ] || die "needs root: debootstrap, the image store and the smoke tests' privileged container"
arch="$(uname -m)"
tarball="$dist/cellgate-$version-linux-$arch.tar.gz"
[ -f "$tarball" ] || die "no release tarball $tarball (./dev release makes it)"
[ -x "$agent" ] || die "no agent at $agent"
[ -x "$venv/bin/python" ] || die "no kernel environment at $venv"
grep -qx "command = .* -m venv /opt/cellgate/venv" "$venv/pyvenv.cfg" ||
  die "$venv was not built at /opt/cellgate/venv (./dev setup builds it there)"
grep -qx "command = .* -m venv /opt/cellgate/venv" "$bash_env/pyvenv.cfg" 2>/dev/null ||
  die "$bash_env is no bash kernel environment built at /opt/cellgate/venv (./dev setup builds it there)"
[ -x "$deno_env/bin/deno" ] && [ -x "$deno_env/bin/cellgate-tcp-kernel" ] ||
  die "$deno_env has no bin/deno and bin/cellgate-tcp-kernel (./dev setup makes them)"
[ -x "$ir_env/bin/r-kernel" ] || die "$ir_env has no bin/r-kernel (./dev setup makes it)"
mkdir -p "$work"
work="$(cd "$work" && pwd -P)"
# One build at a time per store: each starts by removing the store's leftover containers.
exec 9>"$work/.lock"
flock 9

# --- tools ------------------------------------------------------------------------------------

# runc, not crun (podman's first choice): crun refuses hosts whose cgroup v2 hierarchy has
# controllers while v1 holds the rest ("cgroups in hybrid mode not supported"), as ours do.
PACKAGES=(buildah podman debootstrap runc curl)
step "tools: ${PACKAGES[*]}"
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q ' installed$' || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null || die "apt-get update failed"
  apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null >/dev/null ||
    die "apt-get install ${missing[*]} failed"
fi
note "$(buildah --version), $(podman --version), runc $(runc --version | sed -n 's/^runc version //p')"

# This build's own image store, runtime state and podman state, all under $work. Without
# skip_mount_home the overlay driver leaves its directory mounted on itself after every
# command, and `rm -rf target` (cargo clean) would then fail on it.
STORE=(--root "$work/storage" --runroot "$work/run" --storage-driver overlay
  --storage-opt overlay.skip_mount_home=true)
# (Without the lock's descriptor: conmon, which outlives a detached `podman run`, would
# hold it.)
bah() { buildah "${STORE[@]}" "$@" 9>&-; }
pod() {
  podman "${STORE[@]}" --tmpdir "$work/podman" --runtime runc --cgroup-manager cgroupfs \
    --events-backend none "$@" 9>&-
}
# Containers a stopped run left behind (this store only).
bah rm --all >/dev/null 2>&1 || true
pod rm --all --force >/dev/null 2>&1 || true
# Removes a scratch directory: first what is mounted under it, deepest first (a debootstrap
# stopped midway leaves its /proc and /sys mounted in its root), then never through a mount.
remove_scratch() {
  local m mounts
  mapfile -t mounts < <(awk -v dir="$1/" 'index($5 "/", dir) == 1 { print $5 }' /proc/self/mountinfo | sort -r)
  for m in "${mounts[@]}"; do umount -l "$m" 2>/dev/null || true; done
  rm -rf --one-file-system "$1"
}
# Those of runs that were killed.
for old in "$work"/scratch.*; do
  if [ -d "$old" ]; then remove_scratch "$old"; fi
done
scratch="$(mktemp -d "$work/scratch.XXXXXX")"
SMOKE=""
# shellcheck disable=SC2329 # run by the EXIT trap
cleanup() {
  [ -n "$SMOKE" ] && pod rm --force --volumes "$SMOKE" >/dev/null 2>&1
  bah rm --all >/dev/null 2>&1 || true
  remove_scratch "$scratch"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# --- 1. the Debian base ----------------------------------------------------------------------

# The first URI of the host's apt sources for a suite (deb822 or one-line), else Debian's.
mirror_for() {
  local suite=$1 fallback=$2 uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri="$(awk -v suite="$suite" '
      /^URIs:/ { uris = $2 } /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite) found = 1 }
      /^$/ { if (found && uris != "") { print uris; exit } found = 0; uris = "" }
      END { if (found && uris != "") print uris }' /etc/apt/sources.list.d/debian.sources | head -1)"
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri="$(awk -v suite="$suite" '$1 == "deb" && $3 == suite { print $2; exit }' /etc/apt/sources.list)"
  fi
  printf '%s\n' "${uri:-$fallback}"
}
MIRROR="$(mirror_for bookworm http://deb.debian.org/debian)"
SECURITY="$(mirror_for bookworm-security http://deb.debian.org/debian-security)"

# What Debian's bookworm-slim image has on top of minbase: no documentation, manual pages or
# translations installed by later packages, and no downloaded package left in the image (the
# Dockerfiles remove only the package lists, as they do on Debian's image).
slim_root() {
  local root=${1:?}
  [ "$(cd "$root" && pwd -P)" != / ] && [ -f "$root/etc/debian_version" ] ||
    die "slim_root: $root is not a Debian root of its own"
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  find "$root/usr/share/doc" -mindepth 1 -not -type d -not -name copyright -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$root"/usr/share/{groff,info,linda,lintian/overrides,locale,man}/* "${root:?}"/dev/* \
    "$root"/proc/* "$root"/sys/* "$root"/run/* "$root"/tmp/* "$root"/var/cache/apt/*.bin \
    "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log \
    "$root"/var/log/apt/* "$root/debootstrap"
  # The runtime provides these; debootstrap copied the host's.
  rm -f "$root/etc/resolv.conf" "$root/etc/hostname"
  : >"$root/etc/machine-id" 2>/dev/null || true
}

# Cached per day and per recipe (this script's base steps and the mirrors).
recipe="$(declare -f slim_root; echo "$MIRROR $SECURITY minbase bookworm")"
base_key="$(date -u +%Y%m%d)-$(printf '%s' "$recipe" | sha256sum | cut -c1-12)"
BASE="localhost/cellgate-build/debian:bookworm-slim-$base_key"
step "base image $BASE"
if bah inspect --type image "$BASE" >/dev/null 2>&1; then
  note "cached"
else
  note "debootstrap --variant=minbase bookworm $MIRROR"
  root="$scratch/root"
  debootstrap --variant=minbase --components=main bookworm "$root" "$MIRROR" \
    >"$scratch/debootstrap.log" 2>&1 || { tail -20 "$scratch/debootstrap.log" >&2; die "debootstrap failed"; }
  slim_root "$root"
  # Through a mount of the new container's root, so that owners, modes and special bits stay
  # as dpkg made them (`buildah copy` would give every file to root).
  c="$(bah from scratch)"
  m="$(bah mount "$c")"
  tar -C "$root" --numeric-owner --xattrs -cf - . | tar -C "$m" --numeric-owner --xattrs -xpf - ||
    die "copying the root into the image failed"
  bah umount "$c" >/dev/null
  rm -rf --one-file-system "$root"
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd '["bash"]' --os linux --arch "$(dpkg --print-architecture)" "$c"
  note "apt-get upgrade from bookworm-updates and bookworm-security"
  bah run --runtime runc --network host "$c" -- sh -c \
    'export DEBIAN_FRONTEND=noninteractive; apt-get update -q >/dev/null && apt-get upgrade -y -q >/dev/null && rm -rf /var/lib/apt/lists/*' ||
    die "apt-get upgrade in the base failed"
  bah commit --quiet --rm "$c" "$BASE" >/dev/null
  # Older bases, and the layers built on them (the next builds could not reuse them).
  for old in $(bah images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/cellgate-build/debian:' || true); do
    [ "$old" = "$BASE" ] || bah rmi --force "$old" >/dev/null 2>&1 || true
  done
  bah rmi --prune >/dev/null 2>&1 || true
fi
note "$(bah images --format '{{.Size}}' "$BASE" | head -1)"

# --- 2. the images ---------------------------------------------------------------------------

# What replaces the Dockerfiles' build stages: the layout each stage leaves (/out/..., the
# venv at /opt/cellgate/venv), from the release.
step "the release's artifacts: $(basename "$tarball"), $(basename "$agent"), the kernel environment"
prebuilt="$scratch/prebuilt"
mkdir -p "$prebuilt/out" "$prebuilt/opt/cellgate"
tar -xzf "$tarball" -C "$scratch" "cellgate-$version-linux-$arch/bin/" ||
  die "cannot unpack the binaries from $tarball"
install -m 0755 "$scratch/cellgate-$version-linux-$arch/bin/cellgate" "$prebuilt/out/cellgate"
install -m 0644 "$scratch/cellgate-$version-linux-$arch/bin/libcellgate_zygote.so" "$prebuilt/out/"
objcopy --strip-debug --strip-unneeded "$agent" "$prebuilt/out/cellgate-agent" || die "objcopy $agent failed"
chmod 0755 "$prebuilt/out/cellgate-agent"
install -m 0755 "$deno_env/bin/cellgate-tcp-kernel" "$prebuilt/out/cellgate-tcp-kernel"
# Hard links where they can be (the environment is 1.4 GB). ./dev's record of the lock and
# uv's lock file (mode 0666) stay out.
cp -al "$venv" "$prebuilt/opt/cellgate/venv" 2>/dev/null ||
  { rm -rf "$prebuilt/opt/cellgate/venv" && cp -a "$venv" "$prebuilt/opt/cellgate/venv"; } ||
  die "cannot copy $venv into the build context"
rm -f "$prebuilt/opt/cellgate/venv/.cellgate-stamp" "$prebuilt/opt/cellgate/venv/.lock"
# The other languages' environments, as the all-in-one image's `bash-env` and `deno-env`
# stages leave them (./dev setup built them from the same lock files; the bash venv at
# /opt/cellgate/venv, as its stage does).
# The languages' kernel images' `venv` stage: each environment at /opt/cellgate/venv.
for pair in "bash-env:opt/cellgate/venv:$bash_env" "deno-env:opt/cellgate/envs/deno:$deno_env" \
  "venv-bash:opt/cellgate/venv:$bash_env" "venv-deno:opt/cellgate/venv:$deno_env" "venv-ir:opt/cellgate/venv:$ir_env"; do
  IFS=: read -r stage at from <<<"$pair"
  mkdir -p "$(dirname "$scratch/$stage/$at")"
  cp -al "$from" "$scratch/$stage/$at" 2>/dev/null ||
    { rm -rf "${scratch:?}/$stage/$at" && cp -a "$from" "$scratch/$stage/$at"; } ||
    die "cannot copy $from into the build context"
  rm -f "$scratch/$stage/$at/.cellgate-stamp" "$scratch/$stage/$at/.lock"
done

BUD=(bud --layers --pull=never --network host --runtime runc --build-arg "BASE_IMAGE=$BASE"
  --label "org.opencontainers.image.version=$version")
# build IMAGE DOCKERFILE STAGE[=DIR]... [+ARG=VALUE]...: the Dockerfile from the repository
# root (its own .dockerignore), with each named build stage replaced by DIR, the prebuilt
# layout by default, and the build arguments given.
build() {
  local image=$1 dockerfile=$2 contexts=() s title
  shift 2
  title="${image#localhost/}"
  for s in "$@"; do
    case "$s" in
      +*) contexts+=(--build-arg "${s#+}") ;;
      *=*) contexts+=(--build-context "$s") ;;
      *) contexts+=(--build-context "$s=$prebuilt") ;;
    esac
  done
  bah "${BUD[@]}" "${contexts[@]}" --label "org.opencontainers.image.title=${title%:*}" \
    --ignorefile "$repo/$dockerfile.dockerignore" -f "$repo/$dockerfile" -t "$image" "$repo" >"$scratch/build.log" 2>&1 ||
    { tail -40 "$scratch/build.log" >&2; die "buildah bud $dockerfile failed (above)"; }
  note "$image: $(bah images --format '{{.Size}}' "$image" | head -1)"
}
ALL_IN_ONE="localhost/cellgate:$version"
GATEWAY="localhost/cellgate-gateway:$version"
KERNEL="localhost/cellgate-kernel:$version"
step "build $ALL_IN_ONE (deploy/container/Dockerfile)"
build "$ALL_IN_ONE" deploy/container/Dockerfile build kernel-env "bash-env=$scratch/bash-env" \
  "deno-env=$scratch/deno-env"
step "build $GATEWAY (deploy/kubernetes/images/gateway.Dockerfile)"
build "$GATEWAY" deploy/kubernetes/images/gateway.Dockerfile build
step "build $KERNEL (deploy/kubernetes/images/kernel.Dockerfile)"
build "$KERNEL" deploy/kubernetes/images/kernel.Dockerfile agent venv
# The other languages' kernel pods (a policy's [kubernetes] kernel_images).
LANGS=(bash deno ir)
for lang in "${LANGS[@]}"; do
  step "build localhost/cellgate-kernel-$lang:$version (kernel.Dockerfile, KERNEL=$lang)"
  build "localhost/cellgate-kernel-$lang:$version" deploy/kubernetes/images/kernel.Dockerfile agent \
    "venv=$scratch/venv-$lang" "+KERNEL=$lang"
done

# --- 3. the archives -------------------------------------------------------------------------

step "OCI archives in $dist"
ARCHIVES=("cellgate-$version-oci.tar" "cellgate-gateway-$version-oci.tar" "cellgate-kernel-$version-oci.tar")
PAIRS=("$ALL_IN_ONE:${ARCHIVES[0]}" "$GATEWAY:${ARCHIVES[1]}" "$KERNEL:${ARCHIVES[2]}")
for lang in "${LANGS[@]}"; do
  ARCHIVES+=("cellgate-kernel-$lang-$version-oci.tar")
  PAIRS+=("localhost/cellgate-kernel-$lang:$version:cellgate-kernel-$lang-$version-oci.tar")
done
pids=()
for pair in "${PAIRS[@]}"; do
  image="${pair%:*}" archive="${pair##*:}"
  rm -f "$dist/$archive"
  # Named inside the archive without localhost/: `podman load` and `docker load` give it
  # their local name (localhost/NAME:V, NAME:V).
  name="${image#localhost/}"
  bah push --quiet "$image" "oci-archive:$dist/$archive:$name" >"$scratch/push-$archive.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { cat "$scratch/push-${ARCHIVES[$i]}.log" >&2; die "buildah push ${ARCHIVES[$i]} failed"; }
  note "$(du -h "$dist/${ARCHIVES[$i]}" | cut -f1)  ${ARCHIVES[$i]}"
done

# --- 4. smoke tests --------------------------------------------------------------------------

# Root here lacks nothing podman needs but, on some hosts (ours), CAP_SYS_RESOURCE: podman's
# default limits (1048576 open files and processes) cannot be set there; this host's own
# hard limits can.
ulimits() {
  local files procs
  files="$(ulimit -Hn)" procs="$(ulimit -Hu)"
  [ "$files" = unlimited ] && files=1048576
  { [ "$procs" = unlimited ] || [ "$procs" -gt 32768 ]; } && procs=32768
  printf '%s\n' --ulimit "nofile=$files:$files" --ulimit "nproc=$procs:$procs"
}
mapfile -t LIMITS < <(ulimits)
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

step "smoke test: $ALL_IN_ONE serves /readyz and runs 6*7 in each language"
token="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
port="$(free_port)"
# DEPLOY.md's flags (--privileged --cgroupns=private); the host's network namespace with the
# gateway on 127.0.0.1 only, so that nothing is published anywhere.
SMOKE="$(pod run -d --privileged --cgroupns=private --network host "${LIMITS[@]}" \
  -e CELLGATE_AUTH_TOKEN="$token" -e CELLGATE_IP=127.0.0.1 -e CELLGATE_PORT="$port" \
  "$ALL_IN_ONE")" || die "podman run $ALL_IN_ONE failed"
url="http://127.0.0.1:$port"
auth=(-H "Authorization: token $token")
ready=0 waited=$SECONDS
while [ $((SECONDS - waited)) -lt 180 ]; do
  [ "$(pod inspect --format '{{.State.Running}}' "$SMOKE")" = true ] ||
    { pod logs "$SMOKE" >&2; die "the gateway container exited (its log above)"; }
  status="$(curl -s -o "$scratch/readyz" -w '%{http_code}' "${auth[@]}" "$url/readyz" || true)"
  if [ "$status" = 200 ]; then ready=1; break; fi
  sleep 1
done
[ "$ready" -eq 1 ] || { pod logs "$SMOKE" >&2; cat "$scratch/readyz" >&2 2>/dev/null; die "/readyz not 200 after 180 s (last: $status)"; }
note "/readyz 200 after $((SECONDS - waited)) s"
curl -s --max-time 120 "${auth[@]}" -H 'Content-Type: application/json' -X POST "$url/v1/execute" \
  -d '{"code": "6*7"}' >"$scratch/execute.json" || die "POST /v1/execute failed"
python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); sys.exit(r.get("result") != "42")' \
  "$scratch/execute.json" || { pod logs "$SMOKE" >&2; cat "$scratch/execute.json" >&2; die "POST /v1/execute 6*7 did not answer 42"; }
note "POST /v1/execute {\"code\": \"6*7\"}: $(cat "$scratch/execute.json")"
# The other languages' kernels, each started for its own execution, at once.
langs=(deno ir bash)
declare -A lang_code=([deno]='6 * 7' [ir]='6 * 7' [bash]='echo $((6 * 7))')
declare -A lang_want=([deno]='result=42' [ir]='stdout=[1] 42' [bash]='stdout=42')
pids=()
for lang in "${langs[@]}"; do
  body="$(python3 -c 'import json, sys; print(json.dumps({"code": sys.argv[1], "kernel_name": sys.argv[2]}))' "${lang_code[$lang]}" "$lang")"
  curl -s --max-time 180 "${auth[@]}" -H 'Content-Type: application/json' -X POST "$url/v1/execute" \
    -d "$body" >"$scratch/execute-$lang.json" &
  pids+=($!)
done
for i in "${!langs[@]}"; do
  lang=${langs[$i]}
  wait "${pids[$i]}" || die "POST /v1/execute in $lang failed"
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); field, want = sys.argv[2].split("=", 1); sys.exit(str(r.get(field)).strip() != want)' \
    "$scratch/execute-$lang.json" "${lang_want[$lang]}" ||
    { pod logs "$SMOKE" >&2; cat "$scratch/execute-$lang.json" >&2; die "the $lang kernel did not answer ${lang_want[$lang]}"; }
  note "$lang: ${lang_code[$lang]} -> ${lang_want[$lang]}"
done
# (Through a file: `grep -q` would stop reading at the first match, and podman fail on the
# broken pipe.)
pod logs "$SMOKE" >"$scratch/gateway.log" 2>&1
grep -q 'forked=true' "$scratch/gateway.log" ||
  { cat "$scratch/gateway.log" >&2; die "no kernel was forked from the zygote in the image (its log above)"; }
note "the kernel was forked from the zygote"
stopped=$SECONDS
pod stop --time 30 "$SMOKE" >/dev/null || die "podman stop failed"
code="$(pod inspect --format '{{.State.ExitCode}}' "$SMOKE")"
[ "$code" = 0 ] || { pod logs "$SMOKE" >&2; die "the gateway exited $code on SIGTERM"; }
note "stopped on SIGTERM in $((SECONDS - stopped)) s, exit 0"
pod rm --volumes "$SMOKE" >/dev/null
SMOKE=""

step "smoke test: $GATEWAY runs its binary as 10001"
out="$(pod run --rm --network none "${LIMITS[@]}" --entrypoint /bin/sh "$GATEWAY" -c \
  'id -u; /usr/local/bin/cellgate --version; test -x /usr/local/share/cellgate/kernels/python3/.venv/bin/python && echo venv' 2>&1)" ||
  die "$GATEWAY: $out"
[ "$out" = "10001
cellgate $version
venv" ] || die "$GATEWAY answered: $out"
note "$(echo "$out" | tr '\n' ' ')"

step "smoke test: $KERNEL runs its agent and imports the launcher"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$scratch/key"
chmod 0644 "$scratch/key"
SMOKE="$(pod run -d --network none "${LIMITS[@]}" \
  -v "$scratch/key:/var/run/secrets/cellgate/key:ro" "$KERNEL")" || die "podman run $KERNEL failed"
out="$(pod exec "$SMOKE" /opt/cellgate/venv/bin/python -c '
import os, socket, sys, time
import cellgate_kernel_launcher, cellgate_display, cellgate_command, ipykernel, numpy, pandas
assert sys.prefix == "/opt/cellgate/venv", sys.prefix
assert os.getuid() == 1000 and os.environ["HOME"] == "/home/user", (os.getuid(), os.environ["HOME"])
assert os.access("/opt/cellgate/bin/cellgate-agent", os.X_OK)
for _ in range(100):
    try:
        socket.create_connection(("127.0.0.1", 7070), 1).close()
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("the agent does not listen on 7070")
print("agent listening; launcher, display, command, ipykernel", ipykernel.__version__, "numpy", numpy.__version__)
' 2>&1)" || { pod logs "$SMOKE" >&2; die "$KERNEL: $out"; }
note "$out"
pod rm --force --volumes "$SMOKE" >/dev/null
SMOKE=""

# The languages' kernel images: the agent listens as in a pod, and the kernel's own program
# runs from /opt/cellgate/venv (with R's packages, for ir).
AGENT_LISTENS='
import os, socket, sys, time
assert os.getuid() == 1000, os.getuid()
for _ in range(100):
    try:
        socket.create_connection(("127.0.0.1", 7070), 1).close()
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("the agent does not listen on 7070")
print("agent listening")
'
declare -A lang_check=(
  [bash]='/opt/cellgate/venv/bin/python -c "import cellgate_bash_kernel, bash_kernel; print(\"bash_kernel\", bash_kernel.__version__)"'
  [deno]='/opt/cellgate/venv/bin/deno --version | head -n1'
  [ir]='/usr/bin/Rscript -e "suppressMessages({library(IRkernel); library(ggplot2); library(dplyr)}); cat(R.version.string, fill = TRUE)"'
)
for lang in "${LANGS[@]}"; do
  image="localhost/cellgate-kernel-$lang:$version"
  step "smoke test: $image runs its agent and its kernel's program"
  SMOKE="$(pod run -d --network none "${LIMITS[@]}" \
    -v "$scratch/key:/var/run/secrets/cellgate/key:ro" "$image")" || die "podman run $image failed"
  out="$(pod exec "$SMOKE" /usr/bin/python3.11 -c "$AGENT_LISTENS" 2>&1)" ||
    { pod logs "$SMOKE" >&2; die "$image: $out"; }
  out="$(pod exec "$SMOKE" /bin/sh -c "${lang_check[$lang]}" 2>&1)" ||
    { pod logs "$SMOKE" >&2; die "$image: ${lang_check[$lang]}: $out"; }
  note "$lang: agent listening; $(echo "$out" | tail -n1)"
  pod rm --force --volumes "$SMOKE" >/dev/null
  SMOKE=""
done
step_done

log "images done in $((SECONDS - START)) s:"
printf '%s\n' "${TIMES[@]}" >&2
exit 0
}
