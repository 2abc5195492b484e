#!/usr/bin/env bash
# Installs the system tools that dflash and its tests use: tmux, an OpenSSH server and client
# (tests start their own sshd on 127.0.0.1), util-linux (unshare/nsenter), iproute2 and shellcheck
# (`make lint` and the suite check the bash dflash sends to a place).
set -euo pipefail
need=()
command -v tmux >/dev/null || need+=(tmux)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
{ command -v ssh && command -v ssh-keygen; } >/dev/null || need+=(openssh-client)  # ssh -G resolves configs
command -v unshare >/dev/null || need+=(util-linux)
command -v nsenter >/dev/null || need+=(util-linux)
command -v ip >/dev/null || need+=(iproute2)
command -v shellcheck >/dev/null || need+=(shellcheck)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing system packages: ${need[*]} (install them, e.g. sudo apt-get install ${need[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}" >/dev/null
