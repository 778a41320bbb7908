#!/usr/bin/env bash
# Installs a cellgate release from the directory this script is in (an unpacked
# cellgate-VERSION-linux-x86_64.tar.gz), as DEPLOY.md §2 describes: the binary and the kernel
# zygote's library, the kernelspecs with their environments, the policies and the settings.
# Run as root. Idempotent: existing policies and settings are never overwritten.
#
#   ./install.sh [--prefix DIR] [--etc DIR] [--kernels LIST] [--envs DIR] [--venv DIR | --no-venv]
#                [--env NAME=DIR]...
#
#   --prefix DIR     where bin/ and share/cellgate/ go (default /usr/local)
#   --etc DIR        policies and settings (default /etc/cellgate)
#   --kernels LIST   the kernelspecs to install, comma-separated (default
#                    python3,bash,deno,ir; python3-lean is the small Python stack). Each
#                    gets its environment:
#                      python3        /opt/cellgate/venv, from its lock file (pip)
#                      python3-lean,  ENVS/NAME, from its lock file (pip)
#                      bash
#                      deno           ENVS/deno: Deno's binary, the npm
#                                     registry's tarball the release names, sha256 checked
#                                     (npm, or curl from $NPM_CONFIG_REGISTRY)
#                      ir             ENVS/ir, and Debian's R with IRkernel,
#                                     ggplot2, dplyr, readr, tidyr (apt-get)
#                    A kernelspec whose environment cannot be made is left out, loudly.
#   --envs DIR       where the environments of kernels other than python3 are made
#                    (default /opt/cellgate/envs)
#   --env NAME=DIR   link kernelspec NAME to this existing environment instead of making one
#                    (its kernel's own files are brought up to date); repeatable
#   --venv DIR       the same as --env python3=DIR
#   --no-venv        install python3's kernelspec without an environment
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix=/usr/local
etc=/etc/cellgate
kernels=python3,bash,deno,ir
envs=/opt/cellgate/envs
declare -A given=()
no_venv=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --etc) etc=$2; shift 2 ;;
    --kernels) kernels=$2; shift 2 ;;
    --envs) envs=$2; shift 2 ;;
    --env)
      case "$2" in *=?*) ;; *) echo "install.sh: --env takes NAME=DIR, not $2" >&2; exit 2 ;; esac
      given[${2%%=*}]=${2#*=}; shift 2 ;;
    --venv) given[python3]=$2; shift 2 ;;
    --no-venv) no_venv=1; shift ;;
    -h | --help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
SCRATCH=()
trap 'rm -rf "${SCRATCH[@]}"' EXIT
log() { printf '==> %s\n' "$*" >&2; }
warn() { printf '==> WARNING: %s\n' "$*" >&2; }
IFS=, read -ra wanted <<<"$kernels"
for name in "${wanted[@]}"; do
  [ -f "$here/share/kernels/$name/kernel.json" ] ||
    { echo "install.sh: no kernelspec $name in this release (it has: $(ls "$here/share/kernels" | tr '\n' ' '))" >&2; exit 2; }
done
for name in "${!given[@]}"; do
  [[ ",$kernels," == *",$name,"* ]] || { echo "install.sh: --env $name=… for a kernel not in --kernels $kernels" >&2; exit 2; }
  dir=${given[$name]}
  case "$name" in
    python3 | python3-lean | bash) need=bin/python ;;
    deno) need=bin/deno ;;
    *) need="" ;;
  esac
  [ -d "$dir" ] && { [ -z "$need" ] || [ -x "$dir/$need" ]; } ||
    { echo "install.sh: --env $name=$dir: no such environment${need:+ (no $need)}" >&2; exit 2; }
done

log "binary: $prefix/bin/cellgate (and the kernel zygote's library beside it)"
install -d "$prefix/bin"
install -m 0755 "$here/bin/cellgate" "$prefix/bin/cellgate"
install -m 0644 "$here/bin/libcellgate_zygote.so" "$prefix/bin/libcellgate_zygote.so"

# Where the sandboxes show every kernel's environment: a Python venv made elsewhere is made
# as if it were there (in a private mount namespace), so none of its files names another path.
SHOWN_AT=/opt/cellgate/venv
# The files each kernel's environment carries beside its packages (the sandboxes mount the
# environment, not the kernelspec's directory).
declare -A kernel_files=(
  [python3]="cellgate_kernel_launcher.py cellgate_display.py cellgate_command.py"
  [python3-lean]="cellgate_kernel_launcher.py cellgate_command.py"
  [bash]="cellgate_bash_kernel.py cellgate_command.py"
)

# purelib VENV: its site-packages directory.
purelib() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# python_files NAME VENV: the kernel's own Python files into VENV, compiled (changed ones only).
python_files() {
  local name=$1 venv=$2 lib file src
  lib="$(purelib "$venv")" && [ -d "$lib" ] || { warn "$name: $venv has no site-packages"; return 1; }
  for file in ${kernel_files[$name]}; do
    src="$here/share/kernels/$name/$file"
    [ -f "$src" ] || src="$here/share/kernels/python3/$file"
    if ! cmp -s "$src" "$lib/$file"; then
      install -m 0644 "$src" "$lib/$file" || return 1
      "$venv/bin/python" -m compileall -q "$lib/$file" >/dev/null || return 1
    fi
  done
}

# python_env NAME DIR: a venv at DIR from NAME's lock file, made as if at $SHOWN_AT.
python_env() {
  local name=$1 dir=$2 lock="$here/share/kernels/$1/requirements.txt"
  # Debian's interpreter, as the images' and ./dev setup's are, ahead of any other on PATH.
  local python=/usr/bin/python3.11
  [ -x "$python" ] || python="$(command -v python3.11)" ||
    { warn "$name: python3.11 is needed (Debian: apt-get install python3.11 python3.11-venv)"; return 1; }
  local make="$python -m venv \"\$0\" && \"\$0/bin/pip\" install --no-input --disable-pip-version-check --quiet -r \"\$1\""
  if [ "$dir" = "$SHOWN_AT" ]; then
    log "kernel $name: $dir from its lock file"
    sh -c "$make" "$dir" "$lock" || return 1
  else
    install -d "$dir" "$SHOWN_AT"
    if unshare --mount --propagation private true 2>/dev/null; then
      log "kernel $name: $dir from its lock file (made as if at $SHOWN_AT)"
      unshare --mount --propagation private sh -c \
        "mount --bind \"\$2\" \"\$0\" && $make" "$SHOWN_AT" "$lock" "$dir" || return 1
    else
      warn "$name: no private mount namespace here (unshare); its files will name $dir"
      sh -c "$make" "$dir" "$lock" || return 1
    fi
  fi
}

# mark DIR: an environment without Python, which the sandboxes show whole at $SHOWN_AT.
mark() {
  printf '%s\n' "cellgate kernel environment: the sandboxes show this directory at $SHOWN_AT" >"$1/cellgate-environment"
}

# deno_env DIR: Deno's binary as the release's environment.lock names it, and the relay.
deno_env() {
  local dir=$1 lock="$here/share/kernels/deno/environment.lock" package version sha tmp tarball
  package="$(sed -n 's/^package=//p' "$lock")"
  version="$(sed -n 's/^version=//p' "$lock")"
  sha="$(sed -n 's/^sha256=//p' "$lock")"
  install -d "$dir/bin" || return 1
  if ! [ -x "$dir/bin/deno" ] || [ "$(cat "$dir/.installed" 2>/dev/null)" != "$package@$version sha256=$sha" ]; then
    tmp="$(mktemp -d)"
    SCRATCH+=("$tmp")
    if command -v npm >/dev/null; then
      log "kernel deno: npm pack $package@$version"
      (cd "$tmp" && npm pack --silent "$package@$version" >/dev/null) || { warn "deno: npm pack $package@$version failed"; return 1; }
    elif command -v curl >/dev/null; then
      local registry="${NPM_CONFIG_REGISTRY:-https://registry.npmjs.org}"
      log "kernel deno: $package@$version from $registry"
      curl -fsSL -o "$tmp/deno.tgz" "${registry%/}/$package/-/${package##*/}-$version.tgz" ||
        { warn "deno: downloading $package@$version failed"; return 1; }
    else
      warn "deno: needs npm or curl to fetch $package@$version"; return 1
    fi
    tarball="$(ls "$tmp"/*.tgz)"
    [ "$(sha256sum <"$tarball" | cut -d' ' -f1)" = "$sha" ] ||
      { warn "deno: $package@$version's tarball does not have the sha256 the release names"; return 1; }
    tar -xzf "$tarball" -C "$tmp" package/deno || { warn "deno: no binary in $package@$version"; return 1; }
    install -m 0755 "$tmp/package/deno" "$dir/bin/deno" || return 1
    printf '%s\n' "$package@$version sha256=$sha" >"$dir/.installed" || return 1
  fi
  mark "$dir"
}

# r_env DIR: Debian's R and the kernel's packages, and the kernel's start files.
r_env() {
  local dir=$1 missing=() package
  mapfile -t packages <"$here/share/kernels/ir/debian-packages"
  for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' || missing+=("$package")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null || { warn "ir: needs Debian's ${missing[*]}"; return 1; }
    log "kernel ir: apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null ||
      { warn "ir: apt-get install ${missing[*]} failed"; return 1; }
  fi
}

# r_files DIR, deno_files DIR: the kernel's own files into its environment.
# (Each step checked: these run where `set -e` is off, under `if ! environment`.)
r_files() {
  install -d "$1/bin" "$1/lib" &&
    install -m 0755 "$here/share/kernels/ir/r-kernel" "$1/bin/r-kernel" &&
    install -m 0644 "$here/share/kernels/ir/cellgate_kernel.R" "$1/lib/cellgate_kernel.R" &&
    mark "$1"
}
deno_files() {
  install -d "$1/bin" || return 1
  cmp -s "$here/share/kernels/deno/cellgate-tcp-kernel" "$1/bin/cellgate-tcp-kernel" ||
    install -m 0755 "$here/share/kernels/deno/cellgate-tcp-kernel" "$1/bin/cellgate-tcp-kernel" ||
    return 1
  mark "$1"
}

# environment NAME: makes (or brings up to date) NAME's environment, at ENV_DIR.
environment() {
  local name=$1 dir
  if [ -n "${given[$name]:-}" ]; then
    dir=${given[$name]}
    log "kernel $name: the environment at $dir (its kernel's files brought up to date)"
  else
    dir=$envs/$name
    [ "$name" = python3 ] && dir=$SHOWN_AT
    case "$name" in
      python3 | python3-lean | bash)
        if [ -x "$dir/bin/python" ]; then
          log "kernel $name: $dir exists; installing the release's lock file into it"
          "$dir/bin/pip" install --no-input --disable-pip-version-check --quiet \
            -r "$here/share/kernels/$name/requirements.txt" || return 1
        else
          python_env "$name" "$dir" || return 1
        fi ;;
      deno) deno_env "$dir" || return 1 ;;
      ir) r_env "$dir" || return 1 ;;
      *) warn "$name: this script does not know how to make its environment"; return 1 ;;
    esac
  fi
  case "$name" in
    python3 | python3-lean | bash) python_files "$name" "$dir" || return 1 ;;
    deno) deno_files "$dir" || return 1 ;;
    ir) r_files "$dir" || return 1 ;;
  esac
  ENV_DIR=$dir
}

log "kernelspecs: $prefix/share/cellgate/kernels"
installed=()
for name in "${wanted[@]}"; do
  ENV_DIR=""
  if [ "$name" = python3 ] && [ "$no_venv" -eq 1 ]; then
    log "kernel python3: no environment (--no-venv)"
  elif ! environment "$name"; then
    warn "kernel $name is not installed: its environment could not be made (above)"
    continue
  fi
  env_dir=$ENV_DIR
  dest="$prefix/share/cellgate/kernels/$name"
  install -d "$dest"
  find "$here/share/kernels/$name" -maxdepth 1 -type f \( -name kernel.json -o -name 'logo-*' \) \
    -exec install -m 0644 {} "$dest/" \;
  [ -z "$env_dir" ] || ln -sfn "$env_dir" "$dest/.venv"
  installed+=("$name")
done
[ "${#installed[@]}" -gt 0 ] || { echo "install.sh: no kernel could be installed" >&2; exit 1; }
log "kernels installed: ${installed[*]}"

log "policies and settings: $etc (existing files kept)"
install -d -m 0755 "$etc/policies"
for policy in "$here"/share/policies/*.toml; do
  [ -e "$etc/policies/$(basename "$policy")" ] || install -m 0644 "$policy" "$etc/policies/"
done
[ -e "$etc/cellgate.toml" ] || install -m 0644 "$here/etc/cellgate.toml" "$etc/cellgate.toml"
[ -e "$etc/cellgate.env" ] || install -m 0600 "$here/etc/cellgate.env" "$etc/cellgate.env"

log "done: $prefix/bin/cellgate serve --kernels-dir $prefix/share/cellgate/kernels --policies-dir $etc/policies"
log "(DEPLOY.md: the systemd unit, tokens, cellgate doctor)"
