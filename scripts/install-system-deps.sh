#!/usr/bin/env bash
# Installs the system tools dflash needs: `run` (what `make run` needs: tmux, the job's session),
# or `test` (the default: also an OpenSSH server and client, the tests' sshd on 127.0.0.1 and
# `ssh -G`; util-linux's unshare/nsenter and iproute2 for the Proxmox stand-in and its network
# tests; shellcheck for `make lint` and the suite's check of the bash dflash sends to a place).
set -euo pipefail
want=${1:-test}
case $want in
  run | test) ;;
  *) echo "usage: $0 [run|test]" >&2; exit 2 ;;
esac
need=()
command -v tmux >/dev/null || need+=(tmux)
if [ "$want" = test ]; then
  [ -x /usr/sbin/sshd ] || need+=(openssh-server)
  { command -v ssh && command -v ssh-keygen; } >/dev/null || need+=(openssh-client)
  command -v unshare >/dev/null || need+=(util-linux)
  command -v nsenter >/dev/null || need+=(util-linux)
  command -v ip >/dev/null || need+=(iproute2)
  command -v shellcheck >/dev/null || need+=(shellcheck)
fi
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing system packages: ${need[*]} (install them, e.g. sudo apt-get install ${need[*]})" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}" >/dev/null
