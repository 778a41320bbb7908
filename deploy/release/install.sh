#!/usr/bin/env bash
# Installs a cellgate release from the directory this script is in (an unpacked
# cellgate-VERSION-linux-x86_64.tar.gz), as DEPLOY.md §2 describes: the binary and the kernel
# zygote's library, the kernelspecs, the python3 kernel's environment built where the
# sandboxes show it (/opt/cellgate/venv, from Debian's python3.11), the policies and the
# settings. Run as root. Idempotent: existing policies and settings are never overwritten.
#
#   ./install.sh [--prefix DIR] [--etc DIR] [--venv DIR | --no-venv]
#
#   --prefix DIR   where bin/ and share/cellgate/ go (default /usr/local)
#   --etc DIR      policies and settings (default /etc/cellgate)
#   --venv DIR     link the kernelspec to this existing kernel environment instead of
#                  building /opt/cellgate/venv (its launcher files are brought up to date)
#   --no-venv      install no kernel environment (the kernelspec then has none)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix=/usr/local
etc=/etc/cellgate
venv=/opt/cellgate/venv
build_venv=1
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --etc) etc=$2; shift 2 ;;
    --venv) venv=$2; build_venv=0; shift 2 ;;
    --no-venv) venv=""; build_venv=0; shift ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
log() { printf '==> %s\n' "$*" >&2; }

log "binary: $prefix/bin/cellgate (and the kernel zygote's library beside it)"
install -d "$prefix/bin"
install -m 0755 "$here/bin/cellgate" "$prefix/bin/cellgate"
install -m 0644 "$here/bin/libcellgate_zygote.so" "$prefix/bin/libcellgate_zygote.so"

# The files every kernel environment carries in its site-packages (the sandboxes mount the
# venv, not the kernelspec directory).
launcher_files=(cellgate_kernel_launcher.py cellgate_display.py cellgate_command.py)
if [ "$build_venv" -eq 1 ]; then
  if [ -x "$venv/bin/python" ]; then
    log "kernel environment: $venv exists; installing the release's lock file into it"
  else
    command -v python3.11 >/dev/null ||
      { echo "install.sh: python3.11 is needed (Debian: apt-get install python3.11 python3.11-venv)" >&2; exit 1; }
    log "kernel environment: python3.11 -m venv $venv"
    python3.11 -m venv "$venv"
  fi
  "$venv/bin/pip" install --no-input --disable-pip-version-check -r "$here/share/kernels/python3/requirements.txt"
  purelib="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  for file in "${launcher_files[@]}"; do
    install -m 0644 "$here/share/kernels/python3/$file" "$purelib/$file"
    "$venv/bin/python" -m compileall -q "$purelib/$file" >/dev/null
  done
fi

log "kernelspecs: $prefix/share/cellgate/kernels"
for spec in "$here"/share/kernels/*/; do
  name="$(basename "$spec")"
  dest="$prefix/share/cellgate/kernels/$name"
  install -d "$dest"
  find "$spec" -maxdepth 1 -type f ! -name '*.py' -exec install -m 0644 {} "$dest/" \;
done
if [ -n "$venv" ]; then
  # A venv given with --venv gets this release's launcher files too: commands and forked
  # kernels need the ones of the binary they run with.
  if [ "$build_venv" -eq 0 ]; then
    [ -x "$venv/bin/python" ] || { echo "install.sh: --venv $venv has no bin/python" >&2; exit 1; }
    purelib="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    for file in "${launcher_files[@]}"; do
      if ! cmp -s "$here/share/kernels/python3/$file" "$purelib/$file"; then
        install -m 0644 "$here/share/kernels/python3/$file" "$purelib/$file"
        "$venv/bin/python" -m compileall -q "$purelib/$file" >/dev/null
      fi
    done
  fi
  ln -sfn "$venv" "$prefix/share/cellgate/kernels/python3/.venv"
fi

log "policies and settings: $etc (existing files kept)"
install -d -m 0755 "$etc/policies"
for policy in "$here"/share/policies/*.toml; do
  [ -e "$etc/policies/$(basename "$policy")" ] || install -m 0644 "$policy" "$etc/policies/"
done
[ -e "$etc/cellgate.toml" ] || install -m 0644 "$here/etc/cellgate.toml" "$etc/cellgate.toml"
[ -e "$etc/cellgate.env" ] || install -m 0600 "$here/etc/cellgate.env" "$etc/cellgate.env"

log "done: $prefix/bin/cellgate serve --kernels-dir $prefix/share/cellgate/kernels --policies-dir $etc/policies"
log "(DEPLOY.md: the systemd unit, tokens, cellgate doctor)"
